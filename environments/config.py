"""Configuration of the environments: which tasks, which sandbox and its limits, how an episode is graded."""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from environments.sandbox import BACKENDS, SandboxLimits
from environments.tasks import SHIPPED_TASKS

REWARDS = ("pass_fraction", "fail_to_pass", "binary")


def training_limits() -> SandboxLimits:
    """The sandbox's own limits, with 20 s a command instead of 30: in a training step every episode waits for
    the slowest, and a command that needs longer is usually stuck (a server started in the foreground, an
    endless loop)."""
    return SandboxLimits(timeout_s=20.0)


@dataclass
class EnvConfig:
    tasks: str = SHIPPED_TASKS  # JSONL / parquet file, saved dataset folder, or hub dataset name
    train_split: str = "train"
    eval_split: str = "heldout"
    # The split whose reference trajectories rl.sft trains on ("": train_split). Another split than RL's makes RL
    # meet tasks the cold start never saw, as the held-out ones are (long_horizon_gen_split_gpu).
    sft_split: str = ""
    # Another task set (every record, one episode each, e.g. "humaneval") evaluated before the first and after
    # the last step, logged under eval_extra/: transfer beyond the training distribution, same sampling.
    extra_eval_tasks: str = ""
    sandbox: str = "bwrap"  # bwrap | docker
    reward: str = "pass_fraction"  # pass_fraction | fail_to_pass | binary (environments.grading._reward)
    grade_timeout_s: float = 60.0
    limits: SandboxLimits = field(default_factory=training_limits)

    def problems(self, prefix: str = "env") -> list[str]:
        """What is wrong with these settings, each as `key=value: why` (empty: nothing)."""
        out = []
        if self.sandbox not in BACKENDS:
            out.append(f"{prefix}.sandbox={self.sandbox!r}: must be one of {sorted(BACKENDS)}")
        if self.reward not in REWARDS:
            out.append(f"{prefix}.reward={self.reward!r}: must be one of {list(REWARDS)}")
        if self.grade_timeout_s <= 0:
            out.append(f"{prefix}.grade_timeout_s={self.grade_timeout_s}: must be > 0")
        for f in fields(self.limits):
            if getattr(self.limits, f.name) <= 0:
                out.append(f"{prefix}.limits.{f.name}={getattr(self.limits, f.name)}: must be > 0")
        return out
