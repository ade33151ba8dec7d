import json

import pytest

from environments import Task, TaskFile
from rl.checkpoint import Checkpointer
from rl.data import TaskSampler
from rl.metrics import MetricsLogger, plot_curves, read_metrics
from rl.train import runs_out


def test_metrics_jsonl_resume_and_plot(tmp_path):
    log = MetricsLogger(tmp_path, wandb_mode="offline", run_name="t")
    for step in range(4):
        log.log(step, {"rollout/reward_mean": step / 4, "critic/value_loss": 1.0 / (step + 1), "x": float("nan")})
    log.close()
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [0, 1, 2, 3]
    assert read_metrics(tmp_path / "metrics.jsonl")[0]["x"] is None
    assert list((tmp_path / "wandb").glob("offline-run-*"))
    MetricsLogger(tmp_path, wandb_mode="disabled", resume_step=2).close()  # the checkpoint of step 2 is kept
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [0, 1, 2]
    png = plot_curves(tmp_path / "metrics.jsonl", tmp_path / "curves.png")
    assert png.exists() and png.read_bytes()[:4] == b"\x89PNG"


def test_checkpointer_latest_and_prune(tmp_path):
    ck = Checkpointer(tmp_path, keep=2)
    assert ck.latest() is None
    for step in (1, 2, 3):
        ck.save(step, lambda f: None, lambda f: None, {"step": step})
    assert ck.latest().name == "step_000003" and Checkpointer.load_state(ck.latest())["step"] == 3
    assert sorted(p.name for p in (tmp_path / "checkpoints").glob("step_*")) == ["step_000002", "step_000003"]
    broken = ck.path(4)
    broken.mkdir()  # killed mid-save: no trainer_state.json, `latest` untouched
    assert ck.latest().name == "step_000003"


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
