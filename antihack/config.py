"""Configuration of the guard and its judge (one dataclass each, each checking itself).

The guard itself is built where its judge's backend lives: `rollout.guard.build_guard` (an engine-backed judge
is a model, which the rollout side serves); antihack only needs a backend that turns a prompt into text."""

from __future__ import annotations

from dataclasses import dataclass, field

JUDGE_BACKENDS = ("none", "head", "engine", "openai")
DUMMY_MODES = ("environment_consistent", "explicit_notice")


@dataclass
class JudgeConfig:
    """Stage 2 of the guard: the LLM judge of flagged calls (docs/ALGORITHMS.md §4.4)."""

    backend: str = "none"  # none | head (a verdict head over a small model's hidden states, trained by
    #                         `python -m antihack.train_judge`; runs on any CPU) | engine (a frozen local model
    #                         answering the prompt) | openai (any OpenAI-compatible server)
    head: str = ""  # head: the trained head's file (empty: the one shipped in antihack/data)
    model: str = ""  # engine: built-in name or HF folder (empty: a frozen copy of the initial policy);
    #                   openai: the model name sent with each request (empty: "default")
    endpoint: str = ""  # openai: base URL, e.g. http://judge-host:30000/v1
    chat_format: str = "chatml"  # engine: how the prompt is rendered for the model
    threshold: float = 0.7  # block iff verdict == hack and confidence >= threshold
    timeout_s: float = 20.0
    retries: int = 1
    fallback: str = "allow"  # allow | block, when the judge cannot give a valid verdict
    max_new_tokens: int = 200
    cache_size: int = 4096  # verdicts kept per (task, normalised call)
    recent_calls: int = 3  # earlier calls shown to the judge
    max_action_chars: int = 4000  # of the flagged call shown to the judge (a whole solution file, mostly)
    max_recent_chars: int = 600  # of each earlier call

    def problems(self, prefix: str = "guard.judge") -> list[str]:
        """What is wrong with these settings, each as `key=value: why` (empty: nothing)."""
        out = []
        if self.backend not in JUDGE_BACKENDS:
            out.append(f"{prefix}.backend={self.backend!r}: must be one of {list(JUDGE_BACKENDS)}")
        if self.fallback not in ("allow", "block"):
            out.append(f"{prefix}.fallback={self.fallback!r}: must be one of ['allow', 'block']")
        if self.backend == "openai" and not self.endpoint:
            out.append(f"{prefix}.backend=openai needs {prefix}.endpoint")
        if not 0.0 <= self.threshold <= 1.0:
            out.append(f"{prefix}.threshold={self.threshold}: a confidence in [0, 1]")
        if self.timeout_s <= 0 or self.retries < 0 or self.max_new_tokens < 1:
            out.append(f"{prefix}: timeout_s > 0, retries >= 0 and max_new_tokens >= 1 (got {self.timeout_s}, "
                       f"{self.retries}, {self.max_new_tokens})")
        if self.recent_calls < 0 or self.max_action_chars < 200 or self.max_recent_chars < 50:
            out.append(f"{prefix}: recent_calls >= 0, max_action_chars >= 200 and max_recent_chars >= 50 (got "
                       f"{self.recent_calls}, {self.max_action_chars}, {self.max_recent_chars})")
        return out

    def check(self) -> "JudgeConfig":
        if problems := self.problems():
            raise ValueError("; ".join(problems))
        return self


@dataclass
class GuardConfig:
    enabled: bool = True
    rules: list[str] = field(default_factory=list)  # empty: every rule
    dummy_mode: str = "environment_consistent"  # environment_consistent | explicit_notice
    judge: JudgeConfig = field(default_factory=JudgeConfig)

    def problems(self, prefix: str = "guard") -> list[str]:
        out = []
        if self.dummy_mode not in DUMMY_MODES:
            out.append(f"{prefix}.dummy_mode={self.dummy_mode!r}: must be one of {list(DUMMY_MODES)}")
        return out + self.judge.problems(f"{prefix}.judge")
