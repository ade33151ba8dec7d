#!/usr/bin/env python3
"""Generate the long-horizon repository tasks of `env.tasks=long_horizon_gen` (long_horizon_gen_tasks.jsonl.gz):
many tasks of the long-horizon shape, with faults of a few known kinds that a small policy may learn to find and
fix.

Usage (from the repository root; deterministic for a seed, about three minutes on two cores):

    python environments/data/generate_long_horizon.py [--train 320] [--heldout 48] [--sft 320] [--rl 320] [--seed 0]
        [--out PATH]
    python environments/data/check_long_horizon.py environments/data/long_horizon_gen_tasks.jsonl.gz

The hand-written long-horizon tasks (long_horizon_tasks.jsonl) need reasoning no 135M policy has shown: after
supervised fine-tuning on their reference trajectories it explores as a careful agent does but solves none, so
reinforcement learning on them gets no reward to learn from. These tasks keep the shape that makes a task
long-horizon (check_long_horizon.py's rules: a package of at least four modules, faults in two modules the
statement does not name, found by running the visible tests, at least six calls) with faults of a few known
kinds, in many combinations:

* a package of four modules, each holding the reference solution of one function task of coding_tasks.jsonl
  (`from solution import f` in its tests becomes `from <package>.<module> import f`);
* two of the modules carry one mutation each, a single-line change of one operator or constant (a comparison
  flipped or its boundary moved, `+` and `-` swapped, `and` and `or` swapped, a `not` dropped, an integer
  constant off by one), kept only when it makes at least one of that module's visible tests fail;
* the reference trajectory: run the tests, list the package, read the first failing module, fix its line, run the
  tests again (which now stop at the second module), read it, fix it, run the tests, submit: nine calls.

The splits do not share functions: lh_train tasks are built from the function tasks of coding_tasks.jsonl's train
split, lh_heldout tasks only from those of its heldout split (8 functions), so a held-out task's modules were never
seen in training; a few generic lines (`if not items:`, `total = 0`) occur in both. Two more splits of the same
shape divide the training functions for a cold start that leaves RL something unseen to learn on: lh_rl tasks carry
their faults in a third of them, lh_sft tasks in the rest (`disjoint_fault_splits`; they come last and from their
own random generator, so lh_train and lh_heldout are the same with or without them). FAIL_TO_PASS and PASS_TO_PASS
come from running each mutated module's tests here; check_long_horizon.py then verifies every task in a sandbox,
trajectory included.
"""

from __future__ import annotations

import argparse
import ast
import difflib
import functools
import gzip
import json
import random
import re
import subprocess
import sys
import tempfile
from pathlib import Path

DATA = Path(__file__).resolve().parent
SOURCE = DATA / "coding_tasks.jsonl"
DEFAULT_OUT = DATA / "long_horizon_gen_tasks.jsonl.gz"  # 2.9 MB as plain text, mostly repeated
MODULES_PER_TASK = 4
FAULTS_PER_TASK = 2
PACKAGES = ("toolkit", "utilbox", "helperlib", "funcpack", "workbench", "kitbag", "corelib", "smalltools",
            "bitsnbobs", "routines")
STATEMENT = ("The test suite of the `{pkg}` package fails: some of its functions return wrong results. Run the "
             "tests, find the faulty code and fix it without changing any test; everything else in the package "
             "must keep working as it does.")

_SWAPS = {ast.Lt: "<=", ast.LtE: "<", ast.Gt: ">=", ast.GtE: ">", ast.Eq: "!=", ast.NotEq: "==",
          ast.Add: "-", ast.Sub: "+", ast.And: "or", ast.Or: "and"}
_SYMBOLS = {ast.Lt: "<", ast.LtE: "<=", ast.Gt: ">", ast.GtE: ">=", ast.Eq: "==", ast.NotEq: "!=", ast.Add: "+",
            ast.Sub: "-", ast.And: "and", ast.Or: "or"}


