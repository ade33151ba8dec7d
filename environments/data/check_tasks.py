#!/usr/bin/env python3
"""Validate and verify the shipped coding tasks (coding_tasks.jsonl).

Usage (from the repository root):

    python environments/data/check_tasks.py [TASKS.jsonl] [--only ID ...] [--no-run]

For every function task line (no `kind`) this script

1. validates the schema and the dataset rules (keys, types, unique ids,
   counts per split/domain/difficulty, safe relative paths, files ending with
   a newline, number of visible/hidden tests, standard-library-only imports,
   no sleeps / network / unseeded randomness, no pytest config files);
2. in a fresh temporary directory writes the starting files plus the visible
   and hidden tests and checks that the hidden tests FAIL on the starting code
   (pytest exit code 1: tests were collected, ran, and at least one failed);
3. writes the reference solution over the starting files and checks that the
   hidden tests and the visible tests each PASS (run separately, so the
   hidden tests cannot depend on the visible ones) and that no test phase
   takes 0.1 s or more.

For every repository task line (`"kind": "repo"`, see environments/tasks.py) it

1. validates the schema: a multi-file package snapshot (at least two modules besides `__init__.py`), test
   files under tests/, FAIL_TO_PASS (non-empty) and PASS_TO_PASS ids that name tests defined in the official
   test files, standard-library-only imports, a reference `patch`;
2. runs the test files at the base commit (snapshot + visible + hidden tests): every FAIL_TO_PASS test must
   fail (so the unsolved repo cannot get full reward) and every PASS_TO_PASS test must pass;
3. applies the reference `patch` with `git apply` and runs them again: every listed test, and every test of
   the visible files, must pass (full reward), none taking 0.1 s or more.

Steps 2-3 (running the tests) live in verify_tasks.py. It prints one line per task and exits non-zero on any
problem. Only python3 (stdlib), pytest and git are needed. Tasks are checked sequentially.
"""

from __future__ import annotations

import argparse
import ast
import collections
import json
import re
import sys
import time
from pathlib import Path, PurePosixPath

if not __package__:  # run as a script: make the repository root (and its `environments` package) importable
    _ROOT = str(Path(__file__).resolve().parents[2])
    if _ROOT not in sys.path:
        sys.path.insert(0, _ROOT)
from environments.data.verify_tasks import verify_repo_task, verify_task  # stdlib-only, as this script

DEFAULT_TASKS = Path(__file__).resolve().parent / "coding_tasks.jsonl"

REQUIRED_KEYS = {
    "id", "domain", "difficulty", "split", "statement", "entry_file", "files",
    "visible_tests", "hidden_tests", "reference_solution",
}
DOMAINS = ("function", "bugfix")
SPLITS = ("train", "heldout")
DIFFICULTIES = (1, 2, 3)

REPO_REQUIRED_KEYS = {
    "id", "kind", "domain", "difficulty", "split", "repo", "problem_statement", "entry_file", "files",
    "visible_tests", "hidden_tests", "FAIL_TO_PASS", "PASS_TO_PASS", "patch",
}
REPO_SPLITS = ("repo_train", "repo_heldout")
REPO_MIN_MODULES = 2  # source modules besides __init__.py: repository tasks are multi-file
REPO_HIDDEN_TESTS_MIN = 3

# Dataset composition rules. The heldout split is the default run's eval split: it stays these 12 tasks.
EXPECTED_TOTAL = 101
EXPECTED_DOMAIN = {"function": 50, "bugfix": 28, "repo": 23}
EXPECTED_SPLIT = {"train": 66, "heldout": 12, "repo_train": 17, "repo_heldout": 6}
MIN_REPO_TASKS = 20
TARGET_DIFFICULTY = {1: 26, 2: 33, 3: 19}  # function and bugfix tasks, "roughly": allowed deviation below
DIFFICULTY_TOLERANCE = 2
EXPECTED_HELDOUT_DIFFICULTY = {1: 4, 2: 4, 3: 4}
MIN_HELDOUT_DIFFICULTY_1 = 4
VISIBLE_TESTS_RANGE = (1, 3)
HIDDEN_TESTS_RANGE = (4, 10)

