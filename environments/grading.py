"""Grading in a fresh sandbox (ALGORITHMS.md S12).

The agent's files are copied into a new sandbox, the official test files are written over whatever the agent
did to them, the hidden tests are run, and the report is parsed here, outside the sandbox. The tests that
count are read from the hidden test files' source (not from the report): a test that is missing from the
report, skipped, or never collected counts as failed.
"""

from __future__ import annotations

import ast
import os
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

from environments.sandbox import make_sandbox, task_sandbox_options
from environments.types import GradeResult, Task, TaskFile

_SKIP_DIRS = {"__pycache__", ".pytest_cache", ".git"}
MAX_FILES = 500
MAX_FILE_BYTES = 1_000_000


def setup_workspace(workspace: Path, files: list[TaskFile], owner_uid: int | None = None) -> None:
    """Write task files into a new, empty workspace (host side, before any agent code has run)."""
    for f in files:
        target = workspace / f.path
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(f.content)
    if owner_uid is not None:
        for dirpath, dirnames, filenames in os.walk(workspace):
            for name in dirnames + filenames:
                os.chown(os.path.join(dirpath, name), owner_uid, owner_uid, follow_symlinks=False)


def collect_files(workspace: Path) -> dict[str, str]:
    """The agent's workspace as {relative path: text}. Symlinks are not followed; caches are skipped."""
    out: dict[str, str] = {}
    for dirpath, dirnames, filenames in os.walk(workspace):
        dirnames[:] = [d for d in dirnames if d not in _SKIP_DIRS and not os.path.islink(os.path.join(dirpath, d))]
        for name in sorted(filenames):
            full = os.path.join(dirpath, name)
            if os.path.islink(full) or not os.path.isfile(full) or os.path.getsize(full) > MAX_FILE_BYTES:
                continue
            out[os.path.relpath(full, workspace)] = Path(full).read_bytes().decode("utf-8", "replace")
            if len(out) >= MAX_FILES:
                return out
    return out


def expected_tests(test_files: list[TaskFile]) -> list[str]:
    """Test ids ('path::name' or 'path::Class::name') defined in the official test sources."""
    ids = []
    for f in test_files:
        tree = ast.parse(f.content)
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name.startswith("test"):
                ids.append(f"{f.path}::{node.name}")
            elif isinstance(node, ast.ClassDef) and node.name.startswith("Test"):
                for item in node.body:
                    if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) and item.name.startswith("test"):
                        ids.append(f"{f.path}::{node.name}::{item.name}")
    return ids


def parse_junit(xml_text: str) -> dict[str, str]:
    """{test id: 'passed' | 'failed' | 'skipped'} with parametrised cases folded into their base test
    (a base passes only if all its cases pass)."""
    outcomes: dict[str, str] = {}
    root = ET.fromstring(xml_text)
    for case in root.iter("testcase"):
        classname, name = case.get("classname", ""), case.get("name", "").split("[", 1)[0]
        parts = classname.split(".")
        # classname is "tests.test_x" or "tests.test_x.TestClass": rebuild the file path and the class part.
        cls = parts[-1] if parts and parts[-1][:1].isupper() else None
        module = parts[:-1] if cls else parts
        test_id = "/".join(module) + ".py::" + (f"{cls}::" if cls else "") + name
        if case.find("failure") is not None or case.find("error") is not None:
            outcome = "failed"
        elif case.find("skipped") is not None:
            outcome = "skipped"
        else:
            outcome = "passed"
        if outcomes.get(test_id, "passed") == "passed":
            outcomes[test_id] = outcome
    return outcomes


def grade(task: Task, workspace: Path | dict[str, str], backend: str = "bwrap", reward: str = "pass_fraction",
          timeout: float = 60.0, **limits) -> GradeResult:
    """Grade the agent's work. `workspace`: the agent's workspace folder, or its files as {path: text}. With the
    docker backend the sandbox runs the task's own image when its metadata names one (`docker_image`)."""
    files = collect_files(workspace) if isinstance(workspace, Path) else dict(workspace)
    official = {f.path for f in task.visible_tests + task.hidden_tests}
    expected = expected_tests(task.hidden_tests)
    if not expected:
        raise ValueError(f"task {task.id}: hidden tests define no test functions")
    agent_files = [TaskFile(p, c) for p, c in files.items() if os.path.normpath(p) not in official]
    options = {**limits, **task_sandbox_options(task, backend)}
    with make_sandbox(backend, **options) as box, tempfile.TemporaryDirectory(prefix="grade-") as report_dir:
        setup_workspace(box.workspace, agent_files + task.visible_tests + task.hidden_tests,
                        owner_uid=getattr(box, "uid", None))
        box.bind(Path(report_dir), "/grader", writable=True)
        result = box.exec(["python", "-m", "pytest", "-q", "-p", "no:cacheprovider", "--no-header",
                           "--junitxml=/grader/report.xml", "-o", "junit_family=xunit1",
                           *[f.path for f in task.hidden_tests]], timeout=timeout)
        if "No module named pytest" in result.stdout + result.stderr:
            raise RuntimeError("grading needs pytest in the sandbox's Python (pip install pytest): "
                               + (result.stdout + result.stderr).strip()[-300:])
        report = Path(report_dir) / "report.xml"
        try:
            outcomes = parse_junit(report.read_text()) if report.exists() else {}
        except ET.ParseError:
            outcomes = {}
    passed = sum(1 for t in expected if outcomes.get(t) == "passed")
    failed = len(expected) - passed
    if reward == "binary":
        value = 1.0 if failed == 0 else 0.0
    elif reward == "pass_fraction":
        value = passed / len(expected)
    else:
        raise ValueError(f"unknown reward {reward!r}; use 'pass_fraction' or 'binary'")
    return GradeResult(value, passed, failed, {
        "outcomes": {t: outcomes.get(t, "missing") for t in expected},
        "exit_code": result.exit_code, "timed_out": result.timed_out, "duration": result.duration,
        "log_tail": (result.stdout + result.stderr)[-2000:],
    })
