"""Types of the guard contract (docs/DESIGN.md §4): what a rule sees, what the guard decides."""

from __future__ import annotations

import fnmatch
import functools
import posixpath
import re
from dataclasses import dataclass, field
from typing import Any, Literal

from environments.types import ToolCall

TEST_PATTERNS = ("tests/*", "test/*", "*/tests/*", "*/test/*", "test_*.py", "*/test_*.py", "*_test.py",
                 "*/*_test.py", "conftest.py", "*/conftest.py")


_GLOB = set("*?[")


@functools.lru_cache(maxsize=4096)
def _compiled(patterns: tuple[str, ...]) -> re.Pattern:
    """One regex for a set of globs: a path matches a glob, its folder form, or lies under a `dir/*` glob."""
    parts = []
    for pat in patterns:
        parts.append(fnmatch.translate(pat))
        stem = pat.rstrip("/*")
        if stem:
            parts.append(re.escape(stem) + r"\Z")
        if pat.endswith("/*"):
            parts.append(re.escape(pat[:-1]) + r".*\Z")
    return re.compile("|".join(f"(?:{p})" for p in parts) or r"(?!x)x", re.DOTALL)


@functools.lru_cache(maxsize=1024)
def _matcher(patterns: tuple[str, ...]) -> tuple[frozenset[str], tuple[str, ...], tuple[re.Pattern, ...]]:
    """What `_compiled(patterns)` matches, split for speed: the exact paths that patterns without glob
    characters name (a path or its folder form), the folders they may be (`tests/`, `.grader`: everything under
    one is protected too), and one regex per glob, cached per glob (each task has its own set of protected
    paths, but the globs in them recur: a new task compiles nothing, or little)."""
    exact: set[str] = set()
    folders: set[str] = set()
    globs = []
    for pat in patterns:
        pat = pat[2:] if pat.startswith("./") else pat
        if _GLOB & set(pat):
            globs.append(_compiled((pat,)))
        else:
            exact.add(pat)
            stem = pat.rstrip("/")
            if stem:
                exact.add(stem)
                folders.add(stem + "/")
    return frozenset(exact), tuple(sorted(folders)), tuple(globs)


def path_matches(path: str, patterns, glob_path: bool = False) -> bool:
    """Whether `path` falls under one of `patterns` (globs). With `glob_path`, a `path` that is itself a glob
    (a shell loop or `find -name` target) also matches when it covers a pattern: for writes, where a glob
    reaches every file it names."""
    if not patterns:
        return False
    p = path[2:] if path.startswith("./") else path
    exact, folders, globs = _matcher(patterns if type(patterns) is tuple else tuple(patterns))
    if p in exact or p.startswith(folders) or any(g.match(p) for g in globs):
        return True
    if glob_path and _GLOB & set(p):
        covers = _compiled((p, "*/" + p.lstrip("*/")))
        if any(covers.match(pat) for pat in patterns):
            return True
        folder = posixpath.dirname(p)  # `tests/data/*/*.json` reaches into a protected folder `tests/data/expected/`
        if folder:
            inside = _compiled((folder,))
            return any(inside.match(pat.rstrip("/")) for pat in patterns if pat.endswith("/"))
    return False


# "src/pkg/mod.py" or "pkg/sub/mod.py" → pkg; "package `pkg`", "the `pkg` package" → pkg; a starting pkg/__init__.py
_PACKAGE_PATH = re.compile(r"\b(?:src/)?(?!src/)([A-Za-z_]\w*)/(?:\w+/)*\w+\.py\b")
_PACKAGE_WORD = re.compile(r"\bpackage\s+[`'\"]?([A-Za-z_][\w.-]*\w)|[`'\"]([A-Za-z_][\w.-]*)[`'\"]\s+package\b")
_PACKAGE_INIT = re.compile(r"(?:src/)?([A-Za-z_]\w*)/__init__\.py$")
_NOT_PACKAGES = {"tests", "test", "docs", "doc", "scripts", "script", "tools", "examples", "bin", "eval", "grader",
                 "hidden", "benchmarks", "bench", "data", "ci", "build", "dist"}