ID_RE = re.compile(r"^[a-z][a-z0-9]*(?:_[a-z0-9]+)*$")
FORBIDDEN_FILENAMES = {
    "conftest.py", "pytest.ini", "tox.ini", "setup.cfg", "pyproject.toml",
    "__init__.py", "sitecustomize.py", "usercustomize.py",
}
# Modules that would make a task slow, flaky or networked.
FORBIDDEN_MODULES = {
    "socket", "urllib", "http", "ftplib", "smtplib", "poplib", "imaplib",
    "telnetlib", "ssl", "asyncio", "subprocess", "multiprocessing",
    "threading", "concurrent", "time", "requests", "secrets",
}
STDLIB = set(getattr(sys, "stdlib_module_names", ())) or None


# ---------------------------------------------------------------------------
# static validation
# ---------------------------------------------------------------------------

def _is_safe_relpath(path: str) -> bool:
    if not isinstance(path, str) or not path or "\\" in path or "\x00" in path:
        return False
    p = PurePosixPath(path)
    if p.is_absolute() or path.startswith("~"):
        return False
    parts = path.split("/")
    return all(part not in ("", ".", "..") for part in parts)


def _count_tests(tree: ast.Module) -> int:
    n = 0
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name.startswith("test"):
            n += 1
        elif isinstance(node, ast.ClassDef) and node.name.startswith("Test"):
            n += sum(
                1 for sub in node.body
                if isinstance(sub, (ast.FunctionDef, ast.AsyncFunctionDef)) and sub.name.startswith("test")
            )
    return n