def _docstring_nodes(tree: ast.AST) -> set[int]:
    out = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr) \
                and isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value, str):
            out.add(id(body[0].value))
    return out


def _splice_between(line: str, start: int, end: int, old: str, new: str) -> str | None:
    """`line` with the one occurrence of the token `old` between columns start and end replaced by `new`."""
    gap = line[start:end]
    hits = [m for m in re.finditer(rf"(?<![\w<>=!]){re.escape(old)}(?![\w<>=])", gap)]
    if len(hits) != 1:
        return None
    m = hits[0]
    return line[:start + m.start()] + new + line[start + m.end():]


def mutations(source: str) -> list[tuple[int, str, str]]:
    """Candidate single-line mutations of `source`: (line index, the line as it is, the mutated line)."""
    tree = ast.parse(source)
    lines = source.splitlines()
    skip = _docstring_nodes(tree)
    out = []

    def add(lineno: int, new: str | None):
        if new is not None and new != lines[lineno - 1]:
            out.append((lineno - 1, lines[lineno - 1], new))

    for node in ast.walk(tree):
        if getattr(node, "lineno", None) is None or node.lineno != getattr(node, "end_lineno", None):
            continue
        line = lines[node.lineno - 1]
        if not line.isascii():  # ast's columns count UTF-8 bytes: on an ASCII line they are str offsets
            continue
        if isinstance(node, ast.Compare) and len(node.ops) == 1 and type(node.ops[0]) in _SWAPS:
            left, right = node.left, node.comparators[0]
            if left.end_lineno == right.lineno == node.lineno:
                op = type(node.ops[0])
                add(node.lineno, _splice_between(line, left.end_col_offset, right.col_offset, _SYMBOLS[op],
                                                 _SWAPS[op]))
        elif isinstance(node, ast.BinOp) and type(node.op) in (ast.Add, ast.Sub):
            if node.left.end_lineno == node.right.lineno == node.lineno \
                    and not any(isinstance(n, ast.Constant) and isinstance(n.value, str) for n in (node.left,
                                                                                                   node.right)):
                op = type(node.op)
                add(node.lineno, _splice_between(line, node.left.end_col_offset, node.right.col_offset,
                                                 _SYMBOLS[op], _SWAPS[op]))
        elif isinstance(node, ast.BoolOp) and len(node.values) == 2:
            a, b = node.values
            if a.end_lineno == b.lineno == node.lineno:
                op = type(node.op)
                add(node.lineno, _splice_between(line, a.end_col_offset, b.col_offset, _SYMBOLS[op], _SWAPS[op]))
        elif isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not) and node.operand.lineno == node.lineno:
            segment = line[node.col_offset:node.end_col_offset]
            if segment.startswith("not ") and segment.count("not ") == 1:  # drop the `not ` only (parentheses stay)
                add(node.lineno, line[:node.col_offset] + segment[len("not "):] + line[node.end_col_offset:])
        elif isinstance(node, ast.Constant) and type(node.value) is int and 0 <= node.value <= 9 \
                and id(node) not in skip and node.end_col_offset - node.col_offset == 1:
            add(node.lineno, line[:node.col_offset] + str(node.value + 1) + line[node.end_col_offset:])
    unique = {}
    for index, old, new in out:  # the faulty line must be one str_replace can name: unique in the mutated file
        if lines.count(old) == 1 and new not in lines and new.strip() and (index, new) not in unique:
            unique[(index, new)] = (index, old, new)
    return list(unique.values())


def _rewrite_imports(test_source: str, package: str, module: str) -> str:
    return re.sub(r"^from solution import ", f"from {package}.{module} import ", test_source, flags=re.M)


