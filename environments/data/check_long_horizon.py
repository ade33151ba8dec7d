#!/usr/bin/env python3
"""Validate and verify long-horizon repository tasks (long_horizon_tasks.jsonl): tasks a careful agent solves
only by looking around first, each with the tool calls such an agent makes.

Usage (from the repository root):

    python environments/data/check_long_horizon.py [TASKS.jsonl] [--only ID ...] [--no-run] [--backend bwrap]
        [--jobs N]

A line is a repository task (`"kind": "repo"`, the format of environments/tasks.py and check_tasks.py) with
domain "long_horizon", a split of SPLITS (lh_train, lh_heldout; the generated set adds lh_sft and lh_rl), and one
more key, `reference_trajectory`: the calls a careful agent makes, `[{"name": TOOL, "arguments": {...}}, ...]`,
in the agent's tool set (environments/tools.py). Besides check_tasks.py's checks of a repository task (the
snapshot, the ids, the reference patch fails and passes as it should), a long-horizon task must need many turns:

1. the package has at least `MIN_MODULES` modules besides `__init__.py`, and the reference patch changes at least
   two of them (the fix spans files);
2. the problem statement names no file the patch changes (neither its path, its file name nor its dotted module),
   and `entry_file`, which the agent is told is the main file, is not one of them (the fault is elsewhere);
3. a visible test is among FAIL_TO_PASS, so running the visible tests shows the fault;
4. the trajectory has at least `MIN_CALLS` calls, each valid for its tool; it runs the visible tests and reads at
   least two things (a shell command or the editor's view) before its first change, changes no test file, and
   ends with `submit`.

Run (unless --no-run), the trajectory is played call by call in a real sandbox holding the snapshot and the
visible tests, as the agent's calls are: its first test run must fail, and the workspace it leaves must pass every
FAIL_TO_PASS and PASS_TO_PASS test when graded in a fresh sandbox with the hidden tests. Prints one line per task
and exits non-zero on any problem.
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import re
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path, PurePosixPath

if not __package__:  # run as a script: make the repository root importable
    _ROOT = str(Path(__file__).resolve().parents[2])
    if _ROOT not in sys.path:
        sys.path.insert(0, _ROOT)
from environments.data.check_tasks import report_task, validate_repo_task  # noqa: E402
from environments.data.verify_tasks import verify_repo_task  # noqa: E402

DEFAULT_TASKS = Path(__file__).resolve().parent / "long_horizon_tasks.jsonl"
DOMAIN = "long_horizon"
SPLITS = ("lh_train", "lh_heldout", "lh_sft", "lh_rl")  # the last two: generate_long_horizon.py
MIN_MODULES = 4
MIN_PATCHED_MODULES = 2
MIN_CALLS = 6
MIN_LOOKS = 2  # reads before the first change
MIN_TASKS, MIN_HELDOUT = 60, 15
EDITS = {"write_file", ("edit_file", "create"), ("edit_file", "str_replace"), ("edit_file", "insert")}


def read_lines(path: str) -> list[str]:
    """The lines of a task file, gzip-compressed (`.gz`) or not."""
    if str(path).endswith(".gz"):
        with gzip.open(path, "rt", encoding="utf-8") as f:
            return f.read().splitlines()
    return Path(path).read_text(encoding="utf-8").splitlines()


def patched_files(patch: str) -> list[str]:
    """The paths a unified diff changes (its `+++ b/` lines)."""
    return sorted({m.group(1) for m in re.finditer(r"^\+\+\+ b/(\S+)", patch, re.M)})


def _kind(call: dict) -> str | tuple[str, str]:
    name = call.get("name")
    if name == "edit_file":
        return ("edit_file", str(call.get("arguments", {}).get("command")))
    return name


def _runs_tests(call: dict) -> bool:
    return call.get("name") == "run_tests" or (
        call.get("name") == "bash" and "pytest" in str(call.get("arguments", {}).get("command", "")))


def check_statement(task: dict, changed: list[str], errors: list[str]) -> None:
    statement = task["problem_statement"]
    for path in changed:
        module = path[:-3].replace("/", ".") if path.endswith(".py") else path
        for name in {path, PurePosixPath(path).name, module}:
            if re.search(rf"(?<![\w.]){re.escape(name)}(?![\w])", statement):
                errors.append(f"the problem statement names {name!r}, a file the fix changes: the agent must "
                              "find it")
    if task["entry_file"] in changed:
        errors.append(f"entry_file {task['entry_file']!r} is changed by the fix: name a file the fault is not in")


def check_trajectory(task: dict, errors: list[str]) -> None:
    from environments.tools import validate_arguments
    from environments.types import ToolCall

    calls = task.get("reference_trajectory")
    if not isinstance(calls, list) or not all(isinstance(c, dict) for c in calls):
        errors.append("reference_trajectory must be a list of {name, arguments} objects")
        return
    if len(calls) < MIN_CALLS:
        errors.append(f"reference_trajectory has {len(calls)} calls, need at least {MIN_CALLS}")
    tests = {f["path"] for f in task["visible_tests"] + task["hidden_tests"]}
    first_edit = next((i for i, c in enumerate(calls) if _kind(c) in EDITS), None)
    for i, call in enumerate(calls):
        if set(call) - {"name", "arguments"} or not isinstance(call.get("arguments", {}), dict):
            errors.append(f"reference_trajectory[{i}]: keys are name and arguments (an object)")
            continue
        problem = validate_arguments(ToolCall(str(call.get("name")), call.get("arguments", {})))
        if problem:
            errors.append(f"reference_trajectory[{i}]: {problem}")
        path = str(call.get("arguments", {}).get("path", "")).strip().lstrip("./")
        if _kind(call) in EDITS and path in tests:
            errors.append(f"reference_trajectory[{i}] changes the test file {path!r}")
        if call.get("name") == "submit" and i != len(calls) - 1:
            errors.append(f"reference_trajectory[{i}]: submit before the last call")
    if not calls or calls[-1].get("name") != "submit":
        errors.append("reference_trajectory must end with submit")
    if first_edit is None:
        errors.append("reference_trajectory changes no file")
        return
    before = calls[:first_edit]
    if not any(_runs_tests(c) for c in before):
        errors.append("reference_trajectory must run the visible tests before its first change")
    looks = [c for c in before if c.get("name") == "bash" and not _runs_tests(c) or _kind(c) == ("edit_file", "view")]
    if len(looks) < MIN_LOOKS:
        errors.append(f"reference_trajectory reads {len(looks)} things before its first change, need {MIN_LOOKS}")


def validate_long_horizon_task(task: dict, errors: list[str]):
    """Static checks; returns check_tasks.py's parsed info for the run (or None)."""
    if not isinstance(task, dict):
        errors.append("not a JSON object")
        return None
    base = {k: v for k, v in task.items() if k != "reference_trajectory"}
    base.update(domain="repo", split="repo_train")  # the repository checks, with this set's domain and splits
    info = validate_repo_task(base, errors)
    if task.get("domain") != DOMAIN:
        errors.append(f"domain must be {DOMAIN!r}")
    if task.get("split") not in SPLITS:
        errors.append(f"split {task.get('split')!r} not in {SPLITS}")
    if "reference_trajectory" not in task:
        errors.append("no reference_trajectory")
    if info is None or errors:
        return info
    modules = [f["path"] for f in task["files"] if f["path"].endswith(".py")
               and PurePosixPath(f["path"]).name != "__init__.py"]
    if len(modules) < MIN_MODULES:
        errors.append(f"{len(modules)} modules besides __init__.py: a long-horizon task needs {MIN_MODULES}")
    changed = patched_files(task["patch"])
    if len([p for p in changed if p in modules]) < MIN_PATCHED_MODULES:
        errors.append(f"the reference patch changes {changed}: the fix must span {MIN_PATCHED_MODULES} modules")
    check_statement(task, changed, errors)
    visible = {f["path"] for f in task["visible_tests"]}
    if not any(t.split("::")[0] in visible for t in task["FAIL_TO_PASS"]):
        errors.append("no FAIL_TO_PASS test is visible: running the visible tests must show the fault")
    check_trajectory(task, errors)
    return info


