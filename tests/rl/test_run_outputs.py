import json
import os
import time
from types import SimpleNamespace

import pytest
import torch

from environments import Task, TaskFile
from rl.checkpoint import Checkpointer
from rl.data import TaskSampler
from rl.run_log import MetricsLogger, main as run_log_main, panel_lines, plot_curves, read_metrics
from rl.loop import TimeLimit, driver_threads, runs_out


def test_metrics_jsonl_resume_and_plot(tmp_path):
    log = MetricsLogger(tmp_path, wandb_mode="offline", run_name="t")
    for step in range(4):
        log.log(step, {"rollout/reward_mean": step / 4, "critic/value_loss": 1.0 / (step + 1), "x": float("nan")})
    log.close()
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [0, 1, 2, 3]
    assert read_metrics(tmp_path / "metrics.jsonl")[0]["x"] is None
    assert list((tmp_path / "wandb").glob("offline-run-*"))
    kept = MetricsLogger.record(2, {"rollout/reward_mean": 0.5, "x": float("nan")})
    MetricsLogger(tmp_path, wandb_mode="disabled", resume_step=2, resume_record=kept).close()  # step 2's checkpoint
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [0, 1, 2]  # its line not twice
    # killed between step 3's checkpoint and its line: the checkpoint's copy of the line is written back
    MetricsLogger(tmp_path, wandb_mode="disabled", resume_step=3,
                  resume_record=MetricsLogger.record(3, {"rollout/reward_mean": 0.75, "x": float("inf")})).close()
    records = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in records] == [0, 1, 2, 3] and records[3] == {"step": 3, "rollout/reward_mean": 0.75,
                                                                            "x": None}
    MetricsLogger(tmp_path, wandb_mode="disabled", resume_step=2).close()  # a checkpoint without a line: as before
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [0, 1, 2]
    png = plot_curves(tmp_path / "metrics.jsonl", tmp_path / "curves.png")
    assert png.exists() and png.read_bytes()[:4] == b"\x89PNG"


def test_compare_draws_each_run_on_the_same_panels(tmp_path, capsys):
    k0 = [{"step": 0, "eval/reward_mean": 0.14}, {"step": 1, "rollout/reward_mean": 0.08},
          {"step": 2, "rollout/reward_mean": 0.09, "eval/reward_mean": 0.16}]
    k2 = [{"step": 1, "rollout/reward_mean": 0.06}, {"step": 2, "rollout/reward_mean": 0.10, "critic/value_loss": 0.3}]
    panels = panel_lines({"k0": k0, "k2": k2}, curves=[("rollout/reward_mean", "eval/reward_mean"),
                                                       ("critic/value_loss",), ("actor/entropy",)])
    assert panels == [  # the entropy panel has no point in either run: left out
        [("k0", "rollout/reward_mean", [1, 2], [0.08, 0.09]), ("k0", "eval/reward_mean", [0, 2], [0.14, 0.16]),
         ("k2", "rollout/reward_mean", [1, 2], [0.06, 0.10])],
        [("k2", "critic/value_loss", [2], [0.3])]]
    for name, records in (("k0", k0), ("k2", k2)):
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    run_log_main(["compare", f"k0={tmp_path / 'k0.jsonl'}", f"k2={tmp_path / 'k2.jsonl'}",
                  "--out", str(tmp_path / "compare.png")])
    assert (tmp_path / "compare.png").read_bytes()[:4] == b"\x89PNG" and "k0, k2" in capsys.readouterr().out
    for bad in (["compare", "k0"], ["compare", f"k0={tmp_path / 'missing.jsonl'}"]):
        with pytest.raises(SystemExit):
            run_log_main(bad + ["--out", str(tmp_path / "x.png")])
    assert "expected NAME=METRICS.jsonl" in capsys.readouterr().err


