import json
import os
from concurrent.futures import ThreadPoolExecutor

import pytest

from environments import Task, TaskFile, grade, load_tasks
from environments.grading import expected_tests, parse_junit


def files_of(task: Task, solved: bool) -> dict[str, str]:
    files = {f.path: f.content for f in task.files}
    if solved:
        files.update({f.path: f.content for f in task.reference_solution})
    return files


def test_shipped_set_shape(shipped_tasks):
    tasks = shipped_tasks.tasks
    assert len(tasks) >= 100 and shipped_tasks.skipped == []
    assert len(shipped_tasks.split("heldout")) == 12  # the default eval split: CI time depends on it
    assert {t.domain for t in tasks} >= {"function", "bugfix", "repo"}
    assert sum(t.is_repo for t in tasks) >= 20
    assert {t.difficulty for t in tasks} == {1, 2, 3}
    assert all(t.hidden_tests and t.reference_solution for t in tasks)


def _check_reference_and_start(task):
    solved = grade(task, files_of(task, True))
    assert solved.reward == 1.0 and solved.all_passed, (task.id, solved.details)
    start = grade(task, files_of(task, False))
    assert start.reward < 1.0 and not start.all_passed, task.id


def _check_all(tasks):
    """Two tasks at a time: each grading is a sandboxed pytest run on one core, and the machine has two."""
    with ThreadPoolExecutor(2) as pool:
        list(pool.map(_check_reference_and_start, tasks))  # (the first failure is raised here)


def test_heldout_reference_solutions_grade_full_and_starts_do_not(shipped_tasks):
    _check_all(shipped_tasks.split("heldout"))


@pytest.mark.slow  # the 23 repository tasks, two sandboxed gradings each, two at a time: ~15 s
def test_every_repository_task_grades_full_solved_and_not_unsolved(shipped_tasks):
    _check_all([t for t in shipped_tasks.tasks if t.is_repo])


@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("RL_CHECK_ALL_TASKS"),
                    reason="the sweep of all 101 tasks (~2 min) runs with RL_CHECK_ALL_TASKS=1, and in "
                           "`python environments/data/check_tasks.py`; CI checks the held-out and repository tasks")
def test_every_reference_solution_grades_full_and_every_start_does_not(shipped_tasks):
    _check_all(shipped_tasks.tasks)


def test_bad_records_are_reported_and_skipped(tmp_path, shipped_tasks):
    good = json.loads(open(shipped_tasks_path()).readline())
    lines = [json.dumps(good), "{not json", json.dumps({"id": "x"}),
             json.dumps({**good, "id": "no_hidden", "hidden_tests": []}),
             json.dumps({**good, "id": "escape", "files": [{"path": "../etc/x", "content": ""}]}),
             json.dumps(good)]
    path = tmp_path / "tasks.jsonl"
    path.write_text("\n".join(lines) + "\n")
    result = load_tasks(str(path))
    assert [t.id for t in result.tasks] == [good["id"]]
    reasons = dict(result.skipped)
    assert set(reasons) == {1, 2, 3, 4, 5}
    assert "invalid JSON" in reasons[1] and "statement" in reasons[2] and "hidden_tests" in reasons[3]
    assert "leaves the workspace" in reasons[4] and "duplicate" in reasons[5]


def shipped_tasks_path():
    from environments import SHIPPED_TASKS

    return SHIPPED_TASKS


def test_official_tests_are_reapplied_and_missing_tests_fail(task_by_id):
    task = task_by_id["add_two_numbers"]
    # The agent rewrites the hidden test file to something trivially true: grading uses the official one.
    files = files_of(task, False)
    files["tests/test_hidden.py"] = "def test_add_small_numbers():\n    assert True\n"
    assert grade(task, files).reward == 0.0
    # Library code that exits 0 at import: tests never run, every expected test counts as failed.
    files = files_of(task, True)
    files["solution.py"] = "import os\nos._exit(0)\n"
    result = grade(task, files)
    assert result.reward == 0.0 and set(result.details["outcomes"].values()) == {"missing"}
    # Library code that skips the tests: skipped is not passed.
    files["solution.py"] = "import pytest\npytest.skip('no', allow_module_level=True)\n"
    assert grade(task, files).reward == 0.0


def test_partial_credit_and_binary(task_by_id):
    task = task_by_id["add_two_numbers"]
    files = files_of(task, False)
    files["solution.py"] = "def add(a, b):\n    return int(a) + int(b)\n"  # floats fail
    frac = grade(task, files)
    assert 0 < frac.reward < 1 and frac.passed + frac.failed == len(expected_tests(task.hidden_tests))
    assert grade(task, files, reward="binary").reward == 0.0


