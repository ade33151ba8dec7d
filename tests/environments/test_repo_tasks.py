"""Repository tasks (SWE-bench style): records, the git workspace, grading by FAIL_TO_PASS / PASS_TO_PASS."""

import json
import subprocess

import pytest

from environments import grade, load_tasks, make_sandbox, setup_workspace
from environments.__main__ import main
from environments.grading import apply_patch, repo_base_files
from environments.types import RepoFile, TaskFile

HELDOUT_IDS = [  # the default run's eval split: CI time depends on it, repository tasks never join it
    "multiply_two_numbers", "last_element_of_list", "is_palindrome_string", "chunk_list", "digit_sum",
    "invert_dictionary", "merge_intervals", "top_k_frequent_words", "fix_is_adult_boundary",
    "fix_leap_year_centuries", "fix_binary_search_misses", "fix_parse_kv_equals_in_value"]

PATCH = ("--- a/shop/pricing.py\n+++ b/shop/pricing.py\n@@ -1,5 +1,5 @@\n from shop.money import cents\n \n \n"
         " def total(prices, discount=0):\n-    return cents(sum(prices)) - discount\n"
         "+    return max(0, cents(sum(prices)) - discount)\n")


def record(**changes) -> dict:
    """A small valid repository task: a two-module package, one visible and one hidden test file."""
    rec = {
        "id": "shop_total_floor", "kind": "repo", "domain": "repo", "difficulty": 1, "split": "repo_train",
        "problem_statement": "`shop.total` must never be negative: a discount larger than the total gives 0.",
        "files": [
            {"path": "shop/__init__.py", "content": "from shop.pricing import total\n"},
            {"path": "shop/money.py", "content": "def cents(amount):\n    return round(amount * 100)\n"},
            {"path": "shop/pricing.py", "content": "from shop.money import cents\n\n\n"
                                                   "def total(prices, discount=0):\n"
                                                   "    return cents(sum(prices)) - discount\n"},
        ],
        "visible_tests": [{"path": "tests/test_pricing.py", "content":
                           "from shop import total\n\n\ndef test_sum():\n    assert total([1.5, 2]) == 350\n\n\n"
                           "def test_discount():\n    assert total([1], 30) == 70\n"}],
        "hidden_tests": [{"path": "tests/test_floor.py", "content":
                          "from shop import total\n\n\ndef test_floor():\n    assert total([1], 500) == 0\n\n\n"
                          "class TestEdge:\n    def test_exact(self):\n        assert total([1], 100) == 0\n"}],
        "FAIL_TO_PASS": ["tests/test_floor.py::test_floor"],
        "PASS_TO_PASS": ["tests/test_pricing.py::test_sum", "tests/test_pricing.py::test_discount",
                         "tests/test_floor.py::TestEdge::test_exact"],
        "patch": PATCH,
    }
    rec.update(changes)
    return {k: v for k, v in rec.items() if v is not None}


def load_one(tmp_path, rec):
    path = tmp_path / "tasks.jsonl"
    path.write_text(json.dumps(rec) + "\n")
    task_set = load_tasks(str(path))
    assert task_set.skipped == [], task_set.skipped
    return task_set.tasks[0]


@pytest.fixture
def task(tmp_path):
    return load_one(tmp_path, record())


def test_record_loads_as_repo_task(task):
    assert task.is_repo and task.kind == "repo" and task.domain == "repo" and task.split == "repo_train"
    assert task.statement.startswith("`shop.total`") and task.entry_file == "shop/__init__.py"
    assert task.fail_to_pass == ["tests/test_floor.py::test_floor"] and len(task.pass_to_pass) == 3
    assert all(isinstance(f, RepoFile) for f in task.files + task.visible_tests)
    assert [f.path for f in task.hidden_tests] == ["tests/test_floor.py"]
    # The patch was applied with git apply: the reference solution is the file it changes.
    assert [f.path for f in task.reference_solution] == ["shop/pricing.py"]
    assert "max(0, " in task.reference_solution[0].content
    assert task.metadata["package_name"] == "shop" and task.metadata["patch"] == PATCH
    assert task.protected_paths == ["tests/test_floor.py", "tests/test_pricing.py"]