def test_driver_threads_for_the_run_then_the_callers_again():
    before = torch.get_num_threads()
    other = 1 if before != 1 else 2
    with driver_threads(other):
        assert torch.get_num_threads() == other
    assert torch.get_num_threads() == before
    with pytest.raises(RuntimeError, match="a crashed run"), driver_threads(other):
        raise RuntimeError("a crashed run")
    assert torch.get_num_threads() == before  # also after a run that raised
    with driver_threads(0):  # 0: every core
        assert torch.get_num_threads() == os.cpu_count()
    assert torch.get_num_threads() == before


def test_checkpointer_latest_and_prune(tmp_path):
    ck = Checkpointer(tmp_path, keep=2)
    assert ck.latest() is None
    for step in (1, 2, 3):
        ck.save(step, lambda f: None, lambda f: None, {"step": step})
    assert ck.latest().name == "step_000003" and Checkpointer.load_state(ck.latest())["step"] == 3
    assert sorted(p.name for p in (tmp_path / "checkpoints").glob("step_*")) == ["step_000002", "step_000003"]
    broken = ck.path(4)
    broken.mkdir()  # killed mid-save: no trainer_state.json (half-written, it would still be the .tmp)
    (broken / "trainer_state.json.tmp").write_text('{"st')
    assert ck.latest().name == "step_000003"
    # killed after step 4's state but before `latest` moved: step 4 is complete, and the resume takes it
    (broken / "trainer_state.json").write_text('{"step": 4}')
    assert (tmp_path / "checkpoints" / "latest").read_text() == "step_000003" and ck.latest().name == "step_000004"


def test_sampler_resumes_the_same_order():
    tasks = [Task(f"t{i}", "s", [TaskFile("a.py", "")], hidden_tests=[TaskFile("t.py", "")]) for i in range(5)]
    a = TaskSampler(tasks, seed=3)
    first = [t.id for t in a.next(7)]
    state = json.loads(json.dumps(a.state_dict()))
    rest = [t.id for t in a.next(6)]
    b = TaskSampler(tasks, seed=3)
    b.load_state_dict(state)
    assert [t.id for t in b.next(6)] == rest
    assert sorted(first[:5]) == sorted(t.id for t in tasks)  # an epoch visits every task once
    with pytest.raises(ValueError, match="task set changed"):
        TaskSampler(tasks[:3]).load_state_dict(state)


def test_time_limit_arithmetic():
    assert not runs_out(0, elapsed=1e9, step_s=1e9, eval_s=1e9)  # no limit
    # 100 s in, steps of 20 s, a final evaluation of 30 s, a limit of 160 s:
    assert not runs_out(160, 100, 20, 30)  # one more step and the evaluation end at 150
    assert runs_out(160, 100, 20, 30, steps_ahead=2)  # two more would end at 170
    assert runs_out(160, 100, 20, 45)  # a longer evaluation: 165
    assert not runs_out(160, 100, 30, 30)  # ends exactly at the limit: still fits


@pytest.mark.parametrize("action", ["stop", "finish"])
def test_time_limit_decisions(action):
    """A 100 s limit, steps of 10 s, a final evaluation of 20 s; `elapsed` seconds into the run."""
    def clock(elapsed):
        c = TimeLimit(SimpleNamespace(time_limit_s=100, steps=10, time_limit_action=action),
                      started=time.perf_counter() - elapsed)
        c.saw_evaluation(20)
        c.step_s = 10
        return c

    finish = action == "finish"
    assert clock(50).is_last(3) is False  # 50 + 2 × 10 + 20 = 90: room for this step, another and the evaluation
    assert clock(65).is_last(3) is finish  # 105: under "finish" this step is the last
    assert clock(0).is_last(9) is True  # the configured last step, always
    assert clock(50).stops_after(3, 10, last=False) is False
    assert clock(95).stops_after(3, 10, last=False) is (not finish)  # "stop": checkpoint now, resume later
    assert clock(85).stops_after(8, 10, last=False) is (not finish)  # next is the last: its evaluation counts
    final = {}
    assert clock(0).ended_early(3, last=True, out_of_time=False, final=final) and final == {"finished_early_at_step": 4}
