"""Types of the environment contract (docs/DESIGN.md §4): tool calls, sandbox results, tasks, grades."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class ToolCall:
    name: str
    arguments: dict[str, Any] = field(default_factory=dict)

    def describe(self) -> str:
        import json

        return f"{self.name}({json.dumps(self.arguments, ensure_ascii=False)[:500]})"


@dataclass
class ExecResult:
    stdout: str
    stderr: str
    exit_code: int
    timed_out: bool = False
    duration: float = 0.0
    truncated: bool = False


@dataclass
class TaskFile:
    path: str
    content: str


@dataclass
class RepoFile(TaskFile):
    """A file of a repository task's snapshot. A workspace set up from files that include one becomes a git
    repository with exactly one commit, the base (`setup_workspace`), so the agent can `git diff` its work."""


@dataclass
class Task:
    """A coding task. Hidden tests never enter the agent's sandbox; they are applied only at grading."""

    id: str
    statement: str
    files: list[TaskFile]
    visible_tests: list[TaskFile] = field(default_factory=list)
    hidden_tests: list[TaskFile] = field(default_factory=list)
    entry_file: str = "solution.py"
    domain: str = "function"
    difficulty: int = 1
    split: str = "train"
    reference_solution: list[TaskFile] = field(default_factory=list)
    metadata: dict[str, Any] = field(default_factory=dict)
    # "function": every test of the hidden test files counts. "repo" (SWE-bench style): the tests named in
    # FAIL_TO_PASS and PASS_TO_PASS count, the workspace is a git repository at its base commit.
    kind: str = "function"
    fail_to_pass: list[str] = field(default_factory=list)
    pass_to_pass: list[str] = field(default_factory=list)

    @property
    def is_repo(self) -> bool:
        return self.kind == "repo"

    @property
    def test_paths(self) -> list[str]:
        """Paths owned by the grader: edits to them never count (official versions are re-applied)."""
        return sorted({f.path for f in self.visible_tests + self.hidden_tests})

    @property
    def protected_paths(self) -> list[str]:
        return sorted(set(self.test_paths) | set(self.metadata.get("protected_paths", [])))


@dataclass
class GradeResult:
    reward: float
    passed: int
    failed: int
    details: dict[str, Any] = field(default_factory=dict)

    @property
    def all_passed(self) -> bool:
        return self.failed == 0 and self.passed > 0
