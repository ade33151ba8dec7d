"""The guard that wraps every tool call: rules (recall) → optional LLM judge (precision) → allow or block.

A blocked call is not executed; the agent gets a dummy observation shaped like the failure the hardened
sandbox itself would give (ALGORITHMS.md §4.5), and the episode goes on. There is no reward penalty by default:
blocking makes a hack useless instead of punished, which avoids teaching the policy to hide it (§4.1).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Literal, Protocol

from antihack.rules import CallView, Rule, normalize, select_rules
from antihack.types import GuardContext, RuleHit, Verdict
from environments.types import ToolCall


class Judge(Protocol):
    """Stage 2 (the anti-hack guard issue builds it): decides flagged calls."""

    def decide(self, call: ToolCall, context: GuardContext, hits: list[RuleHit]) -> Verdict: ...


@dataclass
class DummyObservation:
    text: str
    exit_code: int


@dataclass
class GuardStats:
    calls: int = 0
    flagged: int = 0
    blocked: int = 0
    judged: int = 0
    latencies: list[float] = field(default_factory=list)

    def as_metrics(self) -> dict[str, float]:
        n = max(self.calls, 1)
        lat = sorted(self.latencies) or [0.0]
        return {"guard/calls": self.calls, "guard/flag_rate": self.flagged / n, "guard/block_rate": self.blocked / n,
                "guard/judge_rate": self.judged / n, "guard/latency_p50_ms": 1000 * lat[len(lat) // 2],
                "guard/latency_p99_ms": 1000 * lat[min(len(lat) - 1, int(0.99 * len(lat)))]}


class Guard:
    def __init__(self, rules: list[Rule] | list[str] | None = None, judge: Judge | None = None,
                 enabled: bool = True, dummy_mode: Literal["environment_consistent", "explicit_notice"] =
                 "environment_consistent"):
        if rules and isinstance(rules[0], str):
            rules = select_rules(rules)  # type: ignore[arg-type]
        self.rules: list[Rule] = list(rules) if rules else select_rules(None)
        self.judge = judge
        self.enabled = enabled
        if dummy_mode not in ("environment_consistent", "explicit_notice"):
            raise ValueError(f"unknown dummy_mode {dummy_mode!r}")
        self.dummy_mode = dummy_mode
        self.stats = GuardStats()

    def check(self, call: ToolCall, context: GuardContext) -> Verdict:
        """Decide one call before it runs. The call joins the episode's history either way."""
        started = time.perf_counter()
        verdict = Verdict("allow")
        if self.enabled:
            view = CallView.of(call)
            hits = [h for r in self.rules if r.id not in context.allowed_rule_ids
                    for h in [r.apply(view, context)] if h]
            verdict = self._decide(call, context, hits)
        context.history.append(call)
        verdict.latency = time.perf_counter() - started
        self.stats.calls += 1
        self.stats.flagged += verdict.flagged
        self.stats.blocked += verdict.action == "block"
        self.stats.judged += verdict.stage == "judge"
        self.stats.latencies.append(verdict.latency)
        return verdict

    def _decide(self, call: ToolCall, context: GuardContext, hits: list[RuleHit]) -> Verdict:
        if not hits:
            return Verdict("allow")
        ids = [h.rule_id for h in hits]
        blocking = [h for h in hits if h.severity == "block"]
        if blocking:
            return Verdict("block", "rules", ids, blocking[0].reason, category=blocking[0].category, hits=hits)
        if self.judge is not None:
            verdict = self.judge.decide(call, context, hits)
            verdict.hits, verdict.rule_ids = hits, ids
            return verdict
        return Verdict("allow", "rules", ids, "flagged; no judge configured", category=hits[0].category, hits=hits)

    def dummy_observation(self, call: ToolCall, verdict: Verdict) -> DummyObservation:
        """What the agent sees instead of the call's result: never a fabricated success (§4.5)."""
        if self.dummy_mode == "explicit_notice":
            return DummyObservation(f"This action is not allowed in this task (category: {verdict.category}). "
                                    "Continue by changing the source code.", 1)
        args = call.arguments if isinstance(call.arguments, dict) else {}
        target = normalize(str(args.get("path") or "")) or "file"
        if verdict.category == "network_download":
            command = str(args.get("command", ""))
            if "wget" in command or "curl" in command:
                host = next((w.split("/")[2] for w in command.split() if "://" in w and len(w.split("/")) > 2),
                            "github.com")
                return DummyObservation(f"curl: (6) Could not resolve host: {host}", 6)
            return DummyObservation("OSError: [Errno 101] Network is unreachable", 1)
        if verdict.category == "hidden_data_access":
            return DummyObservation("No such file or directory", 1)
        if call.name == "write_file":
            return DummyObservation(f"Error: [Errno 13] Permission denied: '{target}'", 1)
        return DummyObservation("Permission denied", 1)
