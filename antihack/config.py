"""Configuration of the guard and its judge, and the one place that builds them from it."""

from __future__ import annotations

from dataclasses import dataclass, field

from antihack.guard import Guard
from antihack.judge import EngineJudgeBackend, JudgeConfig, LLMJudge, OpenAIJudgeBackend


@dataclass
class JudgeSettings:
    backend: str = "none"  # none | engine (a frozen local model) | openai (any OpenAI-compatible server)
    model: str = ""  # engine: built-in name or HF folder (empty: a frozen copy of the initial policy)
    endpoint: str = ""  # openai: base URL, e.g. http://judge-host:30000/v1
    chat_format: str = "chatml"
    threshold: float = 0.7
    timeout_s: float = 20.0
    retries: int = 1
    fallback: str = "allow"  # allow | block
    max_new_tokens: int = 200


@dataclass
class GuardConfig:
    enabled: bool = True
    rules: list[str] = field(default_factory=list)  # empty: every rule
    dummy_mode: str = "environment_consistent"  # environment_consistent | explicit_notice
    judge: JudgeSettings = field(default_factory=JudgeSettings)


def build_guard(cfg: GuardConfig, initial_policy: str = "") -> Guard:
    """The guard of one rollout worker. An engine-backed judge is a separate, frozen model: never the policy
    being trained, so that it cannot co-adapt with it (docs/ALGORITHMS.md §4.4)."""
    j = cfg.judge
    judge = None
    if cfg.enabled and j.backend != "none":
        settings = JudgeConfig(backend=j.backend, endpoint=j.endpoint, model=j.model or initial_policy,
                               threshold=j.threshold, timeout_s=j.timeout_s, retries=j.retries, fallback=j.fallback,
                               max_new_tokens=j.max_new_tokens)
        if j.backend == "engine":
            from rollout.chat import make_chat_format
            from rollout.local_engine import LocalEngine

            engine = LocalEngine.from_pretrained(settings.model)
            judge = LLMJudge(EngineJudgeBackend(engine, engine.tokenizer, make_chat_format(j.chat_format)), settings)
        elif j.backend == "openai":
            if not j.endpoint:
                raise ValueError("guard.judge.backend=openai needs guard.judge.endpoint")
            judge = LLMJudge(OpenAIJudgeBackend(j.endpoint, settings.model or "default", j.timeout_s), settings)
        else:
            raise ValueError(f"guard.judge.backend must be none, engine or openai, got {j.backend!r}")
    return Guard(list(cfg.rules) or None, judge=judge, enabled=cfg.enabled, dummy_mode=cfg.dummy_mode)
