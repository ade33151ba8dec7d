"""`python -m rl.evaluate` on the embedded engine and on an SGLang-speaking server it launches itself."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

FAKE = [sys.executable, str(Path(__file__).resolve().parents[1] / "fakes" / "sglang_server.py")]


@pytest.mark.parametrize("engine", ["local", "sglang"])
def test_evaluate_a_model_on_held_out_tasks(tmp_path, engine):
    from rl.evaluate import main

    overrides = ["--", "model=tiny", "agent.max_turns=2", "agent.max_new_tokens=32", "agent.max_episode_tokens=64"]
    if engine == "sglang":
        overrides += ["engine=sglang", "engine.sglang.gpus_per_server=0", f"engine.sglang.launch_command={FAKE}",
                      "engine.sglang.startup_timeout_s=120"]
    out = tmp_path / "eval.json"
    result = main(["--model", "tiny-random", "--max-tasks", "2", "--out", str(out), *overrides])
    assert result["metrics"]["eval/episodes"] == 2 and len(result["per_task"]) == 2
    assert all(row["tokens"] > 0 and row["finish"] for row in result["per_task"])
    assert json.loads(out.read_text())["metrics"]["eval/episodes"] == 2


def test_several_samples_per_task(tmp_path):
    """--samples N runs every task N times (sampled): pass@1 is the mean over all episodes and tasks_solved the
    share of tasks with at least one pass, both recomputed here from the per-episode rows."""
    from rl.evaluate import main

    overrides = ["--", "model=tiny", "agent.max_turns=1", "agent.max_new_tokens=16", "agent.max_episode_tokens=32",
                 "engine.eval_temperature=1.0"]
    result = main(["--model", "tiny-random", "--max-tasks", "2", "--samples", "3", *overrides])
    rows = result["per_task"]
    assert [r["task"] for r in rows][::3] == [r["task"] for r in rows][1::3] == [r["task"] for r in rows][2::3]
    assert result["metrics"]["eval/episodes"] == 6
    assert result["metrics"]["eval/pass_rate"] == pytest.approx(sum(r["passed"] for r in rows) / 6)
    solved = {r["task"] for r in rows if r["passed"]}
    assert result["metrics"]["eval/tasks_solved"] == pytest.approx(len(solved) / 2)


def test_several_greedy_samples_are_refused():
    from rl.evaluate import main

    with pytest.raises(SystemExit, match="eval_temperature"):
        main(["--model", "tiny-random", "--samples", "2", "--", "model=tiny"])