def test_swe_bench_spellings(tmp_path):
    """FAIL_TO_PASS / PASS_TO_PASS as JSON strings, `statement`, reference files, a test_patch, no kind."""
    rec = record(kind=None, problem_statement=None, statement="Total must not go below zero, ever.",
                 FAIL_TO_PASS=json.dumps(["tests/test_floor.py::test_floor", "tests/test_pricing.py::test_new"]),
                 PASS_TO_PASS=json.dumps(["tests/test_pricing.py::test_sum"]), patch=None,
                 reference_solution=[{"path": "shop/pricing.py", "content": apply_patch(
                     {f["path"]: f["content"] for f in record()["files"]}, PATCH)["shop/pricing.py"]}],
                 test_patch="--- a/tests/test_pricing.py\n+++ b/tests/test_pricing.py\n@@ -7,3 +7,7 @@\n"
                            " \n def test_discount():\n     assert total([1], 30) == 70\n+\n+\n"
                            "+def test_new():\n+    assert total([], 1) == 0\n")
    task = load_one(tmp_path, rec)
    assert task.is_repo and task.statement.startswith("Total")
    assert len(task.fail_to_pass) == 2 and task.pass_to_pass == ["tests/test_pricing.py::test_sum"]
    hidden = {f.path: f.content for f in task.hidden_tests}
    assert set(hidden) == {"tests/test_floor.py", "tests/test_pricing.py"} and "test_new" in hidden[
        "tests/test_pricing.py"]  # the test patch's version replaces the visible file at grading
    assert "test_new" not in task.visible_tests[0].content
    solved = grade(task, {**repo_base_files(task), **{f.path: f.content for f in task.reference_solution}})
    assert solved.reward == 1.0, solved.details
    assert grade(task, repo_base_files(task)).reward == pytest.approx(1 / 3)


def test_bad_records_are_reported_with_index_and_reason(tmp_path):
    good = record()
    bad = [
        record(id="no_f2p", FAIL_TO_PASS=None),
        record(id="empty_f2p", FAIL_TO_PASS=[]),
        record(id="unknown_file", PASS_TO_PASS=["tests/test_other.py::test_sum"]),
        record(id="undefined_test", FAIL_TO_PASS=["tests/test_floor.py::test_nothing"]),
        record(id="not_an_id", FAIL_TO_PASS=["test_floor"]),
        record(id="twice", PASS_TO_PASS=["tests/test_floor.py::test_floor"]),
        record(id="bad_patch", patch=PATCH.replace("discount\n", "rebate\n")),
        record(id="no_files", files=[]),
        record(id="clash", files=record()["files"] + [{"path": "tests/test_floor.py", "content": "x = 1\n"}]),
        record(id="escape", files=[{"path": "../outside.py", "content": ""}]),
        record(id="bad_kind", kind="notebook"),
        record(id="syntax", hidden_tests=[{"path": "tests/test_floor.py", "content": "def test_floor(:\n"}]),
        good,
    ]
    path = tmp_path / "tasks.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in [good] + bad) + "\n")
    result = load_tasks(str(path))
    assert [t.id for t in result.tasks] == [good["id"]]
    reasons = dict(result.skipped)
    assert sorted(reasons) == list(range(1, 14))
    expect = ["missing 'FAIL_TO_PASS'", "'FAIL_TO_PASS' is empty", "is not among the test files",
              "is not defined in 'tests/test_floor.py'", "is not 'path::name'", "listed twice",
              "the patch does not apply", "'files' (the repository snapshot) is empty", "both a snapshot file",
              "leaves the workspace", "unknown kind", "does not parse", "duplicate id"]
    for index, words in enumerate(expect, 1):
        assert words in reasons[index], (index, reasons[index])


def _sandbox_git(box, command: str) -> str:
    result = box.exec(command)
    assert result.exit_code == 0, result.stdout + result.stderr
    return result.stdout


