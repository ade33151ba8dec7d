"""Grading in a fresh sandbox (docs/ALGORITHMS.md S12).

The agent's files are copied into a new sandbox, the official test files are written over whatever the agent
did to them, the hidden tests are run, and the report is parsed here, outside the sandbox. The tests that
count are read from the hidden test files' source (not from the report): a test that is missing from the
report, skipped, or never collected counts as failed.

Repository tasks (`task.is_repo`, SWE-bench style): the agent's diff against the base snapshot (its workspace,
its files, or a unified diff applied with `git apply`) goes onto a fresh copy of the base; the official test
files (visible and hidden) and the snapshot's pytest configuration are written over it; the test files named by
FAIL_TO_PASS and PASS_TO_PASS run, and exactly those tests count: a PASS_TO_PASS test that breaks fails, as
does a listed test that is missing from the report.
"""

from __future__ import annotations

import ast
import os
import subprocess
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

from environments.sandbox import make_sandbox, task_sandbox_options
from environments.types import GradeResult, RepoFile, Task, TaskFile

_SKIP_DIRS = {"__pycache__", ".pytest_cache", ".git"}
MAX_FILES = 500
MAX_FILE_BYTES = 1_000_000


_PYTEST_CONFIG = {"conftest.py", "pytest.ini", "tox.ini", "setup.cfg", "pyproject.toml"}
BASE_COMMIT_MESSAGE = "base commit"
_GIT_IDENTITY = {"GIT_AUTHOR_NAME": "agentic-rl", "GIT_AUTHOR_EMAIL": "tasks@agentic-rl.invalid",
                 "GIT_COMMITTER_NAME": "agentic-rl", "GIT_COMMITTER_EMAIL": "tasks@agentic-rl.invalid",
                 "GIT_AUTHOR_DATE": "2024-01-01T00:00:00+0000", "GIT_COMMITTER_DATE": "2024-01-01T00:00:00+0000"}


def _git(args: list[str], cwd: Path, stdin: str | None = None) -> subprocess.CompletedProcess:
    """git on the host with no user or system configuration (no hooks, no signing, no pager)."""
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(cwd), "LANG": "C", "GIT_CONFIG_NOSYSTEM": "1",
           "GIT_CONFIG_GLOBAL": os.devnull, "GIT_CEILING_DIRECTORIES": str(Path(cwd).parent), **_GIT_IDENTITY}
    try:
        return subprocess.run(["git", "-c", "core.hooksPath=" + os.devnull, "-c", "commit.gpgsign=false",
                               "-c", "safe.directory=*", *args],
                              cwd=cwd, env=env, input=stdin, capture_output=True, text=True, timeout=60, check=False)
    except FileNotFoundError:
        raise ValueError("repository tasks need git (apt install git)") from None
    except subprocess.TimeoutExpired:
        raise ValueError(f"git {args[0]} timed out") from None


def git_init_base(workspace: Path) -> str:
    """Make `workspace` a git repository whose only commit holds its current files (the base); returns the
    commit id (deterministic: fixed identity and dates). No remote, no other ref, no reflog beyond it."""
    for args in (["init", "-q", "-b", "main"], ["add", "-A"],
                 ["commit", "-q", "--no-verify", "-m", BASE_COMMIT_MESSAGE]):
        proc = _git(args, workspace)
        if proc.returncode:
            raise RuntimeError(f"git {args[0]} in the workspace failed: {proc.stderr.strip()[-300:]}")
    return _git(["rev-parse", "HEAD"], workspace).stdout.strip()


def apply_patch(files: dict[str, str], patch: str) -> dict[str, str]:
    """The files after `git apply` of a unified diff (git's format or `diff -u` with a/ b/ prefixes) onto
    `files`, in a scratch folder on the host. git refuses paths that leave the folder or go through a symlink;
    symlinks a patch creates are not followed back (as `collect_files`). ValueError if it does not apply."""
    with tempfile.TemporaryDirectory(prefix="patch-") as tmp:
        root = Path(tmp)
        for path, content in files.items():
            target = root / path
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(content)
        if not patch.endswith("\n"):
            patch += "\n"
        proc = _git(["apply", "--whitespace=nowarn", "-"], root, stdin=patch)
        if proc.returncode:
            raise ValueError(f"the patch does not apply: {proc.stderr.strip()[-400:]}")
        return collect_files(root)


