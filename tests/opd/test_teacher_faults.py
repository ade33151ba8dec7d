"""A teacher worker that dies mid-step: Ray restarts it and its lost scores are asked again (none lost, none
twice); one that cannot come back leaves its trajectories out instead of hanging the step."""

import pytest
import ray
import torch

from opd.distill import collect_scores
from opd.teacher import TeacherWorker


@pytest.fixture(scope="module")
def ray_session():
    ray.init(num_cpus=2, include_dashboard=False, configure_logging=False, log_to_driver=False)
    yield
    ray.shutdown()


def _teacher(path: str, restarts: int):
    handle = ray.remote(num_cpus=0, max_restarts=restarts, max_task_retries=0)(TeacherWorker).remote(
        "t", path, "local", temperature=1.0, micro_batch_tokens=512, torch_threads=1)
    ray.get(handle.__ray_ready__.remote())
    return handle


def _samples(n: int = 8, length: int = 400) -> list[dict]:
    g = torch.Generator().manual_seed(0)
    return [{"token_ids": torch.randint(5, 400, (length,), generator=g).tolist(),
             "loss_mask": [0] * (length // 2) + [1] * (length - length // 2)} for _ in range(n)]


def test_a_teacher_that_dies_is_restarted_and_asked_again(ray_session, tiny_path):
    teacher = _teacher(tiny_path, restarts=1)
    samples = _samples()
    want = ray.get(teacher.score.remote(samples))
    ray.get(teacher.stats.remote())  # reset the counts
    refs = [teacher.score.remote(samples) for _ in range(3)]  # queued behind each other
    ray.kill(teacher, no_restart=False)  # the worker dies with them pending; Ray restarts it
    scores, rescored = collect_scores({"t": teacher}, [(k, "t", samples, r) for k, r in enumerate(refs)])
    assert sorted(scores) == [0, 1, 2] and rescored >= 1  # none lost
    for got in scores.values():
        assert all(torch.allclose(g, w, atol=1e-5) for g, w in zip(got, want))
    per_call = sum(sum(s["loss_mask"]) for s in samples)
    assert ray.get(teacher.stats.remote())["tokens"] == rescored * per_call  # none scored twice


def test_a_teacher_that_cannot_come_back_leaves_its_trajectories_out(ray_session, tiny_path):
    teacher = _teacher(tiny_path, restarts=0)
    samples = _samples(2, 64)
    refs = [teacher.score.remote(samples) for _ in range(2)]
    ray.kill(teacher, no_restart=True)
    scores, rescored = collect_scores({"t": teacher}, [(k, "t", samples, r) for k, r in enumerate(refs)],
                                      attempts=3, first_wait_s=0.1)
    # whatever finished before the kill is kept; the rest is left out, and the second job is not waited on again
    assert set(scores) <= {0, 1} and rescored == 0