def test_workspace_is_a_git_repo_with_only_the_base_commit(task):
    with make_sandbox("bwrap") as box:
        setup_workspace(box.workspace, task.files + task.visible_tests, getattr(box, "uid", None))
        assert _sandbox_git(box, "git rev-list --all --count").strip() == "1"
        assert _sandbox_git(box, "git log --all --format=%s").strip() == "base commit"
        assert _sandbox_git(box, "git status --porcelain") == ""
        assert _sandbox_git(box, "git branch -a --format='%(refname)'").split() == ["refs/heads/main"]
        assert _sandbox_git(box, "git tag; git remote; git stash list") == ""
        assert _sandbox_git(box, "git ls-files").split() == sorted(
            f.path for f in task.files + task.visible_tests)  # hidden tests never enter the workspace
        box.write_file("shop/pricing.py", task.reference_solution[0].content)
        diff = _sandbox_git(box, "git diff")
    assert "+    return max(0, cents(sum(prices)) - discount)" in diff
    # The agent's `git diff` is what grading applies to a fresh copy of the base.
    assert grade(task, diff).reward == 1.0


def test_function_task_workspaces_stay_plain_folders(task_by_id, tmp_path):
    task = task_by_id["add_two_numbers"]
    setup_workspace(tmp_path, task.files + task.visible_tests)
    assert not (tmp_path / ".git").exists()
    with pytest.raises(TypeError):
        grade(task, "--- a/solution.py\n+++ b/solution.py\n")


def test_reference_grades_full_and_start_does_not(task):
    base = repo_base_files(task)
    solved = grade(task, {**base, **{f.path: f.content for f in task.reference_solution}})
    assert solved.reward == 1.0 and solved.all_passed and solved.details["resolved"]
    assert solved.details["fail_to_pass"] == {"passed": 1, "total": 1}
    assert solved.details["changed_files"] == ["shop/pricing.py"]
    start = grade(task, base)
    assert start.reward == 0.75 and not start.details["resolved"]
    assert start.details["outcomes"]["tests/test_floor.py::test_floor"] == "failed"
    assert grade(task, base, reward="binary").reward == 0.0
    assert grade(task, "").reward == 0.75  # an empty diff: the base itself


def test_official_test_files_are_reapplied(task):
    files = repo_base_files(task)
    # The agent rewrites the visible test, plants its own copy of the hidden test and a conftest that would
    # skip everything: none of it counts.
    files["tests/test_pricing.py"] = "def test_sum():\n    pass\n\n\ndef test_discount():\n    pass\n"
    files["tests/test_floor.py"] = "def test_floor():\n    pass\n\n\nclass TestEdge:\n    def test_exact(self):\n" \
                                   "        pass\n"
    files["tests/conftest.py"] = "import pytest\n\n\ndef pytest_runtest_setup(item):\n    pytest.skip('no')\n"
    files["pytest.ini"] = "[pytest]\naddopts = -k nothing\n"
    result = grade(task, files)
    assert result.reward == 0.75 and result.details["outcomes"]["tests/test_floor.py::test_floor"] == "failed"
    assert result.details["ignored_files"] == ["pytest.ini", "tests/conftest.py", "tests/test_floor.py",
                                               "tests/test_pricing.py"]
    # Deleting the official tests does not remove them either.
    files = repo_base_files(task)
    del files["tests/test_pricing.py"]
    files["shop/pricing.py"] = task.reference_solution[0].content
    assert grade(task, files).reward == 1.0


def test_a_broken_pass_to_pass_test_counts(task):
    files = repo_base_files(task)
    # Fixes FAIL_TO_PASS but breaks the rounding that test_sum (PASS_TO_PASS) relies on.
    files["shop/pricing.py"] = task.reference_solution[0].content
    files["shop/money.py"] = "def cents(amount):\n    return int(amount * 100) + 1\n"
    result = grade(task, files)
    assert result.details["fail_to_pass"] == {"passed": 1, "total": 1}
    assert result.details["pass_to_pass"]["passed"] < 3 and result.reward < 1
    assert result.details["outcomes"]["tests/test_pricing.py::test_sum"] == "failed"