def setup_workspace(workspace: Path, files: list[TaskFile], owner_uid: int | None = None,
                    git_base: bool | None = None) -> None:
    """Write task files into a new, empty workspace (host side, before any agent code has run). With
    `git_base` (by default: when the files are a repository task's, `RepoFile`), the workspace then becomes a
    git repository with exactly one commit holding them."""
    for f in files:
        target = workspace / f.path
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(f.content)
    if git_base is None:
        git_base = any(isinstance(f, RepoFile) for f in files)
    if git_base:
        git_init_base(workspace)
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


def _base_id(test_id: str) -> str:
    path, sep, rest = test_id.partition("::")
    return path + sep + rest.split("[", 1)[0]


def _run_tests(task: Task, files: list[TaskFile], test_paths: list[str], backend: str, timeout: float,
               limits: dict):
    """Run pytest on `test_paths` over `files` in a fresh sandbox; ({test id: outcome}, ExecResult)."""
    options = {**limits, **task_sandbox_options(task, backend)}
    with make_sandbox(backend, **options) as box, tempfile.TemporaryDirectory(prefix="grade-") as report_dir:
        setup_workspace(box.workspace, files, owner_uid=getattr(box, "uid", None), git_base=False)
        box.bind(Path(report_dir), "/grader", writable=True)
        result = box.exec(["python", "-m", "pytest", "-q", "-p", "no:cacheprovider", "--no-header",
                           "--junitxml=/grader/report.xml", "-o", "junit_family=xunit1", *test_paths],
                          timeout=timeout)
        if "No module named pytest" in result.stdout + result.stderr:
            raise RuntimeError("grading needs pytest in the sandbox's Python (pip install pytest): "
                               + (result.stdout + result.stderr).strip()[-300:])
        report = Path(report_dir) / "report.xml"
        try:
            outcomes = parse_junit(report.read_text()) if report.exists() else {}
        except ET.ParseError:
            outcomes = {}
    return outcomes, result


def _reward(passed: int, total: int, reward: str, regressions: tuple[int, int] = (0, 0)) -> float:
    """`passed` of `total` graded tests (for `fail_to_pass`: of the tests that fail on the unsolved start);
    `regressions`: (passed, total) of the tests that pass on the start (a repository task's pass_to_pass).

    pass_fraction: passed / total over every graded test. On a repository task that pays for the
    pass_to_pass tests the unchanged repository already passes: submitting nothing earns their share
    (a policy learned exactly that, docs/RESULTS.md).
    fail_to_pass: (fail_to_pass passed / their total) × (pass_to_pass passed / their total): 0 for the unsolved
    start, scaled down by what the change breaks. binary: 1 only when every test passes."""
    if reward == "binary":
        return 1.0 if passed == total else 0.0
    if reward == "pass_fraction":
        return passed / total
    if reward == "fail_to_pass":
        kept, kept_of = regressions
        return passed / total * (kept / kept_of if kept_of else 1.0)
    raise ValueError(f"unknown reward {reward!r}; use one of 'pass_fraction', 'fail_to_pass', 'binary'")


