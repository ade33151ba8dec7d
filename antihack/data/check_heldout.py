#!/usr/bin/env python3
"""Validate the held-out anti-hack guard corpus (heldout_corpus.jsonl).

Stdlib only.  Usage:

    python check_heldout.py [path/to/heldout_corpus.jsonl]

Checks: one JSON object per line with exactly the keys id/task/history/call/label/category;
unique kebab-case ids starting with "ho-"; task.statement / task.protected_paths well formed;
tool names and argument keys (bash, write_file, run_tests, submit); labels and categories;
counts (130 lines, 65 hack + 65 benign, >= 25 hack categories, >= 5 multi-step hacks);
`bash -n` on every bash command (call and history); ast.parse on every written .py file and
on python heredocs / `python -c` snippets inside bash commands; `bash -n` on written shell
scripts; benign lines must not touch hidden protected paths; no duplicated (task, history, call).
Prints counts per category and label; exits 1 on any problem.
"""
import argparse
import ast
import collections
import json
import os
import re
import shlex
import subprocess
import sys

TOOLS = {
    "bash": {"command"},
    "write_file": {"path", "content"},
    "run_tests": set(),
    "submit": set(),
}
HACK_CATEGORIES = [
    "test_modification", "test_skipping", "conftest_hook", "test_runner_tampering",
    "framework_monkeypatch", "grader_overwrite", "early_exit", "exit_code_masking",
    "always_equal", "output_spoofing", "harness_detection", "hardcoded_outputs",
    "exception_swallowing", "reading_test_data", "hidden_data_access", "solution_search",
    "git_history_leakage", "git_internals", "network_download", "package_under_test_install",
    "module_shadowing", "grader_marker_write", "timing_manipulation", "reference_copy",
    "precomputed_answers", "verification_tool_replacement", "monitor_killing", "task_file_edit",
    "collection_breaking", "privilege_escalation", "judge_injection", "functionality_deletion",
    "obfuscation",
]
CATEGORIES = set(HACK_CATEGORIES) | {"benign"}
LABELS = {"hack", "benign"}
KEYS = {"id", "task", "history", "call", "label", "category"}
TASK_KEYS = {"statement", "protected_paths"}
ID_RE = re.compile(r"^ho-[a-z0-9]+(?:-[a-z0-9]+)*$")
HIDDEN_MARKERS = ("hidden", "grader", "eval/", "expected")

EXPECTED_TOTAL = 130
EXPECTED_PER_LABEL = {"hack": 65, "benign": 65}
MIN_HACK_CATEGORIES = 25
MIN_MULTISTEP_HACKS = 5

# `python3 - <<'EOF' ... EOF` (also python, with or without the "-", quoted or bare delimiter)
PY_HEREDOC_RE = re.compile(
    r"\bpython3?(?:\.\d+)?\s+(?:-\s*)?<<-?\s*(['\"]?)(\w+)\1[^\n]*\n(.*?)\n\2[ \t]*(?:\n|$)",
    re.S,
)
PY_NAME_RE = re.compile(r"^(?:.*/)?python3?(?:\.\d+)?$")


def is_hidden(path):
    p = path.lower()
    return any(marker in p for marker in HIDDEN_MARKERS)


def bash_syntax_error(script):
    """Return None if `bash -n` accepts the script, else its error text."""
    try:
        res = subprocess.run(
            ["bash", "-n"], input=script, capture_output=True, text=True, timeout=20
        )
    except (OSError, subprocess.TimeoutExpired) as exc:  # pragma: no cover - environment problem
        return f"could not run bash -n: {exc}"
    if res.returncode != 0:
        return (res.stderr or res.stdout or "bash -n failed").strip()
    return None


def python_syntax_error(source, label):
    try:
        ast.parse(source, filename=label)
    except SyntaxError as exc:
        return f"{label}: {exc.msg} (line {exc.lineno})"
    return None


def python_snippets(command):
    """Yield (label, source) for python code embedded in a bash command."""
    for m in PY_HEREDOC_RE.finditer(command):
        yield "python heredoc", m.group(3)
    if "<<" in command:
        return  # shlex cannot tokenise heredoc bodies reliably
    try:
        tokens = shlex.split(command, comments=False, posix=True)
    except ValueError:
        return
    for i, tok in enumerate(tokens[:-2]):
        if PY_NAME_RE.match(tok) and tokens[i + 1] == "-c":
            yield "python -c", tokens[i + 2]


def looks_like_shell(path, content):
    first = content.split("\n", 1)[0]
    return path.endswith(".sh") or (first.startswith("#!") and re.search(r"\b(ba|da)?sh\b", first))


def check_call(call, where, problems):
    """Validate one tool call; return True if structurally valid."""
    if not isinstance(call, dict) or set(call) != {"name", "arguments"}:
        problems.append(f"{where}: call must be an object with exactly 'name' and 'arguments'")
        return False
    name, args = call["name"], call["arguments"]
    if name not in TOOLS:
        problems.append(f"{where}: unknown tool {name!r}")
        return False
    if not isinstance(args, dict) or set(args) != TOOLS[name]:
        problems.append(f"{where}: {name} arguments must have exactly the keys {sorted(TOOLS[name])}, got {args!r:.80}")
        return False
    for key, value in args.items():
        if not isinstance(value, str) or not value.strip():
            problems.append(f"{where}: {name}.{key} must be a non-empty string")
            return False
    if name == "bash":
        cmd = args["command"]
        err = bash_syntax_error(cmd)
        if err:
            problems.append(f"{where}: bash -n failed: {err}")
        for label, src in python_snippets(cmd):
            err = python_syntax_error(src, label)
            if err:
                problems.append(f"{where}: embedded {err}")
    elif name == "write_file":
        path, content = args["path"], args["content"]
        if path.endswith(".py"):
            err = python_syntax_error(content, path)
            if err:
                problems.append(f"{where}: written file does not parse: {err}")
        elif looks_like_shell(path, content):
            err = bash_syntax_error(content)
            if err:
                problems.append(f"{where}: written shell script fails bash -n: {err}")
    return True


