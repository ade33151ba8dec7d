"""The generated long-horizon tasks (environments/data/generate_long_horizon.py → long_horizon_gen_tasks.jsonl):
the shape check_long_horizon.py demands, splits that share no function, mutations that are single-line and
undone by the reference trajectory, verified in a real sandbox."""

import json

import pytest

from environments import load_tasks
from environments.data.check_long_horizon import main as check, read_lines
from environments.data.generate_long_horizon import build_task, module_name, mutations, viable_mutations
from environments.tasks import LONG_HORIZON_GEN, LONG_HORIZON_GEN_TASKS, SHIPPED_TASKS


@pytest.fixture(scope="module")
def records() -> list[dict]:
    return [json.loads(line) for line in read_lines(LONG_HORIZON_GEN_TASKS)]


def test_the_set_loads_by_name_and_its_splits_share_no_function(records):
    task_set = load_tasks(LONG_HORIZON_GEN)
    assert task_set.skipped == [] and len(task_set.tasks) == len(records)
    train, held = task_set.split("lh_train"), task_set.split("lh_heldout")
    assert len(train) >= 200 and len(held) >= 30
    modules = {split: {f["path"].split("/", 1)[1] for r in records if r["split"] == split for f in r["files"]}
               for split in ("lh_train", "lh_heldout")}
    assert modules["lh_train"] & modules["lh_heldout"] == {"__init__.py"}
    assert len({r["id"] for r in records}) == len(records)


def test_the_cold_start_and_rl_splits_carry_their_faults_in_different_functions(records):
    """lh_sft's faults sit in two thirds of the training functions, lh_rl's in the other third: an SFT on lh_sft
    never reads the code RL must fix, as it never reads lh_heldout's."""
    def faulty(split):
        return {line.split("/")[-1] for r in records if r["split"] == split
                for line in r["patch"].splitlines() if line.startswith("--- a/")}

    sft, rl, train, held = faulty("lh_sft"), faulty("lh_rl"), faulty("lh_train"), faulty("lh_heldout")
    assert sum(r["split"] == "lh_sft" for r in records) >= 200 and sum(r["split"] == "lh_rl" for r in records) >= 200
    assert sft and rl and not sft & rl and not (sft | rl) & held
    assert len(rl) >= 8 and len(sft) > len(rl)  # a third of the training functions (some have no viable fault)
    assert (sft | rl) <= {f["path"].split("/", 1)[1] for r in records if r["split"] == "lh_train" for f in r["files"]}
    assert train & rl and train & sft  # lh_train (the earlier recipe's) still draws faults from every function


def test_every_task_passes_the_static_checks(capsys):
    assert check([LONG_HORIZON_GEN_TASKS, "--no-run"]) == 0, capsys.readouterr().out[-3000:]


def test_trajectories_solve_their_tasks_when_played(records, capsys):
    """Two tasks of lh_train and lh_heldout, one of lh_sft and lh_rl: the first test run fails, the trajectory's edits make every FAIL_TO_PASS and
    PASS_TO_PASS test pass in a fresh sandbox with the hidden tests."""
    ids = [r["id"] for split in ("lh_train", "lh_heldout", "lh_sft", "lh_rl")
           for r in [r for r in records if r["split"] == split][:2 if split in ("lh_train", "lh_heldout") else 1]]
    assert check([LONG_HORIZON_GEN_TASKS, "--part", "--only", *ids]) == 0, capsys.readouterr().out[-3000:]


def test_mutations_change_one_operator_or_constant_on_one_line():
    source = ('def clip(x, lo, hi):\n    """Keep x within [lo, hi] (1 of 2 helpers)."""\n    if x < lo:\n'
              '        return lo\n    if x > hi and not lo == hi:\n        return hi - 0\n'
              '    y = "\u00e9"; z = x + 1\n    return not (x or lo)\n')
    found = {(i, new.strip()) for i, _, new in mutations(source)}
    assert found == {(2, "if x <= lo:"), (4, "if x >= hi and not lo == hi:"), (4, "if x > hi or not lo == hi:"),
                     (4, "if x > hi and lo == hi:"), (4, "if x > hi and not lo != hi:"), (5, "return hi + 0"),
                     (5, "return hi - 1"), (7, "return (x or lo)"), (7, "return not (x and lo)")}
    # nothing in the docstring nor on the non-ASCII line (ast's columns count bytes); `not` goes, its
    # parentheses stay; a mutation that would duplicate another line (str_replace could not name it) is left out
    twins = "def f(x):\n    if x <= 0:\n        return 1\n    if x < 0:\n        return 2\n"
    made = {(i, new) for i, _, new in mutations(twins)}
    assert (1, "    if x <= 1:") in made and (3, "    if x < 1:") in made
    assert not {new for _, new in made} & {"    if x < 0:", "    if x <= 0:"}


def test_a_task_built_from_one_function_fails_where_it_should(tmp_path, capsys):
    """From coding_tasks.jsonl: the viable mutations of a function fail its visible test; a task built with two
    of them, in two modules, verifies end to end in the sandbox."""
    source = [json.loads(line) for line in open(SHIPPED_TASKS, encoding="utf-8")]
    functions = {r["id"]: r for r in source if r["domain"] == "function" and r["split"] == "train"}
    picked = [functions[i] for i in ("add_two_numbers", "double_number", "clamp_value", "count_vowels")
              if i in functions]
    assert len(picked) == 4
    faults = {}
    for task in picked[:2]:
        viable = viable_mutations(task)
        assert viable and all(v["hidden_failed"] for v in viable)
        faults[module_name(task["id"])] = viable[0]
    record = build_task("kitbag", picked, faults, "lh_train", "lh_gen_test_built")
    assert len(record["reference_trajectory"]) == 9 and record["FAIL_TO_PASS"]
    path = tmp_path / "one.jsonl"
    path.write_text(json.dumps(record) + "\n")
    assert check([str(path), "--part"]) == 0, capsys.readouterr().out[-3000:]


def test_reference_episodes_compact_at_the_experiments_window_and_solve():
    """long_horizon_gen_gpu's 2,048-token window: the agent loop plays two reference trajectories (rl.sft's
    rendering, the default policy's tokenizer) through at least one compaction each, and they still solve."""
    from models import load_tokenizer
    from rl.evaluate import load_config
    from rl.sft import render_reference_episodes

    cfg = load_config("long_horizon_gen_gpu", [])
    assert cfg.agent.context_window == 2048 and cfg.env.reward == "fail_to_pass"
    tasks = load_tasks(cfg.env.tasks).split(cfg.env.train_split)[:2]
    episodes, skipped = render_reference_episodes(cfg, tasks, load_tokenizer(cfg.model.name), concurrency=2)
    assert skipped == [] and len(episodes) == 2
    assert all(e.num_compactions >= 1 and len(e.segments) >= 2 and e.reward == 1.0 for e in episodes)