_NOT_PACKAGE_WORDS = {"under", "is", "that", "the", "to", "for", "and", "with", "a", "an", "so", "should", "must",
                      "manager", "name", "names", "which", "in", "of", "it", "this", "already", "itself", "root",
                      "level", "version", "metadata", "code", "layout", "you", "we", "has", "have", "will", "can",
                      "data", "index", "its", "their", "are", "was", "from", "as", "on", "at", "by", "or", "but"}


@dataclass
class GuardContext:
    """What the guard knows about the episode. It lives as long as the episode (state across turns)."""

    task_id: str = ""
    statement: str = ""
    protected_paths: list[str] = field(default_factory=list)  # must not change: tests, grader files
    hidden_paths: list[str] = field(default_factory=list)  # must not even be read: hidden tests, grader data
    task_files: list[str] = field(default_factory=list)  # the task's own statement files
    package_name: str = ""  # the package under test (installing it from elsewhere is a hack)
    visible_test_sources: dict[str, str] = field(default_factory=dict)
    original_sources: dict[str, str] = field(default_factory=dict)  # the task's starting files
    allowed_rule_ids: list[str] = field(default_factory=list)  # per-task exceptions
    history: list[ToolCall] = field(default_factory=list)  # earlier calls of this episode, in order
    written: dict[str, str] = field(default_factory=dict)  # files the agent wrote this episode (path → text)
    aliases: dict[str, str] = field(default_factory=dict)  # symlinks the agent made (link → target)
    turn: int = 0

    def packages_under_test(self) -> frozenset[str]:
        """Import names of the package under test, lower-case with `-` as `_`: the one the task names, else what
        its statement and starting files show (`src/pkg/mod.py`, `pkg/mod.py`, "package `pkg`")."""
        key = (self.package_name, self.statement, len(self.original_sources))
        if getattr(self, "_packages_key", None) != key:
            names = {self.package_name} if self.package_name else set()
            names.update(m for m in _PACKAGE_PATH.findall(self.statement) if m.lower() not in _NOT_PACKAGES)
            names.update(n for pair in _PACKAGE_WORD.findall(self.statement) for n in pair
                         if n and n.lower() not in _NOT_PACKAGE_WORDS)
            names.update(m.group(1) for p in self.original_sources if (m := _PACKAGE_INIT.match(p)))
            self._packages = frozenset(n.lower().replace("-", "_") for n in names if n)
            self._packages_key = key
        return self._packages

    def is_test_path(self, path: str) -> bool:
        p = posixpath.normpath(path) if path else path
        return path_matches(p, TEST_PATTERNS) or path_matches(p, self.protected_paths)

    @classmethod
    def for_task(cls, task: Any) -> "GuardContext":
        """The context of an episode on an `environments.Task`."""
        meta = task.metadata or {}
        hidden = [f.path for f in task.hidden_tests] + list(meta.get("hidden_paths", []))
        return cls(task.id, task.statement, protected_paths=task.protected_paths, hidden_paths=sorted(set(hidden)),
                   task_files=list(meta.get("task_files", [])), package_name=str(meta.get("package_name", "")),
                   visible_test_sources={f.path: f.content for f in task.visible_tests},
                   original_sources={f.path: f.content for f in task.files},
                   allowed_rule_ids=list(meta.get("allowed_guard_rules", [])))


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
    latency: float = 0.0  # seconds spent in the guard for this call (both stages)
    category: str = ""
    hits: list[RuleHit] = field(default_factory=list)
    judge: dict[str, Any] | None = None  # the judge's parsed answer, when it was asked
    rules_latency: float = 0.0
    judge_latency: float = 0.0

    @property
    def flagged(self) -> bool:
        return bool(self.hits)
