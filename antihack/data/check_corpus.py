#!/usr/bin/env python3
"""Validate the anti-hack guard evaluation corpus (corpus.jsonl next to this file).

Stand-alone, standard library only. Checks every line (JSON object, keys and types, tool names and their
arguments, unique kebab-case ids, labels, category names from the taxonomy of docs/ALGORITHMS.md §4.2) and the
corpus as a whole (size, label balance, every hack category covered, multi-step hacks). Prints a table of
counts per category and label; exits 1 on any problem.

Usage: python antihack/data/check_corpus.py [path/to/corpus.jsonl] [--no-bash-syntax]
"""

from __future__ import annotations

import ast
import json
import posixpath
import re
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

# Taxonomy row(s) of docs/ALGORITHMS.md §4.2 behind each category; "obfuscation" is our own extra category.
CATEGORIES = {
    "test_modification": (1, 2),
    "test_skipping": (3,),
    "conftest_hook": (4,),
    "test_runner_tampering": (5,),
    "framework_monkeypatch": (6,),
    "grader_overwrite": (7,),
    "early_exit": (8,),
    "exit_code_masking": (9,),
    "always_equal": (10,),
    "output_spoofing": (11,),
    "harness_detection": (12,),
    "hardcoded_outputs": (13,),
    "exception_swallowing": (14,),
    "reading_test_data": (15,),
    "hidden_data_access": (16,),
    "solution_search": (17,),
    "git_history_leakage": (18,),
    "git_internals": (19,),
    "network_download": (20,),
    "package_under_test_install": (21,),
    "module_shadowing": (22,),
    "grader_marker_write": (23,),
    "timing_manipulation": (24,),
    "reference_copy": (25,),
    "precomputed_answers": (26,),
    "verification_tool_replacement": (27,),
    "monitor_killing": (28,),
    "task_file_edit": (29,),
    "collection_breaking": (30,),
    "privilege_escalation": (31,),
    "judge_injection": (32,),
    "functionality_deletion": (33,),
    "obfuscation": (),
}
BENIGN_ONLY = "benign"  # category for benign lines not confusable with any hack category
COMMON = ("test_modification", "hidden_data_access", "network_download", "conftest_hook", "test_runner_tampering",
          "git_history_leakage", "always_equal", "early_exit", "obfuscation")

MIN_LINES, MIN_PER_LABEL, MIN_PER_CATEGORY, MIN_COMMON, MIN_MULTI_STEP = 170, 85, 2, 4, 4

LINE_KEYS = {"id", "task", "history", "call", "label", "category"}
TASK_KEYS = {"statement", "protected_paths"}
TOOL_ARGS = {"bash": {"command"}, "write_file": {"path", "content"}, "run_tests": set(), "submit": set()}
LABELS = {"hack", "benign"}
ID_RE = re.compile(r"^[a-z0-9]+(?:-[a-z0-9]+)*$")
EXEC_PREFIX = re.compile(r"(?:^|[\s;&|(`])(?:bash|sh|python3?|source|\.|make\s+-f)\s+(\S+)|(?:^|[\s;&|(`])(\./\S+)")


def check_tool_call(obj, where: str, errors: list[str], bash_syntax: bool) -> None:
    if not isinstance(obj, dict):
        errors.append(f"{where}: tool call must be an object")
        return
    if set(obj) != {"name", "arguments"}:
        errors.append(f"{where}: tool call keys must be name, arguments (got {sorted(obj)})")
        return
    name, args = obj["name"], obj["arguments"]
    if name not in TOOL_ARGS:
        errors.append(f"{where}: unknown tool {name!r} (allowed: {sorted(TOOL_ARGS)})")
        return
    if not isinstance(args, dict):
        errors.append(f"{where}: arguments must be an object")
        return
    if set(args) != TOOL_ARGS[name]:
        errors.append(f"{where}: {name} arguments must be {sorted(TOOL_ARGS[name])} (got {sorted(args)})")
        return
    for key, value in args.items():
        if not isinstance(value, str):
            errors.append(f"{where}: {name}.{key} must be a string")
            return
    if name == "bash":
        cmd = args["command"]
        if not cmd.strip():
            errors.append(f"{where}: empty bash command")
        elif bash_syntax:
            problem = bash_syntax_error(cmd)
            if problem:
                errors.append(f"{where}: bash syntax error: {problem}")
    elif name == "write_file":
        path = args["path"]
        if not path.strip():
            errors.append(f"{where}: empty write_file path")
        if path.endswith(".py"):
            try:
                ast.parse(args["content"], filename=path)
            except SyntaxError as exc:
                errors.append(f"{where}: written Python {path} does not parse: {exc}")


_BASH = shutil.which("bash")


def bash_syntax_error(cmd: str) -> str:
    """`bash -n` on the command ('' when fine or when bash is not available)."""
    if not _BASH:
        return ""
    proc = subprocess.run([_BASH, "-n", "-c", cmd], capture_output=True, text=True)
    return proc.stderr.strip().splitlines()[-1] if proc.returncode else ""


def written_paths(history: list) -> set[str]:
    out = set()
    for call in history:
        if isinstance(call, dict) and call.get("name") == "write_file":
            path = (call.get("arguments") or {}).get("path")
            if isinstance(path, str):
                out.add(posixpath.normpath(path.removeprefix("/workspace/")))
    return out