def _imports(tree: ast.AST):
    """Yield (top-level module name, imported names) for every import."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name.split(".")[0], []
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative import: local package
                yield "", [a.name for a in node.names]
            else:
                yield node.module.split(".")[0], [a.name for a in node.names]


def _check_file_list(task, key, errors, min_len=1):
    value = task.get(key)
    if not isinstance(value, list) or len(value) < min_len:
        errors.append(f"{key}: must be a list with at least {min_len} entry")
        return []
    seen = set()
    out = []
    for i, entry in enumerate(value):
        where = f"{key}[{i}]"
        if not isinstance(entry, dict) or set(entry) != {"path", "content"}:
            errors.append(f"{where}: must be an object with exactly keys path, content")
            continue
        path, content = entry["path"], entry["content"]
        if not isinstance(path, str) or not isinstance(content, str):
            errors.append(f"{where}: path and content must be strings")
            continue
        if not _is_safe_relpath(path):
            errors.append(f"{where}: unsafe path {path!r} (must be relative, no '..')")
            continue
        if path in seen:
            errors.append(f"{where}: duplicate path {path!r}")
        seen.add(path)
        if PurePosixPath(path).name in FORBIDDEN_FILENAMES:
            errors.append(f"{where}: forbidden file {path!r}")
        if not content.endswith("\n"):
            errors.append(f"{where}: content of {path!r} must end with a newline")
        out.append((path, content))
    return out


def validate_task(task, errors):
    """Static checks of one task. Appends messages to errors; returns parsed info."""
    if not isinstance(task, dict):
        errors.append("line is not a JSON object")
        return None
    keys = set(task)
    if keys != REQUIRED_KEYS:
        missing = sorted(REQUIRED_KEYS - keys)
        extra = sorted(keys - REQUIRED_KEYS)
        errors.append(f"keys mismatch (missing={missing}, extra={extra})")
        return None

    tid = task["id"]
    if not isinstance(tid, str) or not ID_RE.match(tid):
        errors.append(f"id {tid!r} is not snake_case")
    if task["domain"] not in DOMAINS:
        errors.append(f"domain {task['domain']!r} not in {DOMAINS}")
    diff = task["difficulty"]
    if type(diff) is not int or diff not in DIFFICULTIES:
        errors.append(f"difficulty {diff!r} not in {DIFFICULTIES}")
    if task["split"] not in SPLITS:
        errors.append(f"split {task['split']!r} not in {SPLITS}")
    statement = task["statement"]
    if not isinstance(statement, str) or len(statement.strip()) < 40:
        errors.append("statement must be a non-trivial string")
        statement = statement if isinstance(statement, str) else ""
    entry = task["entry_file"]
    if not isinstance(entry, str) or not _is_safe_relpath(entry) or not entry.endswith(".py"):
        errors.append(f"entry_file {entry!r} must be a safe relative .py path")
        entry = None
    elif task["domain"] == "function" and entry != "solution.py":
        errors.append("function tasks must use entry_file 'solution.py'")

    files = _check_file_list(task, "files", errors)
    visible = _check_file_list(task, "visible_tests", errors)
    hidden = _check_file_list(task, "hidden_tests", errors)
    reference = _check_file_list(task, "reference_solution", errors)
    if errors:
        return None

    file_paths = {p for p, _ in files}
    ref_paths = {p for p, _ in reference}
    test_paths = [p for p, _ in visible] + [p for p, _ in hidden]
    if len(set(test_paths)) != len(test_paths):
        errors.append("visible and hidden tests share a path")
    for p in test_paths:
        name = PurePosixPath(p).name
        if not (p.startswith("tests/") and name.startswith("test_") and name.endswith(".py")):
            errors.append(f"test path {p!r} must look like tests/test_*.py")
        if p in file_paths or p in ref_paths:
            errors.append(f"test path {p!r} collides with a workspace/reference file")
    for p in file_paths | ref_paths:
        if p.startswith("tests/"):
            errors.append(f"workspace file {p!r} must not live under tests/")
    if entry is not None:
        if entry not in file_paths:
            errors.append(f"entry_file {entry!r} is not among files")
        if entry not in ref_paths:
            errors.append(f"entry_file {entry!r} is not among reference_solution")
        if entry not in statement:
            errors.append(f"statement does not name the entry file {entry!r}")
    if ref_paths - file_paths:
        errors.append(f"reference_solution writes files not in the workspace: {sorted(ref_paths - file_paths)}")

    start = dict(files)
    ref = dict(reference)
    if entry in start and entry in ref:
        if task["domain"] == "function" and "raise NotImplementedError" not in start[entry]:
            errors.append("function stub must contain 'raise NotImplementedError'")
        if task["domain"] == "bugfix" and start[entry] == ref[entry]:
            errors.append("bugfix starting entry file is identical to the reference")
    if task["domain"] == "bugfix" and len(files) > 2:
        errors.append("bugfix tasks have at most 2 starting files")

    local_modules = {
        PurePosixPath(p).with_suffix("").parts[0] for p in file_paths | ref_paths if p.endswith(".py")
    }
    for mod in local_modules:
        if STDLIB and mod in STDLIB:
            errors.append(f"local module {mod!r} shadows a standard-library module")
        if mod in ("pytest", "_pytest", "tests", "test"):
            errors.append(f"local module name {mod!r} is reserved")

    all_py = (
        [("files", p, c) for p, c in files]
        + [("visible", p, c) for p, c in visible]
        + [("hidden", p, c) for p, c in hidden]
        + [("reference", p, c) for p, c in reference]
    )
    test_counts = {"visible": 0, "hidden": 0}
    imported_names = set()
    for kind, path, content in all_py:
        if not path.endswith(".py"):
            continue
        tree = _check_imports(kind, path, content, local_modules, errors,
                              imported_names if kind in ("visible", "hidden") else None)
        if tree is None:
            continue
        if "sleep(" in content:
            errors.append(f"{kind} {path}: must not sleep")
        if kind in test_counts:
            test_counts[kind] += _count_tests(tree)
        if kind == "hidden" and "test_visible" in content:
            errors.append(f"hidden {path}: must not depend on the visible tests")
    lo, hi = VISIBLE_TESTS_RANGE
    if not lo <= test_counts["visible"] <= hi:
        errors.append(f"{test_counts['visible']} visible tests (need {lo}-{hi})")
    lo, hi = HIDDEN_TESTS_RANGE
    if not lo <= test_counts["hidden"] <= hi:
        errors.append(f"{test_counts['hidden']} hidden tests (need {lo}-{hi})")
    for name in sorted(imported_names):
        if name != "*" and name not in statement:
            errors.append(f"tests import {name!r}, which the statement does not name")
    return {"files": files, "visible": visible, "hidden": hidden, "reference": reference,
            "n_visible": test_counts["visible"], "n_hidden": test_counts["hidden"]}


def validate_dataset(tasks, problems):
    counts = {
        "split": collections.Counter(t["split"] for t in tasks),
        "domain": collections.Counter(t["domain"] for t in tasks),
        "difficulty": collections.Counter(t["difficulty"] for t in tasks if t.get("kind") != "repo"),
    }
    if counts["domain"]["repo"] < MIN_REPO_TASKS:
        problems.append(f"dataset: {counts['domain']['repo']} repository tasks, need at least {MIN_REPO_TASKS}")
    held = [t for t in tasks if t["split"] == "heldout"]
    held_diff = collections.Counter(t["difficulty"] for t in held)
    held_dom = collections.Counter(t["domain"] for t in held)
    train_dom = collections.Counter(t["domain"] for t in tasks if t["split"] == "train")

    if len(tasks) != EXPECTED_TOTAL:
        problems.append(f"dataset: {len(tasks)} tasks, expected {EXPECTED_TOTAL}")
    for dom, n in EXPECTED_DOMAIN.items():
        if counts["domain"][dom] != n:
            problems.append(f"dataset: {counts['domain'][dom]} {dom} tasks, expected {n}")
    for split, n in EXPECTED_SPLIT.items():
        if counts["split"][split] != n:
            problems.append(f"dataset: {counts['split'][split]} {split} tasks, expected {n}")
    for d, n in TARGET_DIFFICULTY.items():
        if abs(counts["difficulty"][d] - n) > DIFFICULTY_TOLERANCE:
            problems.append(f"dataset: {counts['difficulty'][d]} difficulty-{d} function/bugfix tasks, "
                            f"expected about {n}")
    for d, n in EXPECTED_HELDOUT_DIFFICULTY.items():
        if held_diff[d] != n:
            problems.append(f"dataset: {held_diff[d]} heldout difficulty-{d} tasks, expected {n}")
    if held_diff[1] < MIN_HELDOUT_DIFFICULTY_1:
        problems.append(f"dataset: only {held_diff[1]} heldout difficulty-1 tasks")
    for dom in DOMAINS:
        if held_dom[dom] == 0:
            problems.append(f"dataset: heldout split has no {dom} tasks")
        if train_dom[dom] == 0:
            problems.append(f"dataset: train split has no {dom} tasks")
    return counts, held_diff, held_dom


# ---------------------------------------------------------------------------
# repository tasks
# ---------------------------------------------------------------------------

def _test_ids_in(path, content):
    """'path::name' / 'path::Class::name' of the tests a test file defines."""
    ids = []
    for node in ast.parse(content).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name.startswith("test"):
            ids.append(f"{path}::{node.name}")
        elif isinstance(node, ast.ClassDef) and node.name.startswith("Test"):
            ids.extend(f"{path}::{node.name}::{sub.name}" for sub in node.body
                       if isinstance(sub, (ast.FunctionDef, ast.AsyncFunctionDef)) and sub.name.startswith("test"))
    return ids


def _check_imports(kind, path, content, local_modules, errors, imported_names=None):
    """Parse one Python file and check its imports: only the standard library, the task's own modules and (in
    tests) pytest; random only with a fixed seed. The names tests import from the task's modules go into
    `imported_names` when given. Returns the tree, or None on a syntax error."""
    try:
        tree = ast.parse(content, filename=path)
    except SyntaxError as exc:
        errors.append(f"{kind} {path}: syntax error: {exc}")
        return None
    for mod, names in _imports(tree):
        if mod in local_modules or mod == "":
            if imported_names is not None:
                imported_names.update(names)
            continue
        if mod == "pytest":
            if kind not in ("visible", "hidden"):
                errors.append(f"{kind} {path}: only tests may import pytest")
            continue
        if mod in FORBIDDEN_MODULES:
            errors.append(f"{kind} {path}: forbidden import {mod!r}")
        elif STDLIB is not None and mod not in STDLIB:
            errors.append(f"{kind} {path}: non-stdlib import {mod!r}")
        if mod == "random" and "seed" not in content:
            errors.append(f"{kind} {path}: uses random without a fixed seed")
    return tree


def validate_repo_task(task, errors):
    """Static checks of one repository task; returns parsed info (or None)."""
    keys = set(task)
    if keys != REPO_REQUIRED_KEYS:
        errors.append(f"keys mismatch (missing={sorted(REPO_REQUIRED_KEYS - keys)}, "
                      f"extra={sorted(keys - REPO_REQUIRED_KEYS)})")
        return None
    tid = task["id"]
    if not isinstance(tid, str) or not ID_RE.match(tid):
        errors.append(f"id {tid!r} is not snake_case")
    if task["domain"] != "repo":
        errors.append(f"repository tasks have domain 'repo', not {task['domain']!r}")
    if type(task["difficulty"]) is not int or task["difficulty"] not in DIFFICULTIES:
        errors.append(f"difficulty {task['difficulty']!r} not in {DIFFICULTIES}")
    if task["split"] not in REPO_SPLITS:
        errors.append(f"split {task['split']!r} not in {REPO_SPLITS} (the heldout split is not for repo tasks)")
    statement = task["problem_statement"]
    if not isinstance(statement, str) or len(statement.strip()) < 80:
        errors.append("problem_statement must be a non-trivial string")
    files = _check_file_list(task, "files", errors, min_len=2)
    visible = _check_file_list(task, "visible_tests", errors)
    hidden = _check_file_list(task, "hidden_tests", errors)
    if not isinstance(task["patch"], str) or "+++ b/" not in task["patch"]:
        errors.append("patch must be a unified diff (--- a/... +++ b/...)")
    f2p, p2p = task["FAIL_TO_PASS"], task["PASS_TO_PASS"]
    for key, ids in (("FAIL_TO_PASS", f2p), ("PASS_TO_PASS", p2p)):
        if not isinstance(ids, list) or not all(isinstance(i, str) for i in ids):
            errors.append(f"{key} must be a list of test ids")
    if not f2p:
        errors.append("FAIL_TO_PASS is empty")
    # FORBIDDEN_FILENAMES bans __init__.py for function tasks; a package snapshot needs it.
    errors[:] = [e for e in errors if not re.search(r"^files\[\d+\]: forbidden file '[^']*__init__\.py'$", e)]
    if errors:
        return None
    src_paths = [p for p, _ in files]
    repo = task["repo"]
    modules = [p for p in src_paths if p.endswith(".py") and PurePosixPath(p).name != "__init__.py"]
    if len(modules) < REPO_MIN_MODULES:
        errors.append(f"only {len(modules)} module(s) besides __init__.py: repository tasks are multi-file")
    if f"{repo}/__init__.py" not in src_paths or any(not p.startswith(repo + "/") for p in src_paths):
        errors.append(f"every snapshot file must live in the package {repo!r} (with {repo}/__init__.py)")
    if STDLIB and repo in STDLIB or repo in ("pytest", "_pytest", "tests", "test"):
        errors.append(f"package name {repo!r} shadows a standard-library or reserved module")
    if task["entry_file"] not in src_paths:
        errors.append(f"entry_file {task['entry_file']!r} is not a snapshot file")
    test_files = dict(visible)
    test_files.update(hidden)  # a hidden file may replace a visible one at grading
    for p in test_files:
        name = PurePosixPath(p).name
        if not (p.startswith("tests/") and name.startswith("test_") and name.endswith(".py")):
            errors.append(f"test path {p!r} must look like tests/test_*.py")
    defined, n_tests = set(), {"visible": 0, "hidden": 0}
    for kind, entries in (("files", files), ("visible", visible), ("hidden", hidden)):
        for path, content in entries:
            tree = _check_imports(kind, path, content, {repo}, errors)
            if tree is None:
                continue
            if re.search(r"\b(time|asyncio)\.sleep\(", content):  # an injected `sleep` callable is fine
                errors.append(f"{kind} {path}: must not sleep")
            if kind != "files":
                n_tests[kind] += _count_tests(tree)
    for path, content in test_files.items():
        defined.update(_test_ids_in(path, content))
    if n_tests["visible"] < 1:
        errors.append("no visible tests")
    if n_tests["hidden"] < REPO_HIDDEN_TESTS_MIN:
        errors.append(f"{n_tests['hidden']} hidden tests (need at least {REPO_HIDDEN_TESTS_MIN})")
    if len(set(f2p) | set(p2p)) != len(f2p) + len(p2p):
        errors.append("a test id is listed twice")
    for test_id in f2p + p2p:
        if test_id.split("[", 1)[0] not in defined:
            errors.append(f"test id {test_id!r} is not defined in the official test files")
    return {"files": files, "visible": visible, "hidden": hidden, "f2p": f2p, "p2p": p2p}


# ---------------------------------------------------------------------------

def report_task(tid: str, label: str, errors: list[str], status: str, seconds: float, problems: list[str]) -> bool:
    """Print a task's line (`label`: its id and tags) and its errors, add them to `problems`; True if it passed."""
    if errors:
        print(f"FAIL {label}")
        for e in errors:
            print(f"      - {e}")
        problems.extend(f"{tid}: {e.splitlines()[0]}" for e in errors)
        return False
    print(f"ok   {label} {status} ({seconds:.1f}s)", flush=True)
    return True


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("tasks", nargs="?", default=str(DEFAULT_TASKS), help="path to coding_tasks.jsonl")
    ap.add_argument("--only", nargs="*", default=None, help="verify only these task ids")
    ap.add_argument("--no-run", action="store_true", help="static validation only")
    args = ap.parse_args(argv)

    path = Path(args.tasks)
    problems = []
    tasks, infos, per_task_errors = [], {}, {}
    seen_ids = set()
    with path.open(encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                problems.append(f"line {lineno}: empty line")
                continue
            try:
                task = json.loads(line)
            except json.JSONDecodeError as exc:
                problems.append(f"line {lineno}: invalid JSON: {exc}")
                continue
            errors = []
            is_repo = isinstance(task, dict) and task.get("kind") == "repo"
            info = validate_repo_task(task, errors) if is_repo else validate_task(task, errors)
            required = REPO_REQUIRED_KEYS if is_repo else REQUIRED_KEYS
            if not isinstance(task, dict) or set(task) != required or not isinstance(task["id"], str):
                problems.extend(f"line {lineno}: {e}" for e in errors or ["malformed task"])
                continue
            tid = task["id"]
            if tid in seen_ids:
                errors.append(f"duplicate id {tid!r}")
            seen_ids.add(tid)
            tasks.append(task)
            infos[tid] = info
            per_task_errors[tid] = errors

    counts, held_diff, held_dom = validate_dataset(tasks, problems)

    selected = [t for t in tasks if args.only is None or t["id"] in args.only]
    if args.only:
        unknown = set(args.only) - {t["id"] for t in tasks}
        if unknown:
            problems.append(f"--only: unknown ids {sorted(unknown)}")

    n_ok = 0
    t0 = time.monotonic()
    width = max((len(t["id"]) for t in selected), default=10)
    for task in selected:
        tid = task["id"]
        errors = per_task_errors[tid]
        status = "static checks only"
        start = time.monotonic()
        if not errors and not args.no_run:
            verify = verify_repo_task if task.get("kind") == "repo" else verify_task
            status = verify(task, infos[tid], errors)
        tag = f"[{task['split']:<7} {task['domain']:<8} d{task['difficulty']}]"
        n_ok += report_task(tid, f"{tid:<{width}} {tag}", errors, status, time.monotonic() - start, problems)

    print()
    print(f"tasks: {len(tasks)}  split: {dict(sorted(counts['split'].items()))}  "
          f"domain: {dict(sorted(counts['domain'].items()))}  "
          f"difficulty: {dict(sorted(counts['difficulty'].items()))}")
    print(f"heldout difficulty: {dict(sorted(held_diff.items()))}  "
          f"heldout domain: {dict(sorted(held_dom.items()))}")
    print(f"heldout ids: {', '.join(t['id'] for t in tasks if t['split'] == 'heldout')}")
    verb = "validated" if args.no_run else "verified"
    print(f"{n_ok}/{len(selected)} tasks {verb} in {time.monotonic() - t0:.1f}s")
    if problems:
        print(f"\n{len(problems)} problem(s):")
        for p in problems:
            print(f"  - {p}")
        return 1
    print("ALL CHECKS PASSED")
    return 0


if __name__ == "__main__":
    sys.exit(main())
