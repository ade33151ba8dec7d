"""Checkpoints: HF-format actor and critic, DeepSpeed states (optimizer included), the data position and RNG.

A checkpoint directory is complete once its `trainer_state.json` exists, written last and by an atomic rename; a
run resumes from the newest complete one, so a run killed mid-save resumes from the previous one. The `latest`
file names it too (for people and scripts), updated after it, also by a rename.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path


class Checkpointer:
    def __init__(self, run_dir: Path, keep: int = 2):
        self.root = Path(run_dir) / "checkpoints"
        self.root.mkdir(parents=True, exist_ok=True)
        self.keep = keep

    def path(self, step: int) -> Path:
        return self.root / f"step_{step:06d}"

    def save(self, step: int, save_actor, save_critic, state: dict) -> Path:
        """`save_actor(folder)` / `save_critic(folder)` write the workers' parts (they may run remotely)."""
        folder = self.path(step)
        if folder.exists():
            shutil.rmtree(folder)
        folder.mkdir(parents=True)
        save_actor(str(folder / "actor"))
        if save_critic is not None:  # None: a run without a critic (pure on-policy distillation)
            save_critic(str(folder / "critic"))
        tmp = folder / "trainer_state.json.tmp"
        tmp.write_text(json.dumps(state, indent=1))
        os.replace(tmp, folder / "trainer_state.json")
        tmp = self.root / "latest.tmp"
        tmp.write_text(folder.name)
        os.replace(tmp, self.root / "latest")
        self._prune()
        return folder

    def latest(self) -> Path | None:
        """The newest complete checkpoint (even when the run died before updating `latest`), or None."""
        complete = sorted(p for p in self.root.glob("step_*") if (p / "trainer_state.json").exists())
        return complete[-1] if complete else None

    @staticmethod
    def has_optimizer_state(folder: Path) -> bool:
        """Whether a checkpoint resumes exactly (its actor's `state/`), or holds only HF weights (dropped to carry it
        between machines: rl.train's trainer.resume_weights_only)."""
        return (Path(folder) / "actor" / "state").exists()

    @staticmethod
    def load_state(folder: Path) -> dict:
        return json.loads((Path(folder) / "trainer_state.json").read_text())

    def _prune(self) -> None:
        complete = sorted(p for p in self.root.glob("step_*") if (p / "trainer_state.json").exists())
        for old in complete[:-self.keep] if self.keep > 0 else []:
            shutil.rmtree(old, ignore_errors=True)
