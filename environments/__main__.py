"""`python -m environments`: look at the tasks, grade solutions, play an episode by hand.

    python -m environments list [--tasks FILE] [--split heldout] [--domain bugfix] [--json]
    python -m environments grade TASK_ID [TASK_ID ...] [--all] [--workspace DIR] [--backend docker]
    python -m environments play TASK_ID [--backend docker] [--no-guard]

`grade` grades each task's reference solution and its unsolved start (the start must not pass), or the files of
a folder (`--workspace`). `play` opens a real sandbox with the task's files and reads tool calls, one per line,
from the keyboard (or a pipe), through the anti-hack guard, as the agent's would go:

    bash: ls -la                                  a shell command
    run_tests                                     a tool without arguments
    edit_file: {"command": "view", "path": "solution.py"}
    {"name": "write_file", "arguments": {"path": "a.py", "content": "x = 1\\n"}}
    write_file: solution.py <<EOF                 the lines up to EOF are the content
    submit                                        grade the workspace in a fresh sandbox, and stop
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from environments.grading import collect_files, grade, setup_workspace
from environments.sandbox import BACKENDS, make_sandbox, task_sandbox_options
from environments.tasks import SHIPPED_TASKS, in_split, load_tasks
from environments.tools import TOOL_NAMES, TOOL_SPECS, execute_tool
from environments.types import Task, ToolCall


def _tasks(args) -> list[Task]:
    source = args.tasks
    if source.endswith((".jsonl", ".json", ".parquet", ".gz")) and not Path(source).exists():
        raise SystemExit(f"error: no task file {source}")
    return load_tasks(source).tasks  # load_tasks warns once per skipped record


def _pick(tasks: list[Task], ids: list[str], source: str) -> list[Task]:
    by_id = {t.id: t for t in tasks}
    unknown = [i for i in ids if i not in by_id]
    if unknown:
        raise SystemExit(f"error: no task {', '.join(map(repr, unknown))} in {source} "
                         f"(python -m environments list --tasks {source})")
    return [by_id[i] for i in ids]


# ---- list -------------------------------------------------------------------------------------------------------
def cmd_list(args) -> int:
    tasks = [t for t in _tasks(args) if in_split(t, args.split)
             and (args.domain is None or t.domain == args.domain)]
    if args.json:
        for t in tasks:
            print(json.dumps({"id": t.id, "split": t.split, "domain": t.domain, "difficulty": t.difficulty,
                              "visible_tests": len(t.visible_tests), "hidden_tests": len(t.hidden_tests),
                              "reference_solution": bool(t.reference_solution),
                              "docker_image": t.metadata.get("docker_image"), "kind": t.kind,
                              "fail_to_pass": len(t.fail_to_pass), "pass_to_pass": len(t.pass_to_pass)}))
        return 0
    width = max([len(t.id) for t in tasks] + [2])
    sw = max([len(t.split) for t in tasks] + [8])
    print(f"{'id':<{width}}  {'split':<{sw}} {'domain':<10} diff  tests(visible/hidden)  statement")
    for t in tasks:
        statement = " ".join(t.statement.split())
        print(f"{t.id:<{width}}  {t.split:<{sw}} {t.domain:<10} {t.difficulty:>4}  {len(t.visible_tests):>6}/"
              f"{len(t.hidden_tests):<14} {statement[:60] + ('…' if len(statement) > 60 else '')}")
    print(f"{len(tasks)} task(s)", file=sys.stderr)
    return 0


# ---- grade ------------------------------------------------------------------------------------------------------
def _show(label: str, task: Task, result) -> None:
    repo = ""
    if task.is_repo:  # SWE-style: which of the listed tests pass
        f2p, p2p = result.details["fail_to_pass"], result.details["pass_to_pass"]
        repo = f"  FAIL_TO_PASS {f2p['passed']}/{f2p['total']}  PASS_TO_PASS {p2p['passed']}/{p2p['total']}"
    print(f"{task.id}  {label:<9} reward {result.reward:.3f}  passed {result.passed}  failed {result.failed}{repo}  "
          f"({result.details['duration']:.1f} s)")
    for test, outcome in result.details["outcomes"].items():
        if outcome != "passed":
            print(f"    {outcome:<7} {test}")


def cmd_grade(args) -> int:
    tasks = _tasks(args)
    if args.all:
        chosen = [t for t in tasks if in_split(t, args.split)
                  and (args.domain is None or t.domain == args.domain)]
    elif args.task_ids:
        chosen = _pick(tasks, args.task_ids, args.tasks)
    else:
        raise SystemExit("error: name the task(s) to grade, or --all")
    if args.workspace and len(chosen) != 1:
        raise SystemExit("error: --workspace grades one task")
    limits = {"timeout_s": args.timeout}
    bad = 0
    for task in chosen:
        start = {f.path: f.content for f in task.files}
        if args.workspace:
            folder = Path(args.workspace)
            if not folder.is_dir():
                raise SystemExit(f"error: --workspace {folder} is not a folder")
            result = grade(task, folder, backend=args.backend, reward=args.reward, **limits)
            _show("workspace", task, result)
            bad += not result.all_passed
            continue
        if not task.reference_solution:
            print(f"{task.id}  no reference solution; grading the start only")
        else:
            solved = grade(task, {**start, **{f.path: f.content for f in task.reference_solution}},
                           backend=args.backend, reward=args.reward, **limits)
            _show("reference", task, solved)
            if not solved.all_passed:
                bad += 1
                print(f"    FAIL: the reference solution does not pass; log tail:\n{solved.details['log_tail']}")
        unsolved = grade(task, start, backend=args.backend, reward=args.reward, **limits)
        _show("start", task, unsolved)
        if unsolved.all_passed:
            bad += 1
            print("    FAIL: the unsolved start already passes every hidden test")
    if len(chosen) > 1:
        print(f"{len(chosen) - bad}/{len(chosen)} task(s) as expected")
    return 1 if bad else 0


# ---- play -------------------------------------------------------------------------------------------------------
HELP = __doc__.split("from the keyboard (or a pipe), through the anti-hack guard, as the agent's would go:\n")[1]


def parse_line(line: str, more_lines=None) -> ToolCall:
    """One typed tool call: JSON ({"name", "arguments"}), `name: JSON object`, `bash: command`, a bare name, or
    `write_file: PATH <<WORD` followed by the content up to a line WORD (read from `more_lines`)."""
    text = line.strip()
    if text.startswith("{"):
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"invalid JSON: {exc}") from None
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            raise ValueError('a JSON call is {"name": TOOL, "arguments": {...}}')
        arguments = obj.get("arguments", {})
        if not isinstance(arguments, dict):
            raise ValueError("arguments must be a JSON object")
        return ToolCall(obj["name"], arguments)
    name, sep, rest = text.partition(":")
    name, rest = name.strip(), rest.strip()
    if name not in TOOL_NAMES:
        raise ValueError(f"unknown tool {name!r}; tools: {', '.join(TOOL_NAMES)} (type help)")
    if not sep or not rest:
        return ToolCall(name, {})
    if name == "bash":
        return ToolCall("bash", {"command": rest})
    if name == "write_file" and "<<" in rest:
        path, word = (part.strip() for part in rest.split("<<", 1))
        if not path or not word:
            raise ValueError("write_file: PATH <<WORD, then the content, then WORD alone on a line")
        content = []
        for raw in more_lines or ():
            if raw.rstrip("\n") == word:
                break
            content.append(raw if raw.endswith("\n") else raw + "\n")
        else:
            raise ValueError(f"write_file: input ended before the closing {word!r}")
        return ToolCall("write_file", {"path": path, "content": "".join(content)})
    try:
        arguments = json.loads(rest)
    except json.JSONDecodeError:
        raise ValueError(f"{name}: the arguments must be a JSON object, e.g. "
                         f"{name}: {json.dumps(_example(name))}") from None
    if not isinstance(arguments, dict):
        raise ValueError(f"{name}: the arguments must be a JSON object")
    return ToolCall(name, arguments)


def _example(name: str) -> dict:
    spec = next(t for t in TOOL_SPECS if t["name"] == name)
    return {k: ("..." if v["type"] == "string" else 1) for k, v in spec["parameters"]["properties"].items()
            if k in spec["parameters"]["required"]}


def cmd_play(args) -> int:
    task = _pick(_tasks(args), [args.task_id], args.tasks)[0]
    guard = context = None
    if not args.no_guard:
        from antihack import Guard, GuardContext  # the guard builds on environments; loaded by this entry point only

        guard, context = Guard(), GuardContext.for_task(task)
    interactive = sys.stdin.isatty()
    lines = iter(sys.stdin)
    limits = {"timeout_s": args.timeout, **task_sandbox_options(task, args.backend)}
    with make_sandbox(args.backend, **limits) as box:
        setup_workspace(box.workspace, task.files + task.visible_tests, getattr(box, "uid", None))
        print(f"Task {task.id} ({task.domain}, {task.split}) in a {args.backend} sandbox; guard "
              f"{'off' if guard is None else 'on'}. Type help for the syntax, submit to grade, quit to stop.\n")
        print(f"{task.statement}\n\nFiles: {', '.join(f.path for f in task.files + task.visible_tests)}")
        turn = 0
        while True:
            if interactive:
                print(f"\n[{turn}]> ", end="", flush=True)
            line = next(lines, None)
            if line is None or line.strip() in ("quit", "exit"):
                print("\nStopped without submitting.")
                return 0
            if not line.strip() or line.lstrip().startswith("#"):
                continue
            if line.strip() == "help":
                print(HELP)
                continue
            try:
                call = parse_line(line, lines)
            except ValueError as exc:
                print(f"! {exc}")
                continue
            turn += 1
            if not interactive:
                print(f"\n[{turn}]> {call.describe()}")
            if guard is not None:
                context.turn = turn
                verdict = guard.check(call, context)
                if verdict.flagged:
                    print(f"guard: {verdict.action} ({', '.join(verdict.rule_ids)}): {verdict.reason}")
                if verdict.action == "block":
                    dummy = guard.dummy_observation(call, verdict)
                    print(f"(not run; the agent would see:)\n{dummy.text}")
                    continue
            observation = execute_tool(call, box, task, timeout=args.timeout, max_chars=args.max_chars)
            print(observation.text)
            if observation.submitted:
                result = grade(task, collect_files(box.workspace), backend=args.backend, timeout=args.timeout * 3)
                _show("submitted", task, result)
                return 0 if result.all_passed else 1


# ---- entry point -----------------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m environments", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)

    def common(p, filters: bool):
        p.add_argument("--tasks", default=SHIPPED_TASKS, help="task file or dataset (default: the shipped tasks)")
        if filters:
            p.add_argument("--split", help="only this split (train, heldout, …; all: every split)")
            p.add_argument("--domain", help="only this domain (function, bugfix, …)")

    p = sub.add_parser("list", help="list the tasks")
    common(p, True)
    p.add_argument("--json", action="store_true", help="one JSON object per task")
    p.set_defaults(func=cmd_list)

    p = sub.add_parser("grade", help="grade reference solutions and unsolved starts, or a workspace folder")
    common(p, True)
    p.add_argument("task_ids", nargs="*", metavar="TASK_ID")
    p.add_argument("--all", action="store_true", help="every task (after --split / --domain)")
    p.add_argument("--workspace", help="grade the files of this folder instead")
    p.add_argument("--backend", choices=BACKENDS, default="bwrap")
    p.add_argument("--reward", choices=["pass_fraction", "fail_to_pass", "binary"], default="pass_fraction")
    p.add_argument("--timeout", type=float, default=60.0, help="seconds for the test run")
    p.set_defaults(func=cmd_grade)

    p = sub.add_parser("play", help="an episode by hand: type tool calls against a real sandbox")
    common(p, False)
    p.add_argument("task_id", metavar="TASK_ID")
    p.add_argument("--backend", choices=BACKENDS, default="bwrap")
    p.add_argument("--no-guard", action="store_true", help="run every call, even those the guard would block")
    p.add_argument("--timeout", type=float, default=30.0, help="seconds per tool call")
    p.add_argument("--max-chars", type=int, default=4000, help="observation size, as the agent's")
    p.set_defaults(func=cmd_play)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except BrokenPipeError:  # `... | head`: the reader has gone; nothing left to say
        sys.stdout = open(os.devnull, "w")
        return 0
    except (RuntimeError, OSError, ValueError) as exc:  # no engine, no bwrap, a bad task file: say it plainly
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