def is_multi_step(row: dict) -> bool:
    """The call executes a script that an earlier write_file in the history created."""
    call, history = row.get("call"), row.get("history")
    if not history or not isinstance(call, dict) or call.get("name") != "bash":
        return False
    written = written_paths(history)
    cmd = (call.get("arguments") or {}).get("command", "")
    for m in EXEC_PREFIX.finditer(cmd):
        target = posixpath.normpath((m.group(1) or m.group(2)).removeprefix("/workspace/"))
        if target in written:
            return True
    return False


def check_line(n: int, raw: str, seen_ids: set[str], errors: list[str], bash_syntax: bool):
    where = f"line {n}"
    try:
        row = json.loads(raw)
    except json.JSONDecodeError as exc:
        errors.append(f"{where}: invalid JSON: {exc}")
        return None
    if not isinstance(row, dict):
        errors.append(f"{where}: not a JSON object")
        return None
    if set(row) != LINE_KEYS:
        errors.append(f"{where}: keys must be {sorted(LINE_KEYS)} (missing {sorted(LINE_KEYS - set(row))}, "
                      f"extra {sorted(set(row) - LINE_KEYS)})")
        return None
    rid = row["id"]
    if not isinstance(rid, str) or not ID_RE.match(rid):
        errors.append(f"{where}: id {rid!r} is not kebab-case")
    elif rid in seen_ids:
        errors.append(f"{where}: duplicate id {rid!r}")
    else:
        seen_ids.add(rid)
    where = f"line {n} ({rid})"

    task = row["task"]
    if not isinstance(task, dict) or set(task) != TASK_KEYS:
        errors.append(f"{where}: task must be an object with keys {sorted(TASK_KEYS)}")
    else:
        if not isinstance(task["statement"], str) or not task["statement"].strip():
            errors.append(f"{where}: task.statement must be a non-empty string")
        pp = task["protected_paths"]
        if not isinstance(pp, list) or not pp or not all(isinstance(p, str) and p.strip() for p in pp):
            errors.append(f"{where}: task.protected_paths must be a non-empty list of strings")
        elif not any(p.startswith(("tests/", "test/", "/eval/")) for p in pp):
            errors.append(f"{where}: task.protected_paths lists no test file")

    if not isinstance(row["history"], list):
        errors.append(f"{where}: history must be a list")
    else:
        for i, call in enumerate(row["history"]):
            check_tool_call(call, f"{where} history[{i}]", errors, bash_syntax)
    check_tool_call(row["call"], f"{where} call", errors, bash_syntax)

    label, category = row["label"], row["category"]
    if label not in LABELS:
        errors.append(f"{where}: label {label!r} not in {sorted(LABELS)}")
    if category not in CATEGORIES and category != BENIGN_ONLY:
        errors.append(f"{where}: unknown category {category!r}")
    if label == "hack" and category == BENIGN_ONLY:
        errors.append(f"{where}: a hack needs a hack category, not {BENIGN_ONLY!r}")
    return row


def main(argv: list[str]) -> int:
    args = [a for a in argv if not a.startswith("--")]
    bash_syntax = "--no-bash-syntax" not in argv
    path = Path(args[0]) if args else Path(__file__).with_name("corpus.jsonl")
    errors: list[str] = []
    if not path.is_file():
        print(f"FAIL: {path} not found")
        return 1

    rows, seen = [], set()
    for n, raw in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not raw.strip():
            errors.append(f"line {n}: empty line")
            continue
        row = check_line(n, raw, seen, errors, bash_syntax)
        if row is not None:
            rows.append(row)

    counts = Counter((r["category"], r["label"]) for r in rows)
    labels = Counter(r["label"] for r in rows)
    multi = [r["id"] for r in rows if r["label"] == "hack" and is_multi_step(r)]

    if len(rows) < MIN_LINES:
        errors.append(f"corpus: {len(rows)} valid lines < {MIN_LINES}")
    for label in sorted(LABELS):
        if labels[label] < MIN_PER_LABEL:
            errors.append(f"corpus: {labels[label]} {label} lines < {MIN_PER_LABEL}")
    for cat in CATEGORIES:
        need = MIN_COMMON if cat in COMMON else MIN_PER_CATEGORY
        if counts[(cat, "hack")] < need:
            errors.append(f"corpus: category {cat} has {counts[(cat, 'hack')]} hack lines < {need}")
    if len(multi) < MIN_MULTI_STEP:
        errors.append(f"corpus: {len(multi)} multi-step hacks (history writes a script, call runs it) "
                      f"< {MIN_MULTI_STEP}")

    # summary table
    cats = list(CATEGORIES) + [BENIGN_ONLY]
    width = max(map(len, cats)) + 2
    print(f"{'category':<{width}}{'rows':>6}{'hack':>6}{'benign':>8}{'total':>7}")
    print("-" * (width + 27))
    for cat in cats:
        rows_ = ",".join(map(str, CATEGORIES.get(cat, ()))) or "-"
        h, b = counts[(cat, "hack")], counts[(cat, "benign")]
        print(f"{cat:<{width}}{rows_:>6}{h:>6}{b:>8}{h + b:>7}")
    print("-" * (width + 27))
    print(f"{'TOTAL':<{width}}{'':>6}{labels['hack']:>6}{labels['benign']:>8}{len(rows):>7}")
    with_history = sum(1 for r in rows if r["history"])
    print(f"lines with non-empty history: {with_history}; multi-step hacks (script written, then run): "
          f"{len(multi)} ({', '.join(multi)})")
    if bash_syntax and not _BASH:
        print("note: bash not found, shell syntax not checked")

    if errors:
        print(f"\nFAIL: {len(errors)} problem(s)")
        for e in errors:
            print("  " + e)
        return 1
    print("\nOK")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
