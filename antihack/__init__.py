"""Online anti-hack guard: rule filter (recall), LLM judge (precision), dummy observations, audit."""

from antihack.guard import DummyObservation, Guard, GuardStats, Judge
from antihack.rules import RULES, Rule, select_rules
from antihack.types import GuardContext, RuleHit, Verdict

__all__ = ["DummyObservation", "Guard", "GuardStats", "Judge", "RULES", "Rule", "select_rules", "GuardContext",
           "RuleHit", "Verdict"]