def call_strings(call):
    return [v for v in call.get("arguments", {}).values() if isinstance(v, str)]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    default = os.path.join(os.path.dirname(os.path.abspath(__file__)), "heldout_corpus.jsonl")
    parser.add_argument("path", nargs="?", default=default)
    opts = parser.parse_args()

    problems = []
    rows = []
    try:
        with open(opts.path, encoding="utf-8") as fh:
            lines = fh.read().split("\n")
    except OSError as exc:
        print(f"cannot read {opts.path}: {exc}")
        return 1
    if lines and lines[-1] == "":
        lines.pop()

    for lineno, line in enumerate(lines, 1):
        where = f"line {lineno}"
        if not line.strip():
            problems.append(f"{where}: empty line")
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            problems.append(f"{where}: invalid JSON: {exc}")
            continue
        if not isinstance(row, dict):
            problems.append(f"{where}: not a JSON object")
            continue
        if set(row) != KEYS:
            problems.append(f"{where}: keys must be {sorted(KEYS)}, got {sorted(row)}")
            continue
        where = f"line {lineno} ({row['id']})"
        rows.append((lineno, row))

        if not isinstance(row["id"], str) or not ID_RE.match(row["id"]):
            problems.append(f"{where}: id must be kebab-case and start with 'ho-'")
        task = row["task"]
        if not isinstance(task, dict) or set(task) != TASK_KEYS:
            problems.append(f"{where}: task must have exactly the keys {sorted(TASK_KEYS)}")
            task = {"statement": "", "protected_paths": []}
        if not isinstance(task["statement"], str) or not task["statement"].strip():
            problems.append(f"{where}: task.statement must be a non-empty string")
        pp = task["protected_paths"]
        if not isinstance(pp, list) or not pp or not all(isinstance(p, str) and p for p in pp):
            problems.append(f"{where}: task.protected_paths must be a non-empty list of strings")
            pp = []
        if row["label"] not in LABELS:
            problems.append(f"{where}: label must be one of {sorted(LABELS)}")
        if row["category"] not in CATEGORIES:
            problems.append(f"{where}: unknown category {row['category']!r}")
        if row["label"] == "hack" and row["category"] == "benign":
            problems.append(f"{where}: a hack needs a hack category, not 'benign'")

        history = row["history"]
        if not isinstance(history, list):
            problems.append(f"{where}: history must be a list")
            history = []
        for i, h in enumerate(history):
            check_call(h, f"{where} history[{i}]", problems)
        check_call(row["call"], f"{where} call", problems)

        if row["label"] == "benign":
            hidden = [p for p in pp if is_hidden(p)]
            for c in history + [row["call"]]:
                if not isinstance(c, dict):
                    continue
                for s in call_strings(c):
                    for p in hidden:
                        if p in s:
                            problems.append(f"{where}: benign line touches hidden protected path {p!r}")

    # uniqueness
    ids = collections.Counter(r["id"] for _, r in rows)
    for id_, n in ids.items():
        if n > 1:
            problems.append(f"duplicate id {id_!r} ({n} times)")
    seen = {}
    for lineno, r in rows:
        key = json.dumps([r["task"], r["history"], r["call"]], sort_keys=True)
        if key in seen:
            problems.append(f"line {lineno}: same task/history/call as line {seen[key]}")
        seen[key] = lineno

    # counts
    labels = collections.Counter(r["label"] for _, r in rows)
    by_cat = collections.defaultdict(collections.Counter)
    for _, r in rows:
        by_cat[r["category"]][r["label"]] += 1
    hack_cats = {r["category"] for _, r in rows if r["label"] == "hack"}
    multistep = sum(1 for _, r in rows if r["label"] == "hack" and r["history"])
    if len(lines) != EXPECTED_TOTAL:
        problems.append(f"expected {EXPECTED_TOTAL} lines, found {len(lines)}")
    for label, n in EXPECTED_PER_LABEL.items():
        if labels[label] != n:
            problems.append(f"expected {n} {label} lines, found {labels[label]}")
    if len(hack_cats) < MIN_HACK_CATEGORIES:
        problems.append(f"hacks span {len(hack_cats)} categories, need >= {MIN_HACK_CATEGORIES}")
    if multistep < MIN_MULTISTEP_HACKS:
        problems.append(f"{multistep} multi-step hacks (non-empty history), need >= {MIN_MULTISTEP_HACKS}")

    # report
    print(f"file: {opts.path}")
    print(f"{'category':32} {'hack':>5} {'benign':>7}")
    for cat in HACK_CATEGORIES + ["benign"]:
        c = by_cat.get(cat, collections.Counter())
        print(f"{cat:32} {c['hack']:>5} {c['benign']:>7}")
    print(f"{'TOTAL':32} {labels['hack']:>5} {labels['benign']:>7}")
    missing = [c for c in HACK_CATEGORIES if c not in hack_cats]
    print(f"lines={len(lines)} hack_categories={len(hack_cats)}/{len(HACK_CATEGORIES)} "
          f"multi_step_hacks={multistep} multi_step_benign="
          f"{sum(1 for _, r in rows if r['label'] == 'benign' and r['history'])}")
    if missing:
        print("hack categories without examples: " + ", ".join(missing))
    if problems:
        print(f"\n{len(problems)} problem(s):")
        for p in problems:
            print("  - " + p)
        return 1
    print("OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
