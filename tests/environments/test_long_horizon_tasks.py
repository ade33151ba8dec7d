"""The long-horizon task set (environments/data/long_horizon_tasks.jsonl) and its checker."""

import json
import os

import pytest

from environments import load_tasks
from environments.data.check_long_horizon import DEFAULT_TASKS, main as check
from rollout.agent import task_message

TASKS = str(DEFAULT_TASKS)


@pytest.fixture(scope="module")
def records() -> list[dict]:
    return [json.loads(line) for line in open(TASKS, encoding="utf-8")]


def test_the_set_loads_as_repository_tasks_with_their_trajectories():
    task_set = load_tasks(TASKS)
    assert task_set.skipped == []
    train, held = task_set.split("lh_train"), task_set.split("lh_heldout")
    assert len(train) + len(held) >= 60 and len(held) >= 15
    assert all(t.is_repo and t.domain == "long_horizon" for t in task_set.tasks)
    assert all(len(t.metadata["reference_trajectory"]) >= 6 for t in task_set.tasks)
    assert {t.difficulty for t in task_set.tasks} == {1, 2, 3}


def test_every_task_passes_the_static_checks(capsys):
    assert check([TASKS, "--no-run"]) == 0, capsys.readouterr().out[-3000:]


def _write(tmp_path, rows) -> str:
    path = tmp_path / "tasks.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_the_checker_refuses_tasks_that_do_not_need_looking_around(tmp_path, records, capsys):
    good = records[0]
    changed = [p for p in good["patch"].split("+++ b/")[1:]][0].split("\n")[0]
    named = {**good, "id": "lh_named", "problem_statement": good["problem_statement"] + f" The bug is in {changed}."}
    calls = good["reference_trajectory"]
    first_edit = next(i for i, c in enumerate(calls) if c["name"] in ("edit_file", "write_file")
                      and c["arguments"].get("command") != "view")
    hasty = {**good, "id": "lh_hasty", "reference_trajectory": [c for c in calls[:first_edit]
                                                               if c["name"] != "run_tests"] + calls[first_edit:]}
    unsolved = {**good, "id": "lh_unsolved", "reference_trajectory": calls[:first_edit] + [calls[-1]] * 6}
    entry = {**good, "id": "lh_entry", "entry_file": changed}
    assert check([_write(tmp_path, [named, hasty, unsolved, entry]), "--part"]) == 1
    out = capsys.readouterr().out
    assert "lh_named: the problem statement names" in out
    assert "lh_hasty: reference_trajectory must run the visible tests before its first change" in out
    assert "lh_unsolved: reference_trajectory changes no file" in out
    assert "lh_entry: entry_file" in out


def test_a_trajectory_that_stops_short_is_caught_when_played(tmp_path, records, capsys):
    good = records[0]
    calls = good["reference_trajectory"]
    edits = [i for i, c in enumerate(calls) if c["name"] in ("edit_file", "write_file")
             and c["arguments"].get("command") != "view"]
    short = {**good, "id": "lh_short", "reference_trajectory": calls[:edits[0] + 1] + [calls[-1]]}
    assert check([_write(tmp_path, [short]), "--part"]) == 1
    assert "lh_short: the workspace the trajectory leaves fails" in capsys.readouterr().out


@pytest.mark.slow  # every held-out task and a quarter of the training split, two at a time: ~45 s
def test_reference_trajectories_solve_their_tasks_in_a_sandbox(records, capsys):
    chosen = [r["id"] for i, r in enumerate(records) if r["split"] == "lh_heldout" or i % 4 == 0
              or os.environ.get("RL_CHECK_ALL_TASKS")]
    assert check([TASKS, "--jobs", "2", "--only", *chosen]) == 0, capsys.readouterr().out[-3000:]


def test_long_horizon_prompts_list_the_files_instead_of_showing_them():
    task = min(load_tasks(TASKS).tasks, key=lambda t: sum(len(f.content) for f in t.files))
    assert task.files[1].content.strip() in task_message(task)  # short enough to be shown by default
    listed = task_message(task, files_in_prompt_chars=0)
    assert "Files: " in listed and task.files[1].content.strip() not in listed
