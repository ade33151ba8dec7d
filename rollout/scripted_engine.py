"""An engine that answers from a script: a reference trajectory played through the real agent loop.

Supervised data for an agent must be rendered exactly as the agent loop renders an episode (its chat template,
tool-call format, observations, truncation and compaction), or the policy learns a format it never sees in RL.
`ScriptedEngine` lets the loop itself do the rendering: it stands in for the policy and replies, turn by turn,
the reference trajectory's tool calls in the run's tool format, each ended by the chat format's end-of-turn token
as a model would end it; when the loop asks for a compaction summary it replies a handoff note written from
the calls made so far. Every other part of the episode is real: the sandbox runs the calls, the guard checks
them, the observations and the grade are the environment's. The episode's segments then hold the token ids and
loss masks RL would train on.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import torch

from environments import ToolCall
from rollout.compaction import SUMMARY_INSTRUCTION
from rollout.tool_parsers import ToolCallParser
from rollout.types import GenerateResult, SamplingParams

_SUMMARY_MARK = SUMMARY_INSTRUCTION.split(";")[0][:60]  # how the loop's summary request begins


class ScriptTooLong(RuntimeError):
    """A scripted reply does not fit the turn's token budget (agent.max_new_tokens or the context window)."""


class ScriptedEngine:
    weight_version = 0

    def __init__(self, calls: list[ToolCall], tokenizer, parser: ToolCallParser, end_ids: list[int]):
        self.calls, self.tokenizer, self.parser = list(calls), tokenizer, parser
        self.end_ids = list(end_ids)  # the end-of-turn token(s) a model emits to stop
        self.next = 0  # the next scripted call
        self.summaries = 0

    def _encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def summary(self) -> str:
        """A handoff note in the order the summary instruction asks for, from the calls made so far."""
        done = self.calls[:self.next]
        read = [c.arguments.get("command", c.arguments.get("path", "")) for c in done
                if c.name == "bash" or (c.name == "edit_file" and c.arguments.get("command") == "view")]
        changed = sorted({c.arguments.get("path", "") for c in done if c.name == "write_file"
                          or (c.name == "edit_file" and c.arguments.get("command") != "view")})
        tested = sum(c.name == "run_tests" for c in done)
        lines = ["Goal: make the failing behaviour described in the task correct, with the visible tests passing.",
                 f"Facts: the visible tests run with run_tests (run {tested} time(s) so far)."]
        if read:
            lines.append("Looked at: " + "; ".join(str(r)[:120] for r in read[-6:]))
        lines.append("Changed: " + (", ".join(changed) if changed else "nothing yet") + ".")
        upcoming = self.calls[self.next:self.next + 2]
        if upcoming:
            lines.append("Next: " + "; then ".join(f"{c.name} {str(c.arguments.get('path', '')).strip()}".strip()
                                                     for c in upcoming) + ".")
        return "\n".join(lines)

    async def generate(self, input_ids: list[int], sampling: SamplingParams, request_id: str | None = None,
                       session_id: str | None = None) -> GenerateResult:
        tail = self.tokenizer.decode(input_ids[-400:])
        if _SUMMARY_MARK in tail:
            text = self.summary()
            self.summaries += 1
        elif self.next < len(self.calls):
            text = self.parser.format_call(self.calls[self.next])
            self.next += 1
        else:
            text = self.parser.format_call(ToolCall("submit", {}))  # the script ended: nothing more to say
        ids = self._encode(text) + self.end_ids
        if len(ids) > sampling.max_new_tokens:
            raise ScriptTooLong(f"a scripted reply of {len(ids)} tokens exceeds this turn's budget of "
                                f"{sampling.max_new_tokens}")
        return GenerateResult(output_ids=ids, output_logprobs=[0.0] * len(ids), finish_reason="stop",
                              meta={"weight_version": 0})

    async def update_weights(self, weights: Mapping[str, torch.Tensor] | str | Path,
                             version: int | None = None) -> None:
        raise RuntimeError("a scripted engine has no weights")

    async def pause(self) -> None:
        return None

    async def resume(self) -> None:
        return None

    async def abort(self, request_ids: list[str]) -> None:
        return None

    async def health(self) -> dict:
        return {"ok": True, "scripted": True}