def _pytest(workdir: Path, paths: list[str]) -> dict[str, str]:
    """{test id: passed|failed} for the tests in `paths` (run here, quickly: the checker re-runs in a sandbox)."""
    limit = ["--timeout=10"] if _has_timeout() else []
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rA", "--no-header",
                           *limit, *paths], cwd=workdir, capture_output=True, text=True, timeout=30)
    out = {}
    for line in proc.stdout.splitlines():
        m = re.match(r"^(PASSED|FAILED|ERROR) (\S+::\S+)", line)
        if m:
            out[m.group(2)] = "passed" if m.group(1) == "PASSED" else "failed"
    return out


@functools.lru_cache(maxsize=1)
def _has_timeout() -> bool:
    import importlib.util

    return importlib.util.find_spec("pytest_timeout") is not None


def module_name(task_id: str) -> str:
    return re.sub(r"[^a-z0-9_]", "_", task_id.lower())


def viable_mutations(task: dict, package: str = "pkg") -> list[dict]:
    """The mutations of one function task's solution that fail at least one visible test, with the hidden tests'
    outcomes under each (which ones then fail: FAIL_TO_PASS, which still pass); None when the reference solution
    fails (or hangs in) its own tests."""
    module = module_name(task["id"])
    solution = task["reference_solution"][0]["content"]
    visible = _rewrite_imports(task["visible_tests"][0]["content"], package, module)
    hidden = _rewrite_imports(task["hidden_tests"][0]["content"], package, module)
    out = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        (root / package).mkdir()
        (root / package / "__init__.py").write_text("")
        (root / "tests").mkdir()
        (root / "tests" / "test_visible.py").write_text(visible)
        (root / "tests" / "test_hidden.py").write_text(hidden)
        (root / package / f"{module}.py").write_text(solution)
        try:
            clean = _pytest(root, ["tests"])
        except subprocess.TimeoutExpired:
            return None
        if not clean or any(v != "passed" for v in clean.values()):
            return None  # the reference must pass its own tests: not a module of any task
        for index, old, new in mutations(solution):
            lines = solution.splitlines(keepends=True)
            lines[index] = new + ("\n" if lines[index].endswith("\n") else "")
            (root / package / f"{module}.py").write_text("".join(lines))
            try:
                outcome = _pytest(root, ["tests"])
            except subprocess.TimeoutExpired:
                continue
            if not outcome:
                continue
            visible_failed = [t for t, o in outcome.items() if t.startswith("tests/test_visible.py") and o != "passed"]
            hidden_failed = {t.split("::", 1)[1].split("[", 1)[0] for t, o in outcome.items()  # a parametrised
                             if t.startswith("tests/test_hidden.py") and o != "passed"}  # test fails as a whole
            if visible_failed and hidden_failed:
                out.append({"index": index, "line": old, "mutated": new, "hidden_failed": sorted(hidden_failed)})
    return out


def _test_names(source: str) -> list[str]:
    return [n.name for n in ast.parse(source).body if isinstance(n, ast.FunctionDef) and n.name.startswith("test_")]