def test_fail_to_pass_reward_pays_nothing_for_the_unsolved_start(task):
    """pass_fraction pays 3/4 for submitting the base (its pass_to_pass tests pass); fail_to_pass pays 0 for it,
    1 for the reference, and scales a fix by the share of pass_to_pass tests it keeps."""
    base = repo_base_files(task)
    assert grade(task, base, reward="fail_to_pass").reward == 0.0
    assert grade(task, "", reward="fail_to_pass").reward == 0.0
    fixed = {**base, "shop/pricing.py": task.reference_solution[0].content}
    assert grade(task, fixed, reward="fail_to_pass").reward == 1.0
    # The fix, with test_sum broken by hand (2 of 3 pass_to_pass tests left): 1/1 × 2/3.
    fixed["tests/test_pricing.py"] = base["tests/test_pricing.py"]
    fixed["shop/__init__.py"] = ("from shop.pricing import total as _total\n\n\ndef total(prices, discount=0):\n"
                                 "    return _total(prices, discount) + (1 if len(prices) == 2 else 0)\n")
    result = grade(task, fixed, reward="fail_to_pass")
    assert result.details["pass_to_pass"] == {"passed": 2, "total": 3}
    assert result.reward == pytest.approx(2 / 3)


def test_missing_or_uncollected_tests_fail(task):
    files = repo_base_files(task)
    files["shop/pricing.py"] = task.reference_solution[0].content
    # The package cannot be imported: nothing is collected, every listed test counts as failed.
    files["shop/__init__.py"] = "from shop.pricing import totl\n"
    result = grade(task, files)
    assert result.reward == 0.0 and set(result.details["outcomes"].values()) <= {"missing", "failed"}
    # Library code that exits 0 at import: the test run "succeeds" with no report; all missing.
    files["shop/__init__.py"] = "import os\nos._exit(0)\n"
    result = grade(task, files)
    assert result.reward == 0.0 and set(result.details["outcomes"].values()) == {"missing"}


def test_shipped_repo_tasks(shipped_tasks):
    repo = [t for t in shipped_tasks.tasks if t.is_repo]
    assert len(repo) >= 20 and len(shipped_tasks.tasks) >= 100 and shipped_tasks.skipped == []
    assert [t.id for t in shipped_tasks.split("heldout")] == HELDOUT_IDS
    assert {t.split for t in repo} == {"repo_train", "repo_heldout"}
    for t in repo:
        modules = [f.path for f in t.files if f.path.endswith(".py") and not f.path.endswith("__init__.py")]
        assert len(modules) >= 2, t.id  # multi-file packages
        assert t.fail_to_pass and t.reference_solution and t.hidden_tests and t.visible_tests, t.id
        assert not {f.path for f in t.files} & set(t.test_paths), t.id


@pytest.mark.parametrize("task_id", ["repo_csvlite_escaped_quotes", "repo_toposort_cycle_error",
                                     "repo_money_split_rounding"])
def test_shipped_reference_patches_grade_full(task_by_id, task_id):
    task = task_by_id[task_id]
    assert grade(task, task.metadata["patch"]).reward == 1.0  # the diff, applied by git
    start = grade(task, repo_base_files(task))
    assert start.reward < 1.0
    assert start.details["pass_to_pass"]["passed"] == start.details["pass_to_pass"]["total"]


def test_cli_lists_and_grades_repo_tasks(capsys, task_by_id):
    assert main(["list", "--domain", "repo", "--json"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert len(rows) >= 20 and all(r["kind"] == "repo" and r["fail_to_pass"] >= 1 for r in rows)
    assert main(["grade", "repo_lru_get_refreshes"]) == 0
    out = capsys.readouterr().out
    assert "repo_lru_get_refreshes  reference reward 1.000" in out and "FAIL_TO_PASS 3/3" in out
    assert "repo_lru_get_refreshes  start     reward 0.571" in out


def test_git_apply_refuses_paths_outside(tmp_path):
    evil = "--- a/../evil.py\n+++ b/../evil.py\n@@ -0,0 +1 @@\n+x = 1\n"
    with pytest.raises(ValueError, match="does not apply"):
        apply_patch({"a.py": "a = 1\n"}, evil)
    assert subprocess.run(["git", "--version"], capture_output=True, check=False).returncode == 0
    assert TaskFile("a", "b") != RepoFile("a", "b")  # a repo file is told apart by its type only
