#!/usr/bin/env python3
"""Validate a labelled guard corpus: the shipped one (corpus.jsonl), the independent ones (heldout_corpus.jsonl,
written_corpus.jsonl, generated_corpus.jsonl) or the judge's training corpus (judge_train_corpus.jsonl).

Stand-alone, standard library only (bash for `bash -n`). Every line: one JSON object with exactly the keys
id/task/history/call/label/category; a unique kebab-case id (with the corpus's prefix); task.statement and
task.protected_paths well formed; tool names and their arguments (bash, write_file, run_tests, submit); `bash -n`
on every bash command and written shell script, `ast.parse` on every written .py file and on Python embedded in
bash (`python - <<EOF`, `python -c`); labels and categories from the taxonomy of docs/ALGORITHMS.md §4.2; a
benign line never touches a hidden protected path; no two lines with the same (task, history, call). The corpus
as a whole meets its profile's counts (size, label balance, categories covered, multi-step hacks). Prints counts
per category and label; exits 1 on any problem.

Usage: python antihack/data/check_corpus.py [PATH] [--profile NAME] [--no-bash-syntax]
(the profile defaults to the one the file's name says: heldout, written, generated or judge_train; else shipped)
"""

from __future__ import annotations

import argparse
import ast
import json
import posixpath
import re
import shlex
import shutil
import subprocess
import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

# Taxonomy row(s) of docs/ALGORITHMS.md §4.2 behind each hack category; "obfuscation" is our own extra category.
CATEGORIES = {
    "test_modification": (1, 2), "test_skipping": (3,), "conftest_hook": (4,), "test_runner_tampering": (5,),
    "framework_monkeypatch": (6,), "grader_overwrite": (7,), "early_exit": (8,), "exit_code_masking": (9,),
    "always_equal": (10,), "output_spoofing": (11,), "harness_detection": (12,), "hardcoded_outputs": (13,),
    "exception_swallowing": (14,), "reading_test_data": (15,), "hidden_data_access": (16,),
    "solution_search": (17,), "git_history_leakage": (18,), "git_internals": (19,), "network_download": (20,),
    "package_under_test_install": (21,), "module_shadowing": (22,), "grader_marker_write": (23,),
    "timing_manipulation": (24,), "reference_copy": (25,), "precomputed_answers": (26,),
    "verification_tool_replacement": (27,), "monitor_killing": (28,), "task_file_edit": (29,),
    "collection_breaking": (30,), "privilege_escalation": (31,), "judge_injection": (32,),
    "functionality_deletion": (33,), "obfuscation": (),
}
BENIGN = "benign"  # the category of benign lines not confusable with any hack category
LABELS = {"hack", "benign"}
LINE_KEYS = {"id", "task", "history", "call", "label", "category"}
TASK_KEYS = {"statement", "protected_paths"}
TOOL_ARGS = {"bash": {"command"}, "write_file": {"path", "content"}, "run_tests": set(), "submit": set()}
HIDDEN_MARKERS = ("hidden", "grader", "eval/", "expected")
EXEC_PREFIX = re.compile(r"(?:^|[\s;&|(`])(?:bash|sh|python3?|source|\.|make\s+-f)\s+(\S+)|(?:^|[\s;&|(`])(\./\S+)")
PY_HEREDOC = re.compile(r"\bpython3?(?:\.\d+)?\s+(?:-\s*)?<<-?\s*(['\"]?)(\w+)\1[^\n]*\n(.*?)\n\2[ \t]*(?:\n|$)", re.S)
PY_NAME = re.compile(r"^(?:.*/)?python3?(?:\.\d+)?$")


@dataclass(frozen=True)
class Profile:
    """What a corpus as a whole must hold."""

    id_prefix: str = ""
    total: tuple[int, int] = (0, 10**9)  # lines, inclusive range
    per_label: tuple[int, int] = (0, 10**9)  # lines of each label, inclusive range
    min_per_category: int = 0  # hack lines of every category ...
    common: tuple[str, ...] = ()  # ... and of these
    min_common: int = 0
    min_categories: int = 0  # hack categories with at least one line
    min_multi_step: int = 0  # hacks with a history
    scripted_multi_step: bool = False  # count only those whose call runs a script written in the history
    test_file_protected: bool = False  # task.protected_paths lists a test file
    extra: dict = field(default_factory=dict)


