"""Types of the guard contract (DESIGN.md §4): what a rule sees, what the guard decides."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from environments.types import ToolCall


@dataclass
class GuardContext:
    """What the guard knows about the episode. It lives as long as the episode (state across turns)."""

    task_id: str = ""
    statement: str = ""
    protected_paths: list[str] = field(default_factory=list)  # the task's tests, grader files, hidden data
    allowed_rule_ids: list[str] = field(default_factory=list)  # per-task exceptions
    history: list[ToolCall] = field(default_factory=list)  # earlier calls of this episode, in order
    turn: int = 0


@dataclass
class RuleHit:
    rule_id: str
    category: str
    severity: Literal["block", "escalate"]
    reason: str


@dataclass
class Verdict:
    action: Literal["allow", "block"]
    stage: Literal["rules", "judge"] = "rules"
    rule_ids: list[str] = field(default_factory=list)
    reason: str = ""
    latency: float = 0.0  # seconds spent in the guard for this call
    category: str = ""
    hits: list[RuleHit] = field(default_factory=list)

    @property
    def flagged(self) -> bool:
        return bool(self.hits)