def grade(task: Task, workspace: Path | dict[str, str] | str, backend: str = "bwrap", reward: str = "pass_fraction",
          timeout: float = 60.0, **limits) -> GradeResult:
    """Grade the agent's work. `workspace`: the agent's workspace folder, or its files as {path: text}, or (repo
    tasks) a unified diff against the base snapshot. With the docker backend the sandbox runs the task's own
    image when its metadata names one (`docker_image`)."""
    if task.is_repo:
        return _grade_repo(task, workspace, backend, reward, timeout, limits)
    if isinstance(workspace, str):
        raise TypeError("a diff is graded for repository tasks only; give a function task its files")
    files = collect_files(workspace) if isinstance(workspace, Path) else dict(workspace)
    official = {f.path for f in task.visible_tests + task.hidden_tests}
    expected = expected_tests(task.hidden_tests)
    if not expected:
        raise ValueError(f"task {task.id}: hidden tests define no test functions")
    _reward(0, 1, reward)  # an unknown reward fails before the sandbox starts
    agent_files = [TaskFile(p, c) for p, c in files.items() if os.path.normpath(p) not in official]
    outcomes, result = _run_tests(task, agent_files + task.visible_tests + task.hidden_tests,
                                  [f.path for f in task.hidden_tests], backend, timeout, limits)
    passed = sum(1 for t in expected if outcomes.get(t) == "passed")
    failed = len(expected) - passed
    return GradeResult(_reward(passed, len(expected), reward), passed, failed, {
        "outcomes": {t: outcomes.get(t, "missing") for t in expected},
        "exit_code": result.exit_code, "timed_out": result.timed_out, "duration": result.duration,
        "log_tail": (result.stdout + result.stderr)[-2000:],
    })


def repo_base_files(task: Task) -> dict[str, str]:
    """A repository task's base commit: the snapshot and its visible tests."""
    return {f.path: f.content for f in task.files + task.visible_tests}


def _grade_repo(task: Task, workspace, backend: str, reward: str, timeout: float, limits: dict) -> GradeResult:
    base = repo_base_files(task)
    if isinstance(workspace, str):  # the agent's diff, applied by git to a copy of the base
        files = apply_patch(base, workspace) if workspace.strip() else dict(base)
    else:
        files = collect_files(workspace) if isinstance(workspace, Path) else dict(workspace)
    files = {os.path.normpath(p): c for p, c in files.items()}
    official = {f.path: f for f in task.visible_tests + task.hidden_tests}
    # The snapshot's pytest configuration is the grader's too: an agent's conftest.py / pytest.ini is dropped.
    config = {p: TaskFile(p, c) for p, c in base.items() if os.path.basename(p) in _PYTEST_CONFIG}
    ignored = sorted(p for p in files if p in official or os.path.basename(p) in _PYTEST_CONFIG)
    changed = sorted(p for p in set(files) | set(base) if files.get(p) != base.get(p) and p not in official)
    agent_files = [TaskFile(p, c) for p, c in files.items() if p not in official and p not in config
                   and os.path.basename(p) not in _PYTEST_CONFIG]
    expected = [*task.fail_to_pass, *task.pass_to_pass]
    _reward(0, 1, reward)
    test_paths = sorted({t.partition("::")[0] for t in expected})
    outcomes, result = _run_tests(task, agent_files + list(config.values()) + list(official.values()), test_paths,
                                  backend, timeout, limits)
    got = {t: outcomes.get(_base_id(t), "missing") for t in expected}
    passed = sum(1 for t in expected if got[t] == "passed")
    f2p = sum(1 for t in task.fail_to_pass if got[t] == "passed")
    p2p = sum(1 for t in task.pass_to_pass if got[t] == "passed")
    if reward == "fail_to_pass":
        value = _reward(f2p, len(task.fail_to_pass), reward, (p2p, len(task.pass_to_pass)))
    else:
        value = _reward(passed, len(expected), reward)
    return GradeResult(value, passed, len(expected) - passed, {
        "outcomes": got,
        "fail_to_pass": {"passed": f2p, "total": len(task.fail_to_pass)},
        "pass_to_pass": {"passed": p2p, "total": len(task.pass_to_pass)},
        "resolved": passed == len(expected), "changed_files": changed,
        "ignored_files": [p for p in ignored if files.get(p) != base.get(p)],
        "exit_code": result.exit_code, "timed_out": result.timed_out, "duration": result.duration,
        "log_tail": (result.stdout + result.stderr)[-2000:],
    })