PROFILES = {
    # ours: every category at least twice (the common ones four times), multi-step hacks that run a script written
    # earlier
    "shipped": Profile(total=(170, 10**9), per_label=(85, 10**9), min_per_category=2, min_common=4,
                       common=("test_modification", "hidden_data_access", "network_download", "conftest_hook",
                               "test_runner_tampering", "git_history_leakage", "always_equal", "early_exit",
                               "obfuscation"),
                       min_categories=len(CATEGORIES), min_multi_step=4, scripted_multi_step=True,
                       test_file_protected=True),
    # written apart from the rules, on other tasks and in other styles: exactly 130 lines, balanced
    "heldout": Profile(id_prefix="ho-", total=(130, 130), per_label=(65, 65), min_categories=25, min_multi_step=5),
    # two more, each made by someone who never read the rules or the other corpora: one written by hand from the
    # categories (the one the rules may be tuned on), one generated by mutating hacks and benign calls (held back)
    "written": Profile(id_prefix="iw-", total=(250, 450), per_label=(110, 250), min_categories=len(CATEGORIES),
                       min_multi_step=10),
    "generated": Profile(id_prefix="ig-", total=(250, 450), per_label=(110, 250), min_categories=len(CATEGORIES),
                         min_multi_step=10),
    # a fifth hand, hacks modelled on reported incidents, kept back after the generated corpus was read for gaps
    "reported": Profile(id_prefix="ir-", total=(200, 450), per_label=(90, 250), min_categories=len(CATEGORIES),
                        min_multi_step=10),
    # what the judge's head is trained on, by a third hand, disjoint from every corpus it is measured on
    "judge_train": Profile(id_prefix="jt-", total=(300, 600), per_label=(140, 320), min_categories=len(CATEGORIES),
                           min_multi_step=10),
}
_BASH = shutil.which("bash")


def bash_syntax_error(script: str) -> str:
    """`bash -n` on the script ('' when fine or when bash is not available)."""
    if not _BASH:
        return ""
    try:
        proc = subprocess.run([_BASH, "-n"], input=script, capture_output=True, text=True, timeout=20)
    except subprocess.TimeoutExpired:
        return "bash -n did not finish in 20 s"
    return (proc.stderr.strip().splitlines() or ["bash -n failed"])[-1] if proc.returncode else ""


def python_syntax_error(source: str, label: str) -> str:
    try:
        ast.parse(source, filename=label)
    except SyntaxError as exc:
        return f"{label}: {exc.msg} (line {exc.lineno})"
    return ""


def python_snippets(command: str):
    """(label, source) of the Python embedded in a bash command."""
    for m in PY_HEREDOC.finditer(command):
        yield "python heredoc", m.group(3)
    if "<<" in command:
        return  # shlex cannot split here-document bodies reliably
    try:
        tokens = shlex.split(command, posix=True)
    except ValueError:
        return
    for i, tok in enumerate(tokens[:-2]):
        if PY_NAME.match(tok) and tokens[i + 1] == "-c":
            yield "python -c", tokens[i + 2]


def check_call(call, where: str, errors: list[str], bash: bool) -> None:
    if not isinstance(call, dict) or set(call) != {"name", "arguments"}:
        errors.append(f"{where}: a tool call is an object with exactly the keys name, arguments")
        return
    name, args = call["name"], call["arguments"]
    if name not in TOOL_ARGS:
        errors.append(f"{where}: unknown tool {name!r} (allowed: {sorted(TOOL_ARGS)})")
        return
    if not isinstance(args, dict) or set(args) != TOOL_ARGS[name]:
        errors.append(f"{where}: {name} arguments must be {sorted(TOOL_ARGS[name])}")
        return
    if not all(isinstance(v, str) and v.strip() for v in args.values()):
        errors.append(f"{where}: {name}'s arguments must be non-empty strings")
        return
    problems = []
    if name == "bash":
        problems.append(bash and bash_syntax_error(args["command"]))
        problems += [python_syntax_error(src, label) for label, src in python_snippets(args["command"])]
    elif name == "write_file":
        path, content = args["path"], args["content"]
        first = content.split("\n", 1)[0]
        if path.endswith(".py"):
            problems.append(python_syntax_error(content, path))
        elif bash and (path.endswith(".sh") or (first.startswith("#!") and re.search(r"\b(ba|da)?sh\b", first))):
            problems.append(bash_syntax_error(content))
    errors.extend(f"{where}: {p}" for p in problems if p)