def play_trajectory(record: dict, backend: str, errors: list[str]) -> str:
    """Play the reference trajectory in a sandbox as the agent's calls are played; grade what it leaves."""
    from environments.grading import collect_files, grade, setup_workspace
    from environments.sandbox import make_sandbox, task_sandbox_options
    from environments.tasks import task_from_record
    from environments.tools import execute_tool
    from environments.types import ToolCall

    task = task_from_record(record)
    first_test_failed = None
    with make_sandbox(backend, timeout_s=60, **task_sandbox_options(task, backend)) as box:
        setup_workspace(box.workspace, task.files + task.visible_tests, getattr(box, "uid", None))
        for i, call in enumerate(record["reference_trajectory"]):
            obs = execute_tool(ToolCall(call["name"], call.get("arguments", {})), box, task, timeout=60)
            if obs.error or (call["name"] == "edit_file" and obs.text.startswith("Error")):
                errors.append(f"reference_trajectory[{i}] ({call['name']}) failed: {obs.text[:300]}")
            if _runs_tests(call) and first_test_failed is None:
                first_test_failed = obs.exit_code != 0
            if obs.submitted:
                break
        files = collect_files(box.workspace)
    if first_test_failed is False:
        errors.append("the trajectory's first test run passed: the visible tests must show the fault")
    result = grade(task, files, backend=backend)
    if not result.all_passed:
        failing = [t for t, o in result.details["outcomes"].items() if o != "passed"]
        errors.append(f"the workspace the trajectory leaves fails {failing}")
    return f"trajectory of {len(record['reference_trajectory'])} calls solves it"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("tasks", nargs="?", default=str(DEFAULT_TASKS))
    ap.add_argument("--only", nargs="*", default=None, help="verify only these task ids")
    ap.add_argument("--no-run", action="store_true", help="static validation only")
    ap.add_argument("--backend", default="bwrap", help="the sandbox that plays the trajectories")
    ap.add_argument("--part", action="store_true", help="a part of the set: skip the whole set's counts")
    ap.add_argument("--jobs", type=int, default=1, help="tasks verified at once (each in sandboxes of its own)")
    args = ap.parse_args(argv)
    problems, tasks, seen = [], [], set()
    for lineno, line in enumerate(read_lines(args.tasks), 1):
        try:
            task = json.loads(line)
        except json.JSONDecodeError as exc:
            problems.append(f"line {lineno}: invalid JSON: {exc}")
            continue
        tid = task.get("id") if isinstance(task, dict) else None
        if tid in seen:
            problems.append(f"line {lineno}: duplicate id {tid!r}")
        seen.add(tid)
        tasks.append(task)
    splits = collections.Counter(t.get("split") for t in tasks if isinstance(t, dict))
    if not args.part and (len(tasks) < MIN_TASKS or splits["lh_heldout"] < MIN_HELDOUT):
        problems.append(f"dataset: {len(tasks)} tasks ({dict(splits)}); need {MIN_TASKS}, {MIN_HELDOUT} held out")
    started, n_ok = time.monotonic(), 0
    chosen = [t for t in tasks if args.only is None or (t.get("id") if isinstance(t, dict) else "?") in args.only]

    def verify(task):  # → (errors, status, seconds); tasks are independent, so --jobs runs them side by side
        errors, status, t0 = [], "static checks only", time.monotonic()
        info = validate_long_horizon_task(task, errors)
        if not errors and not args.no_run:
            status = verify_repo_task(task, info, errors)
            if not errors:
                status += "; " + play_trajectory(task, args.backend, errors)
        return errors, status, time.monotonic() - t0

    with ThreadPoolExecutor(max(args.jobs, 1)) as pool:
        for task, (errors, status, seconds) in zip(chosen, pool.map(verify, chosen)):  # in the set's order
            tid = task.get("id") if isinstance(task, dict) else "?"
            label = f"{tid} [{task.get('split')} d{task.get('difficulty')}]" if isinstance(task, dict) else tid
            n_ok += report_task(tid, label, errors, status, seconds, problems)
    print(f"\n{n_ok} task(s) {'validated' if args.no_run else 'verified'} in {time.monotonic() - started:.1f}s; "
          f"splits {dict(splits)}")
    for p in problems:
        print(f"  - {p}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
