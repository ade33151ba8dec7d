"""Task datasets: JSONL / JSON / parquet files or a hub dataset, loaded through `datasets`.

A record that is not a valid task is reported with its index and the reason, and skipped: one bad row never
stops a run. `SHIPPED_TASKS` is the framework's own set (environments/data/coding_tasks.jsonl).
"""

from __future__ import annotations

import json
import logging
import posixpath
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from environments.types import Task, TaskFile

log = logging.getLogger(__name__)

SHIPPED_TASKS = str(Path(__file__).parent / "data" / "coding_tasks.jsonl")
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


def task_from_record(record: dict) -> Task:
    if not isinstance(record, dict):
        raise ValueError("record is not an object")
    for key in ("id", "statement"):
        if not isinstance(record.get(key), str) or not record[key].strip():
            raise ValueError(f"missing or empty {key!r}")
    files = {key: _files(record, key) for key in _FILE_LISTS}
    if not files["hidden_tests"]:
        raise ValueError("no hidden_tests: the task cannot be graded")
    known = {"id", "statement", "entry_file", "domain", "difficulty", "split", *_FILE_LISTS}
    return Task(
        id=record["id"], statement=record["statement"], files=files["files"],
        visible_tests=files["visible_tests"], hidden_tests=files["hidden_tests"],
        entry_file=_check_path(record.get("entry_file") or "solution.py"),
        domain=str(record.get("domain") or "default"), difficulty=int(record.get("difficulty") or 1),
        split=str(record.get("split") or "train"), reference_solution=files["reference_solution"],
        metadata={k: v for k, v in record.items() if k not in known},
    )


def _records(source: str):
    """Yield (index, record-or-error) from a local file or a hub dataset, through `datasets`."""
    import datasets

    path = Path(source)
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
