"""Run outputs: metrics.jsonl (one line per step), wandb (offline by default), curves as PNG."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

CURVES = [
    ("rollout/reward_mean", "eval/reward_mean"), ("rollout/pass_rate", "eval/pass_rate", "eval_extra/pass_rate"),
    ("actor/kl_ref", "actor/approx_kl"), ("critic/value_loss",), ("critic/explained_variance",),
    ("actor/entropy",), ("actor/clipfrac", "critic/value_clipfrac"), ("rollout/episode_tokens_mean",),
    ("rollout/guard_blocks", "rollout/compactions"), ("perf/step_s", "perf/rollout_s", "perf/train_s"),
]


def _clean(value):
    if isinstance(value, float) and (math.isnan(value) or math.isinf(value)):
        return None
    return value


class MetricsLogger:
    def __init__(self, run_dir: Path, wandb_mode: str = "offline", project: str = "agentic-rl",
                 run_name: str = "run", config: dict | None = None, resume_step: int | None = None,
                 resume_record: dict | None = None):
        """`resume_step`: the checkpoint's step; the lines of later steps are forgotten (they run again).
        `resume_record`: that step's line as the checkpoint kept it (`record`), written back if the run died
        between its checkpoint and its line."""
        self.path = Path(run_dir) / "metrics.jsonl"
        restored = None
        if resume_step is not None:
            lines = self.path.read_text().splitlines() if self.path.exists() else []
            kept = [(line, json.loads(line).get("step", 0)) for line in lines if line.strip()]
            kept = [(line, step) for line, step in kept if step <= resume_step]
            if resume_record is not None and not any(step == resume_step for _, step in kept):
                restored = resume_record
                kept.append((json.dumps(restored), resume_step))
            if self.path.exists() or restored is not None:
                self.path.write_text("".join(line + "\n" for line, _ in kept))
        self._wandb = None
        if wandb_mode != "disabled":
            import wandb

            os.environ.setdefault("WANDB_SILENT", "true")
            self._wandb = wandb.init(project=project, name=run_name, dir=str(run_dir), mode=wandb_mode,
                                     config=config or {}, id=_run_id(run_dir), resume="allow")
            if restored is not None:
                self._wandb.log({k: v for k, v in restored.items() if v is not None}, step=restored["step"])

    @staticmethod
    def record(step: int, metrics: dict) -> dict:
        """A step's line: JSON-safe (NaN and ±inf as null)."""
        return {"step": step, **{k: _clean(v) for k, v in metrics.items()}}

    def log(self, step: int, metrics: dict) -> None:
        record = self.record(step, metrics)
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
        if self._wandb is not None:
            self._wandb.log({k: v for k, v in record.items() if v is not None}, step=step)

    def close(self) -> None:
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None


def _run_id(run_dir: Path) -> str:
    """A wandb id stable across restarts of the same run directory."""
    path = Path(run_dir) / ".wandb_id"
    if not path.exists():
        import uuid

        path.write_text(uuid.uuid4().hex[:16])
    return path.read_text().strip()


def read_metrics(path: Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def plot_curves(metrics_path: Path, out_png: Path, curves=CURVES) -> Path | None:
    """One small panel per curve group; keys that never appear are left out."""
    return _draw_panels({"": read_metrics(metrics_path)}, out_png, curves)


def plot_compare(runs: dict[str, Path], out_png: Path, curves=CURVES) -> Path | None:
    """The panels of `plot_curves` with one line per run and key, for runs made to be compared (the same
    experiment with one setting changed, at the same steps): {run name: its metrics.jsonl}."""
    if not runs:
        raise ValueError("plot_compare: no run given")
    return _draw_panels({name: read_metrics(path) for name, path in runs.items()}, out_png, curves)


def panel_lines(runs: dict[str, list[dict]], curves=CURVES) -> list[list[tuple[str, str, list, list]]]:
    """What each panel draws: (run name, key, steps, values) per run and key that has points; empty panels are
    left out."""
    panels = []
    for group in curves:
        lines = []
        for name, records in runs.items():
            for key in group:
                pts = [(r["step"], r[key]) for r in records if r.get(key) is not None]
                if pts:
                    lines.append((name, key, [p[0] for p in pts], [p[1] for p in pts]))
        if lines:
            panels.append(lines)
    return panels


def _draw_panels(runs: dict[str, list[dict]], out_png: Path, curves) -> Path | None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = panel_lines(runs, curves)
    if not panels:
        return None
    cols = 3
    rows = -(-len(panels) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 2.8 * rows), squeeze=False)
    names = list(runs)
    for ax, lines in zip(axes.flat, panels):
        keys = list(dict.fromkeys(key for _, key, _, _ in lines))
        for name, key, steps, values in lines:
            # several runs: one colour per run, one line style per key, so a run reads the same in every panel
            style = {} if len(names) == 1 else {"color": f"C{names.index(name) % 10}",
                                                 "linestyle": ("-", "--", ":", "-.")[keys.index(key) % 4]}
            ax.plot(steps, values, marker="o", markersize=3, label=f"{name}: {key}" if name else key, **style)
        ax.set_xlabel("step")
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    fig.tight_layout()
    fig.savefig(out_png, dpi=80)
    plt.close(fig)
    return out_png


def main(argv=None) -> None:
    """`python -m rl.run_log compare NAME=METRICS.jsonl... --out PNG`: several runs' curves on one figure."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m rl.run_log")
    sub = parser.add_subparsers(dest="command", required=True)
    compare = sub.add_parser("compare", help="several runs' curves on one figure")
    compare.add_argument("runs", nargs="+", metavar="NAME=METRICS.jsonl")
    compare.add_argument("--out", required=True, type=Path)
    args = parser.parse_args(argv)
    runs = {}
    for spec in args.runs:
        name, sep, path = spec.partition("=")
        if not sep or not name or not path:
            parser.error(f"{spec!r}: expected NAME=METRICS.jsonl")
        if not Path(path).is_file():
            parser.error(f"{name}: no metrics file at {path}")
        runs[name] = Path(path)
    if plot_compare(runs, args.out) is None:
        parser.error("none of the runs has a metric that the curves show")
    print(f"curves of {', '.join(runs)} -> {args.out}")


if __name__ == "__main__":
    main()
