"""The guard as a rollout worker runs it: its judge's backend built from the config, an engine of ours included.

antihack holds the rules, the judge's prompt and verdict checks, and an OpenAI-compatible backend; it imports
nothing from here. A judge on a local model needs an engine, so that backend (`EngineJudgeBackend`) and the
guard's construction from `GuardConfig` live on this side.

    python -m rollout.guard --corpus antihack/data/corpus.jsonl --judge antihack/data/judge_local.yaml

evaluates the guard on a labelled corpus like `python -m antihack.evaluate`, with any judge backend (that one
takes rules only or `backend: openai`).
"""

from __future__ import annotations

from antihack.config import GuardConfig, JudgeConfig
from antihack.guard import Guard
from antihack.judge import JudgeBackend, LLMJudge, OpenAIJudgeBackend
from rollout.chat import Message, make_chat_format
from rollout.types import SamplingParams

DEFAULT_JUDGE_MODEL = "smollm2-135m-instruct"  # what every machine of ours has; a real judge is a strong model


class EngineJudgeBackend:
    """Greedy completion on a `rollout.Engine` (token in / token out through a chat format)."""

    def __init__(self, engine, tokenizer, chat):
        self.engine, self.tokenizer, self.chat = engine, tokenizer, chat

    async def complete(self, prompt: str, max_new_tokens: int) -> str:
        text = self.chat.render([Message("user", prompt)])
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        stops = tuple(self.chat.stop_token_ids(self.tokenizer))
        result = await self.engine.generate(ids, SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens,
                                                                stop_token_ids=stops))
        return self.tokenizer.decode(result.output_ids, skip_special_tokens=True)


def judge_backend(cfg: JudgeConfig, default_model: str = "") -> JudgeBackend | None:
    """The backend `cfg` names (None for `none`). Without `cfg.model`, an engine judge loads `default_model` (the
    guard passes the initial policy; else SmolLM2), an OpenAI-compatible server is asked for `default_model` or
    "default". An engine judge is a frozen model of its own, never the policy being trained, so that it cannot
    co-adapt with it (docs/ALGORITHMS.md §4.4)."""
    cfg.check()
    if cfg.backend == "head":
        from antihack.verdict_head import head_backend

        return head_backend(cfg.head)
    if cfg.backend == "engine":
        from rollout.local_engine import LocalEngine

        engine = LocalEngine.from_pretrained(cfg.model or default_model or DEFAULT_JUDGE_MODEL)
        return EngineJudgeBackend(engine, engine.tokenizer, make_chat_format(cfg.chat_format))
    if cfg.backend == "openai":
        return OpenAIJudgeBackend(cfg.endpoint, cfg.model or default_model or "default", cfg.timeout_s)
    return None


def build_guard(cfg: GuardConfig, initial_policy: str = "", with_judge: bool = True) -> Guard:
    """The guard of one rollout worker; an engine judge without a model is a frozen copy of the initial policy.
    `with_judge=False`: the rules alone, no judge model loaded (rl.sft, which plays scripted reference calls)."""
    if problems := cfg.problems():
        raise ValueError("; ".join(problems))
    backend = judge_backend(cfg.judge, initial_policy) if cfg.enabled and with_judge else None
    judge = LLMJudge(backend, cfg.judge) if backend is not None else None
    return Guard(list(cfg.rules) or None, judge=judge, enabled=cfg.enabled, dummy_mode=cfg.dummy_mode)


if __name__ == "__main__":
    from antihack.evaluate import main

    main(judge_backend=judge_backend, prog="python -m rollout.guard")
