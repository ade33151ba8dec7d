"""Online anti-hack guard: rule filter (recall), LLM judge (precision), dummy observations, audit, evaluation."""

from antihack.config import GuardConfig, JudgeConfig
from antihack.facts import CallFacts, call_facts
from antihack.guard import DummyObservation, Guard, GuardStats, Judge
from antihack.judge import JudgeBackend, LLMJudge, OpenAIJudgeBackend, parse_verdict
from antihack.rules import RULES, Rule, select_rules
from antihack.types import GuardContext, RuleHit, Verdict

__all__ = ["CallFacts", "call_facts", "DummyObservation", "Guard", "GuardStats", "Judge", "GuardConfig",
           "JudgeConfig", "JudgeBackend", "LLMJudge", "OpenAIJudgeBackend", "parse_verdict", "RULES", "Rule",
           "select_rules", "GuardContext", "RuleHit", "Verdict"]