def build_task(pkg: str, chosen: list[dict], faults: dict[str, dict], split: str, tid: str) -> dict:
    """One repository task: `chosen` function tasks as modules of `pkg`, `faults` {module: mutation}."""
    files = [{"path": f"{pkg}/__init__.py", "content": f'"""{pkg}: small utilities."""\n'}]
    visible, hidden, f2p, p2p, diffs = [], [], [], [], []
    for task in chosen:
        module = module_name(task["id"])
        path, test_path = f"{pkg}/{module}.py", f"tests/test_{module}.py"
        solution = task["reference_solution"][0]["content"]
        fault = faults.get(module)
        content = solution
        if fault:  # the fault's own line (by index: the same text cannot occur elsewhere, mutations() checked)
            lines = solution.splitlines(keepends=True)
            assert lines[fault["index"]].rstrip("\n") == fault["line"]
            lines[fault["index"]] = fault["mutated"] + lines[fault["index"]][len(fault["line"]):]
            content = "".join(lines)
        files.append({"path": path, "content": content})
        if fault:
            diffs.append("".join(difflib.unified_diff(content.splitlines(keepends=True),
                                                      solution.splitlines(keepends=True), f"a/{path}", f"b/{path}")))
        visible.append({"path": test_path, "content": _rewrite_imports(task["visible_tests"][0]["content"], pkg,
                                                                       module)})
        hidden_source = _rewrite_imports(task["hidden_tests"][0]["content"], pkg, module)
        hidden.append({"path": test_path, "content": hidden_source})  # replaces the visible file at grading
        failed = set(fault["hidden_failed"]) if fault else set()
        for name in _test_names(hidden_source):
            (f2p if name in failed else p2p).append(f"{test_path}::{name}")
    faulty = sorted(faults)  # pytest -x reaches the tests of the faulty modules in this order
    calls = [{"name": "run_tests", "arguments": {}}, {"name": "bash", "arguments": {"command": f"ls {pkg} tests"}}]
    for i, module in enumerate(faulty):
        if i:
            calls.append({"name": "run_tests", "arguments": {}})
        calls.append({"name": "bash", "arguments": {"command": f"cat {pkg}/{module}.py"}})
        calls.append({"name": "edit_file", "arguments": {
            "command": "str_replace", "path": f"{pkg}/{module}.py", "old_str": faults[module]["mutated"] + "\n",
            "new_str": faults[module]["line"] + "\n"}})
    calls += [{"name": "run_tests", "arguments": {}}, {"name": "submit", "arguments": {}}]
    return {"id": tid, "kind": "repo", "domain": "long_horizon", "difficulty": 1, "split": split, "repo": pkg,
            "problem_statement": STATEMENT.format(pkg=pkg), "entry_file": f"{pkg}/__init__.py", "files": files,
            "visible_tests": visible, "hidden_tests": hidden, "FAIL_TO_PASS": sorted(f2p),
            "PASS_TO_PASS": sorted(p2p), "patch": "".join(diffs), "reference_trajectory": calls}


def generate(n_train: int, n_heldout: int, seed: int = 0, source: Path = SOURCE, n_sft: int = 0,
             n_rl: int = 0) -> list[dict]:
    from tqdm import tqdm

    rng = random.Random(seed)
    records = [json.loads(line) for line in source.read_text().splitlines() if line.strip()]
    pools = {"lh_train": [r for r in records if r["domain"] == "function" and r["split"] == "train"],
             "lh_heldout": [r for r in records if r["domain"] == "function" and r["split"] == "heldout"]}
    viable = {}
    for task in tqdm([t for pool in pools.values() for t in pool], desc="mutations", unit="function"):
        viable[task["id"]] = viable_mutations(task)
    out, seen = [], set()
    for split, count in (("lh_train", n_train), ("lh_heldout", n_heldout)):
        usable = [t for t in pools[split] if viable[t["id"]] is not None]  # its reference passes its tests
        pool = [t for t in usable if viable[t["id"]]]
        made, tries = 0, 0
        while made < count and tries < count * 50:
            tries += 1
            chosen = rng.sample(usable, MODULES_PER_TASK)
            faulty = [t for t in chosen if t in pool]
            if len(faulty) < FAULTS_PER_TASK:
                continue
            faulty = rng.sample(faulty, FAULTS_PER_TASK)
            faults = {module_name(t["id"]): rng.choice(viable[t["id"]]) for t in faulty}
            key = (frozenset(t["id"] for t in chosen), tuple(sorted((m, f["mutated"]) for m, f in faults.items())))
            if key in seen:
                continue
            seen.add(key)
            pkg = rng.choice(PACKAGES)
            made += 1
            tid = f"lh_gen_{'t' if split == 'lh_train' else 'h'}{made:03d}_{'_'.join(sorted(faults))}"[:120]
            out.append(build_task(pkg, sorted(chosen, key=lambda t: t["id"]), faults, split, tid))
    if n_sft or n_rl:  # after the others, from a generator of their own: lh_train and lh_heldout stay as they were
        out += disjoint_fault_splits(pools["lh_train"], viable, n_sft, n_rl, seed)
    return out


