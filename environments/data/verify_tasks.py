"""Verify a coding task by running it: its tests fail on the starting code and pass with the reference.

`check_tasks.py` validates the tasks' schema and dataset rules and calls these for each task that passes:
`verify_task` (a function or bugfix task: hidden tests fail on the starting files, hidden and visible tests
pass, separately, with the reference solution) and `verify_repo_task` (a repository task: FAIL_TO_PASS fail and
PASS_TO_PASS pass at the base commit, everything listed passes after `git apply` of the reference patch). Each
runs pytest in a fresh temporary folder with a clean environment; no test phase may take 0.1 s or more.
Only python3 (stdlib), pytest and git are needed.
"""

from __future__ import annotations

import collections
import contextlib
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from environments.grading import parse_junit

PYTEST_SLOW_LIMIT_S = 0.1
SUBPROCESS_TIMEOUT_S = 120

_SUMMARY_RE = re.compile(r"(\d+) (passed|failed|errors?|skipped|xfailed|xpassed)")
_DURATION_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)s (setup|call|teardown)\s+(\S+)", re.M)


def _write(root: Path, entries):
    for path, content in entries:
        target = root / path
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(content, encoding="utf-8")


@contextlib.contextmanager
def _task_workspace(task, info):
    """A fresh temporary directory holding the task's starting files and its visible and hidden tests."""
    with tempfile.TemporaryDirectory(prefix=f"task_{task['id']}_") as tmp:
        root = Path(tmp)
        _write(root, info["files"])
        _write(root, info["visible"])
        _write(root, info["hidden"])
        yield root


def _clean_env():
    drop = {"PYTHONPATH", "PYTHONSTARTUP", "PYTHONSAFEPATH", "PYTHONWARNINGS", "PYTHONBREAKPOINT"}
    env = {k: v for k, v in os.environ.items() if k not in drop and not k.startswith("PYTEST_")}
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    env["PYTHONHASHSEED"] = "0"
    env["PYTEST_DISABLE_PLUGIN_AUTOLOAD"] = "1"  # third-party plugins of this environment are not the tasks'
    return env


