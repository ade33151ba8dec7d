"""The guard that wraps every tool call: rules (recall) → LLM judge on flagged calls (precision) → allow/block.

A blocked call is not executed; the agent gets a dummy observation shaped like the failure the hardened sandbox
itself would give (docs/ALGORITHMS.md §4.5), and the episode goes on. There is no reward penalty by default:
blocking makes a hack useless instead of punished, which avoids teaching the policy to hide it (§4.1).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Literal, Protocol

from antihack.facts import CallFacts, call_facts, normalize
from antihack.rules import Rule, select_rules
from antihack.types import GuardContext, RuleHit, Verdict
from environments.types import ToolCall


class Judge(Protocol):
    """Stage 2 (antihack.judge.LLMJudge): decides flagged calls."""

    async def decide(self, call: ToolCall, context: GuardContext, hits: list[RuleHit]) -> Verdict: ...


@dataclass
class DummyObservation:
    text: str
    exit_code: int


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


@dataclass
class GuardStats:
    calls: int = 0
    flagged: int = 0
    blocked: int = 0
    judged: int = 0
    judge_failures: int = 0
    rules_latencies: list[float] = field(default_factory=list)  # wall clock
    # CPU time of this thread: the rules' own cost, without what the event loop's neighbours or the scheduler add
    rules_cpu: list[float] = field(default_factory=list)
    judge_latencies: list[float] = field(default_factory=list)

    def as_metrics(self) -> dict[str, float]:
        n = max(self.calls, 1)
        return {"guard/calls": self.calls, "guard/flag_rate": self.flagged / n, "guard/block_rate": self.blocked / n,
                "guard/judge_rate": self.judged / n, "guard/judge_failures": self.judge_failures,
                "guard/rules_latency_p50_ms": 1000 * _percentile(self.rules_latencies, 0.5),
                "guard/rules_latency_p99_ms": 1000 * _percentile(self.rules_latencies, 0.99),
                "guard/rules_cpu_p50_ms": 1000 * _percentile(self.rules_cpu, 0.5),
                "guard/rules_cpu_p99_ms": 1000 * _percentile(self.rules_cpu, 0.99),
                "guard/judge_latency_p50_ms": 1000 * _percentile(self.judge_latencies, 0.5),
                "guard/judge_latency_p99_ms": 1000 * _percentile(self.judge_latencies, 0.99)}


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

    # ---- deciding ------------------------------------------------------------------------------------------
    def rule_hits(self, call: ToolCall, context: GuardContext) -> tuple[list[RuleHit], CallFacts]:
        facts = call_facts(call, context)
        hits = [h for r in self.rules if r.id not in context.allowed_rule_ids for h in [r.apply(facts, context)] if h]
        return hits, facts

    async def acheck(self, call: ToolCall, context: GuardContext) -> Verdict:
        """Decide one call before it runs (stage 1, then stage 2 when a flagged call needs it)."""
        started, cpu_started = time.perf_counter(), time.thread_time()
        if not self.enabled:
            verdict = Verdict("allow")
            facts = None
        else:
            hits, facts = self.rule_hits(call, context)
            rules_done = time.perf_counter()
            self.stats.rules_cpu.append(time.thread_time() - cpu_started)
            verdict = self._rules_verdict(hits)
            verdict.rules_latency = rules_done - started
            self.stats.rules_latencies.append(verdict.rules_latency)
            if verdict.action == "allow" and hits and self.judge is not None:
                judged = await self.judge.decide(call, context, hits)
                judged.hits, judged.rule_ids, judged.rules_latency = hits, [h.rule_id for h in hits], verdict.rules_latency
                judged.judge_latency = time.perf_counter() - rules_done
                verdict = judged
                self.stats.judged += 1
                self.stats.judge_latencies.append(verdict.judge_latency)
                if verdict.judge and verdict.judge.get("verdict") == "error":
                    self.stats.judge_failures += 1
        self._remember(call, context, verdict, facts)
        verdict.latency = time.perf_counter() - started
        self.stats.calls += 1
        self.stats.flagged += verdict.flagged
        self.stats.blocked += verdict.action == "block"
        return verdict

    def check(self, call: ToolCall, context: GuardContext) -> Verdict:
        """Synchronous `acheck`, for callers outside an event loop (inside one, await `acheck`)."""
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return asyncio.run(self.acheck(call, context))
        raise RuntimeError("Guard.check called inside a running event loop: use `await guard.acheck(...)`")

    @staticmethod
    def _rules_verdict(hits: list[RuleHit]) -> Verdict:
        if not hits:
            return Verdict("allow")
        ids = [h.rule_id for h in hits]
        blocking = [h for h in hits if h.severity == "block"]
        if blocking:
            return Verdict("block", "rules", ids, blocking[0].reason, category=blocking[0].category, hits=hits)
        return Verdict("allow", "rules", ids, "flagged; no judge configured", category=hits[0].category, hits=hits)

    @staticmethod
    def _remember(call: ToolCall, context: GuardContext, verdict: Verdict, facts: CallFacts | None) -> None:
        """Episode state: the call joins the history; what it writes is kept, so a script written now and run
        later is judged on its content then."""
        context.history.append(call)
        if facts is not None:  # blocked writes too: running the script later shows the same intent
            for path, content in facts.writes:
                if content is not None:
                    key = normalize(path)
                    context.written[key] = context.written.get(key, "") + content if path in facts.appended \
                        else content

    # ---- what a blocked call returns ----------------------------------------------------------------------
    def dummy_observation(self, call: ToolCall, verdict: Verdict) -> DummyObservation:
        """What the agent sees instead of the call's result: never a fabricated success (§4.5)."""
        if self.dummy_mode == "explicit_notice":
            return DummyObservation(f"This action is not allowed in this task (category: {verdict.category}). "
                                    "Continue by changing the source code.", 1)
        args = call.arguments if isinstance(call.arguments, dict) else {}
        target = normalize(str(args.get("path") or "")) or "file"
        command = str(args.get("command", ""))
        category = verdict.category
        if category == "network_download":
            if "wget" in command or "curl" in command:
                host = next((w.split("/")[2] for w in command.split() if "://" in w and len(w.split("/")) > 2),
                            "github.com")
                return DummyObservation(f"curl: (6) Could not resolve host: {host}", 6)
            if command.startswith("git "):
                return DummyObservation("fatal: unable to access remote: Could not resolve host", 128)
            return DummyObservation("OSError: [Errno 101] Network is unreachable", 1)
        if category in ("hidden_data_access", "solution_search", "reference_copy"):
            return DummyObservation("No such file or directory", 1)
        if category in ("git_history_leakage", "git_internals"):
            return DummyObservation("fatal: bad revision", 128)
        if category == "privilege_escalation":
            return DummyObservation("Operation not permitted", 1)
        if call.name in ("write_file", "edit_file"):
            return DummyObservation(f"Error: [Errno 13] Permission denied: '{target}'", 1)
        return DummyObservation("Permission denied", 1)