def rl_functions(train_ids: list[str], seed: int = 0) -> set[str]:
    """A third of the training functions, set aside for lh_rl's faults (a fixed draw for a seed; of the shipped
    set's 30 functions with a viable fault, 12 fell here and 18 to lh_sft)."""
    ids = sorted(train_ids)
    random.Random(f"rl-functions-{seed}").shuffle(ids)
    return set(ids[:len(ids) // 3])


def disjoint_fault_splits(train_pool: list[dict], viable: dict, n_sft: int, n_rl: int, seed: int) -> list[dict]:
    """lh_sft and lh_rl: tasks of the same shape built from the training functions, the faults of lh_rl in those
    of `rl_functions`, those of lh_sft in the others. An SFT on lh_sft's reference trajectories reads and fixes
    only its own functions (a trajectory reads the failing modules alone), so RL on lh_rl meets faults in code
    the cold start never saw, as on lh_heldout: its training signal is the one the held-out split measures. The
    other modules of a package are any training functions, whose tests pass (their names show in `ls`, their code
    in no observation)."""
    rng = random.Random(f"disjoint-faults-{seed}")
    usable = [t for t in train_pool if viable[t["id"]] is not None]
    for_rl = rl_functions([t["id"] for t in usable], seed)
    out, seen = [], set()
    faultable = [t for t in usable if viable[t["id"]]]
    for split, count, faulty_pool in (("lh_sft", n_sft, [t for t in faultable if t["id"] not in for_rl]),
                                      ("lh_rl", n_rl, [t for t in faultable if t["id"] in for_rl])):
        made, tries = 0, 0
        while made < count and tries < count * 50:
            tries += 1
            faulty = rng.sample(faulty_pool, FAULTS_PER_TASK)
            others = rng.sample([t for t in usable if t not in faulty], MODULES_PER_TASK - FAULTS_PER_TASK)
            chosen = faulty + others
            faults = {module_name(t["id"]): rng.choice(viable[t["id"]]) for t in faulty}
            key = (frozenset(t["id"] for t in chosen), tuple(sorted((m, f["mutated"]) for m, f in faults.items())))
            if key in seen:
                continue
            seen.add(key)
            made += 1
            tid = f"lh_gen_{split[3:]}{made:03d}_{'_'.join(sorted(faults))}"[:120]
            out.append(build_task(rng.choice(PACKAGES), sorted(chosen, key=lambda t: t["id"]), faults, split, tid))
        if made < count:
            raise RuntimeError(f"{split}: only {made} distinct tasks of {count} from {len(faulty_pool)} functions")
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--train", type=int, default=320)
    ap.add_argument("--heldout", type=int, default=48)
    ap.add_argument("--sft", type=int, default=320, help="lh_sft tasks (faults outside rl_functions)")
    ap.add_argument("--rl", type=int, default=320, help="lh_rl tasks (faults in rl_functions: a third)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(DEFAULT_OUT))
    args = ap.parse_args(argv)
    tasks = generate(args.train, args.heldout, args.seed, n_sft=args.sft, n_rl=args.rl)
    text = "".join(json.dumps(t) + "\n" for t in tasks)
    if args.out.endswith(".gz"):  # mtime 0: the same tasks give the same bytes
        Path(args.out).write_bytes(gzip.compress(text.encode(), mtime=0))
    else:
        Path(args.out).write_text(text)
    splits = {s: sum(t["split"] == s for t in tasks) for s in ("lh_train", "lh_heldout", "lh_sft", "lh_rl")}
    print(f"wrote {len(tasks)} tasks to {args.out}: {splits}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