def test_parse_junit():
    xml = """<testsuites><testsuite>
      <testcase classname="tests.test_a" name="test_ok"/>
      <testcase classname="tests.test_a" name="test_bad"><failure message="x"/></testcase>
      <testcase classname="tests.test_a.TestK" name="test_m"/>
      <testcase classname="tests.test_a" name="test_p[1]"/>
      <testcase classname="tests.test_a" name="test_p[2]"><error message="y"/></testcase>
      <testcase classname="tests.test_a" name="test_s"><skipped/></testcase>
    </testsuite></testsuites>"""
    assert parse_junit(xml) == {"tests/test_a.py::test_ok": "passed", "tests/test_a.py::test_bad": "failed",
                                "tests/test_a.py::TestK::test_m": "passed", "tests/test_a.py::test_p": "failed",
                                "tests/test_a.py::test_s": "skipped"}
    src = TaskFile("tests/t.py", "def test_a():\n    pass\nclass TestB:\n    def test_c(self):\n        pass\n"
                                 "def helper():\n    pass\n")
    assert expected_tests([src]) == ["tests/t.py::test_a", "tests/t.py::TestB::test_c"]


HUMANEVAL_ROWS = [  # HumanEval's format (task_id, prompt, entry_point, canonical_solution, test), written here
    {"task_id": "HumanEval/900", "entry_point": "double_all",
     "prompt": "def double_all(xs):\n    \"\"\"Return every element of xs doubled.\n    >>> double_all([1, 2])\n"
               "    [2, 4]\n    \"\"\"\n",
     "canonical_solution": "    return [2 * x for x in xs]\n",
     "test": "def check(candidate):\n    assert candidate([1, 2]) == [2, 4]\n    assert candidate([]) == []\n"},
    {"task_id": "HumanEval/901", "entry_point": "decode",  # a helper defined in the prompt, used by the test
     "prompt": "def encode(s):\n    return s[::-1]\n\n\ndef decode(s):\n    \"\"\"Invert encode.\"\"\"\n",
     "canonical_solution": "    return s[::-1]\n",
     "test": "def check(candidate):\n    assert candidate(encode('abc')) == 'abc'\n"},
    {"task_id": "HumanEval/902", "entry_point": "no such name", "prompt": "x", "test": "y"},
]


def test_humaneval_format_rows_become_graded_tasks(tmp_path):
    path = tmp_path / "he.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in HUMANEVAL_ROWS) + "\n")
    task_set = load_tasks(str(path))
    assert [t.id for t in task_set.tasks] == ["HumanEval_900", "HumanEval_901"]
    assert len(task_set.skipped) == 1 and "entry_point" in task_set.skipped[0][1]
    for task in task_set.tasks:
        assert task.domain == "humaneval" and "raise NotImplementedError" in task.files[0].content
        solved = grade(task, files_of(task, True))
        assert solved.reward == 1.0 and solved.passed == 1, solved.details
        assert grade(task, files_of(task, False)).reward == 0.0


def test_task_validator_rejects_bad_imports_sleeps_and_unnamed_test_imports():
    """The dataset validator's static checks, for both task kinds: a shipped task passes, each bad edit is named."""
    import copy

    from environments.data.check_tasks import validate_repo_task, validate_task

    rows = {t["id"]: t for t in map(json.loads, open(shipped_tasks_path()))}

    def problems(task):
        errors = []
        (validate_repo_task if task["domain"] == "repo" else validate_task)(task, errors)
        return errors

    for tid, module in (("digit_sum", "solution.py"), ("repo_money_split_rounding", "money/money.py")):
        good = rows[tid]
        assert problems(good) == [], tid
        cases = {"forbidden import 'subprocess'": "import subprocess\n",
                 "non-stdlib import 'numpy'": "import numpy\n",
                 "uses random without a fixed seed": "import random\n",
                 "must not sleep": "import time\ntime.sleep(1)\n",
                 "syntax error": "def (:\n"}
        for message, prefix in cases.items():
            task = copy.deepcopy(good)
            source = next(f for f in task["files"] if f["path"] == module)
            source["content"] = prefix + source["content"]
            assert any(message in e and module in e for e in problems(task)), (tid, message, problems(task))
        task = copy.deepcopy(good)
        task["files"][-1]["content"] = "import pytest\n" + task["files"][-1]["content"]
        assert any("only tests may import pytest" in e for e in problems(task)), tid
    # Tests of a function task may import only names the statement mentions.
    task = copy.deepcopy(rows["digit_sum"])
    task["visible_tests"][0]["content"] = "from solution import helper_nobody_named\n" + \
        task["visible_tests"][0]["content"]
    assert any("'helper_nobody_named', which the statement does not name" in e for e in problems(task))