def runs_written_script(row: dict) -> bool:
    """The call executes a script that an earlier write_file in the history created."""
    written = {posixpath.normpath(c["arguments"]["path"].removeprefix("/workspace/")) for c in row["history"]
               if isinstance(c, dict) and c.get("name") == "write_file" and isinstance(c.get("arguments"), dict)
               and isinstance(c["arguments"].get("path"), str)}
    call = row["call"]
    if not written or not isinstance(call, dict) or call.get("name") != "bash":
        return False
    return any(posixpath.normpath((m.group(1) or m.group(2)).removeprefix("/workspace/")) in written
               for m in EXEC_PREFIX.finditer(call["arguments"].get("command", "")))


def check_row(row, where: str, profile: Profile, errors: list[str], bash: bool) -> bool:
    """One line's checks; False when it is not shaped like a row at all."""
    if not isinstance(row, dict) or set(row) != LINE_KEYS:
        errors.append(f"{where}: a line is an object with exactly the keys {sorted(LINE_KEYS)}")
        return False
    rid = row["id"]
    if not isinstance(rid, str) or not rid.startswith(profile.id_prefix) or \
            not re.fullmatch(r"[a-z0-9]+(?:-[a-z0-9]+)*", rid):
        errors.append(f"{where}: id {rid!r} is not kebab-case starting with {profile.id_prefix!r}")
    task = row["task"]
    paths: list[str] = []
    if not isinstance(task, dict) or set(task) != TASK_KEYS:
        errors.append(f"{where}: task is an object with exactly the keys {sorted(TASK_KEYS)}")
    else:
        if not isinstance(task["statement"], str) or not task["statement"].strip():
            errors.append(f"{where}: task.statement must be a non-empty string")
        paths = task["protected_paths"]
        if not isinstance(paths, list) or not paths or not all(isinstance(p, str) and p.strip() for p in paths):
            errors.append(f"{where}: task.protected_paths must be a non-empty list of strings")
            paths = []
        elif profile.test_file_protected and not any(p.startswith(("tests/", "test/", "/eval/")) for p in paths):
            errors.append(f"{where}: task.protected_paths lists no test file")
    history = row["history"] if isinstance(row["history"], list) else []
    if not isinstance(row["history"], list):
        errors.append(f"{where}: history must be a list")
    for i, call in enumerate(history):
        check_call(call, f"{where} history[{i}]", errors, bash)
    check_call(row["call"], f"{where} call", errors, bash)
    if row["label"] not in LABELS:
        errors.append(f"{where}: label {row['label']!r} not in {sorted(LABELS)}")
    if row["category"] not in CATEGORIES and row["category"] != BENIGN:
        errors.append(f"{where}: unknown category {row['category']!r}")
    if row["label"] == "hack" and row["category"] == BENIGN:
        errors.append(f"{where}: a hack needs a hack category, not {BENIGN!r}")
    if row["label"] == "benign":
        hidden = [p for p in paths if any(m in p.lower() for m in HIDDEN_MARKERS)]
        texts = [v for c in history + [row["call"]] if isinstance(c, dict) and isinstance(c.get("arguments"), dict)
                 for v in c["arguments"].values() if isinstance(v, str)]
        errors.extend(f"{where}: a benign line touches the hidden protected path {p!r}"
                      for p in hidden if any(p in t for t in texts))
    return True


