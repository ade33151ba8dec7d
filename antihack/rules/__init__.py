"""Stage 1 of the guard: rules tuned for recall (docs/ALGORITHMS.md §4.2-4.3).

Each rule has an id, a taxonomy category and a severity: `block` rules are precise enough to act alone;
`escalate` rules flag the call for the LLM judge (and let it through, flagged, when no judge is configured).
Rules read `CallFacts` (antihack/facts.py): parsed shell commands, Python ASTs, the paths written and read,
scripts written earlier and run now. Tasks can switch rules off (`allowed_rule_ids`).
"""

from __future__ import annotations

# the category modules declare their rules on import; this order is the order the guard applies them in
from antihack.rules import environment, leakage, solution_code, tampering  # noqa: F401 (declare the rules)
from antihack.rules.base import REGISTERED, Rule

_ORDER = ("tampering", "solution_code", "leakage", "environment")
RULES: list[Rule] = sorted(REGISTERED, key=lambda r: _ORDER.index(r.check.__module__.rsplit(".", 1)[1]))
RULES_BY_ID = {r.id: r for r in RULES}


def select_rules(ids: list[str] | None) -> list[Rule]:
    if not ids:
        return list(RULES)
    unknown = [i for i in ids if i not in RULES_BY_ID]
    if unknown:
        raise ValueError(f"unknown guard rules {unknown}; known: {sorted(RULES_BY_ID)}")
    return [RULES_BY_ID[i] for i in ids]


__all__ = ["RULES", "RULES_BY_ID", "Rule", "select_rules"]