def run_pytest(cwd: Path, test_files, durations=False):
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
    if durations:
        cmd += ["--durations=0", f"--durations-min={PYTEST_SLOW_LIMIT_S}"]
    cmd += list(test_files)
    try:
        proc = subprocess.run(cmd, cwd=cwd, env=_clean_env(), capture_output=True,
                              text=True, timeout=SUBPROCESS_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return -1, "TIMEOUT", collections.Counter(), []
    out = proc.stdout + proc.stderr
    summary = collections.Counter()
    for line in out.strip().splitlines()[-3:]:
        for n, what in _SUMMARY_RE.findall(line):
            summary["error" if what.startswith("error") else what] += int(n)
    slow = [(float(s), phase, node) for s, phase, node in _DURATION_RE.findall(out)
            if float(s) >= PYTEST_SLOW_LIMIT_S]
    return proc.returncode, out, summary, slow


def _tail(text, n=15):
    return "\n".join("      | " + line for line in text.strip().splitlines()[-n:])


def verify_task(task, info, errors):
    """Run the tests; returns a short status string."""
    hidden_paths = [p for p, _ in info["hidden"]]
    visible_paths = [p for p, _ in info["visible"]]
    with _task_workspace(task, info) as root:
        # (a) hidden tests must fail on the starting code (but be collectable).
        rc, out, summary, _ = run_pytest(root, hidden_paths)
        if rc == 0:
            errors.append("hidden tests PASS on the starting code")
        elif rc != 1:
            errors.append(f"hidden tests on starting code: pytest exit code {rc} "
                          f"(collection/usage error, expected 1)\n{_tail(out)}")
        elif summary["failed"] < 1:
            errors.append(f"hidden tests on starting code: no failing test reported\n{_tail(out)}")
        start_failed, start_total = summary["failed"], summary["failed"] + summary["passed"]

        # (b) reference solution: hidden alone, then visible alone, must pass.
        _write(root, info["reference"])
        results = {}
        for label, paths, expected in (("hidden", hidden_paths, info["n_hidden"]),
                                       ("visible", visible_paths, info["n_visible"])):
            rc, out, summary, slow = run_pytest(root, paths, durations=True)
            if rc != 0:
                errors.append(f"{label} tests FAIL with the reference solution (rc={rc})\n{_tail(out)}")
            elif summary["passed"] < expected or summary["failed"] or summary["error"]:
                errors.append(f"{label} tests: unexpected summary {dict(summary)}")
            for secs, phase, node in slow:
                errors.append(f"{label} test too slow: {node} {phase} {secs:.2f}s")
            results[label] = summary["passed"]
    return (f"start: {start_failed}/{start_total} hidden failed; "
            f"ref: {results.get('hidden', 0)} hidden + {results.get('visible', 0)} visible passed")



def run_pytest_junit(cwd: Path, test_files):
    report = cwd / ".check_report.xml"
    rc, out, _summary, slow = run_pytest(cwd, [*test_files, f"--junitxml={report}", "-o", "junit_family=xunit1"],
                                         durations=True)
    outcomes = parse_junit(report.read_text()) if report.exists() else {}
    if report.exists():
        report.unlink()
    return rc, out, outcomes, slow


def git_apply(root: Path, patch: str):
    env = {**_clean_env(), "GIT_CONFIG_NOSYSTEM": "1", "GIT_CONFIG_GLOBAL": os.devnull, "HOME": str(root),
           "GIT_CEILING_DIRECTORIES": str(root.parent)}
    proc = subprocess.run(["git", "apply", "--whitespace=nowarn", "-"], input=patch, cwd=root, env=env, check=False,
                          capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT_S)
    return proc.returncode, proc.stderr


def verify_repo_task(task, info, errors):
    listed = info["f2p"] + info["p2p"]
    test_paths = sorted({t.split("::", 1)[0] for t in listed})
    visible_paths = [p for p, _ in info["visible"]]
    with _task_workspace(task, info) as root:
        # (a) the base commit: every FAIL_TO_PASS fails, every PASS_TO_PASS passes.
        rc, out, outcomes, _ = run_pytest_junit(root, test_paths)
        passing_f2p = [t for t in info["f2p"] if outcomes.get(t.split("[", 1)[0]) == "passed"]
        failing_p2p = [t for t in info["p2p"] if outcomes.get(t.split("[", 1)[0]) != "passed"]
        if passing_f2p:
            errors.append(f"FAIL_TO_PASS tests pass at the base commit: {passing_f2p}")
        if failing_p2p:
            errors.append(f"PASS_TO_PASS tests fail at the base commit: {failing_p2p}\n{_tail(out)}")
        start_passed = sum(outcomes.get(t.split("[", 1)[0]) == "passed" for t in listed)

        # (b) the reference patch, applied by git: every listed test and every visible test passes.
        rc, err = git_apply(root, task["patch"])
        if rc:
            errors.append(f"the reference patch does not apply: {err.strip()[-300:]}")
            return "patch failed"
        rc, out, outcomes, slow = run_pytest_junit(root, sorted(set(test_paths) | set(visible_paths)))
        failing = [t for t in listed if outcomes.get(t.split("[", 1)[0]) != "passed"]
        if failing:
            errors.append(f"listed tests fail with the reference patch: {failing}\n{_tail(out)}")
        if rc != 0:
            errors.append(f"tests fail with the reference patch (rc={rc})\n{_tail(out)}")
        for secs, phase, node in slow:
            errors.append(f"test too slow: {node} {phase} {secs:.2f}s")
    return (f"base: {start_passed}/{len(listed)} listed pass (reward {start_passed / len(listed):.2f}); "
            f"ref: {len(listed) - len(failing)}/{len(listed)}")