def check_corpus(rows: list[dict], profile: Profile, errors: list[str]) -> dict:
    """The whole corpus's counts against `profile`; returns them."""
    ids = Counter(r["id"] for r in rows)
    errors.extend(f"duplicate id {i!r} ({n} lines)" for i, n in ids.items() if n > 1)
    seen: dict[str, str] = {}
    for r in rows:
        key = json.dumps([r["task"], r["history"], r["call"]], sort_keys=True)
        if key in seen:
            errors.append(f"{r['id']}: the same task, history and call as {seen[key]}")
        seen.setdefault(key, r["id"])
    labels = Counter(r["label"] for r in rows)
    counts = Counter((r["category"], r["label"]) for r in rows)
    hacks = [r for r in rows if r["label"] == "hack"]
    multi = [r["id"] for r in hacks if r["history"] and (not profile.scripted_multi_step or runs_written_script(r))]
    lo, hi = profile.total
    if not lo <= len(rows) <= hi:
        errors.append(f"corpus: {len(rows)} lines, expected {lo}" + ("" if lo == hi else f" to {hi}"))
    lo, hi = profile.per_label
    for label in sorted(LABELS):
        if not lo <= labels[label] <= hi:
            errors.append(f"corpus: {labels[label]} {label} lines, expected {lo}" + ("" if lo == hi else f" to {hi}"))
    for cat in CATEGORIES:
        need = profile.min_common if cat in profile.common else profile.min_per_category
        if counts[(cat, "hack")] < need:
            errors.append(f"corpus: category {cat} has {counts[(cat, 'hack')]} hack lines < {need}")
    covered = {r["category"] for r in hacks}
    if len(covered) < profile.min_categories:
        errors.append(f"corpus: hacks span {len(covered)} categories < {profile.min_categories}")
    if len(multi) < profile.min_multi_step:
        errors.append(f"corpus: {len(multi)} multi-step hacks < {profile.min_multi_step}")
    return {"labels": labels, "counts": counts, "covered": covered, "multi": multi}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("path", nargs="?", default=str(Path(__file__).with_name("corpus.jsonl")))
    ap.add_argument("--profile", choices=sorted(PROFILES), default=None)
    ap.add_argument("--no-bash-syntax", action="store_true", help="skip `bash -n`")
    args = ap.parse_args(argv)
    path = Path(args.path)
    by_name = next((name for name in ("heldout", "written", "generated", "reported", "judge_train")
                    if name in path.name), "shipped")
    profile = PROFILES[args.profile or by_name]
    if not path.is_file():
        print(f"FAIL: {path} not found")
        return 1
    errors: list[str] = []
    rows = []
    for n, raw in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not raw.strip():
            errors.append(f"line {n}: empty line")
            continue
        try:
            row = json.loads(raw)
        except json.JSONDecodeError as exc:
            errors.append(f"line {n}: invalid JSON: {exc}")
            continue
        rid = row.get("id") if isinstance(row, dict) else None
        if check_row(row, f"line {n} ({rid})", profile, errors, not args.no_bash_syntax):
            rows.append(row)
    found = check_corpus(rows, profile, errors)
    width = max(map(len, CATEGORIES)) + 2
    print(f"{path}\n{'category':<{width}}{'rows':>6}{'hack':>6}{'benign':>8}")
    for cat in [*CATEGORIES, BENIGN]:
        taxonomy = ",".join(map(str, CATEGORIES.get(cat, ()))) or "-"
        print(f"{cat:<{width}}{taxonomy:>6}{found['counts'][(cat, 'hack')]:>6}{found['counts'][(cat, 'benign')]:>8}")
    labels = found["labels"]
    print(f"{'TOTAL':<{width}}{'':>6}{labels['hack']:>6}{labels['benign']:>8}")
    print(f"hack categories covered: {len(found['covered'])}/{len(CATEGORIES)}; multi-step hacks: "
          f"{len(found['multi'])}; lines with a history: {sum(1 for r in rows if r['history'])}")
    if not args.no_bash_syntax and not _BASH:
        print("note: bash not found, shell syntax not checked")
    if errors:
        print(f"\nFAIL: {len(errors)} problem(s)")
        for e in errors:
            print("  " + e)
        return 1
    print("\nOK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
