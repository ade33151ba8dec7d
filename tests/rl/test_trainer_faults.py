"""Fault injection on a trainer group (real Ray actors, DeepSpeed on gloo): a rank that dies stops the run at once
with a message that says how to go on, instead of leaving the other ranks waiting in a collective."""

from __future__ import annotations

import time

import pytest
import ray

from models.deepspeed_worker import OptimConfig
from rl.actor import ActorWorker
from rl.config import AlgorithmConfig
from rl.group import TrainerGroup, TrainerRankDied


@pytest.fixture(scope="module")
def ray_session():
    if ray.is_initialized():  # a Ray another module left running would make this init fail
        ray.shutdown()
    ray.init(num_cpus=2, include_dashboard=False, configure_logging=False, log_to_driver=False)
    yield
    ray.shutdown()


def test_a_dead_rank_stops_the_group_with_a_clear_message(ray_session, tiny_path):
    group = TrainerGroup(ActorWorker, 2, 0, "actor", tiny_path, OptimConfig(learning_rate=1e-3, micro_batch_tokens=64),
                         AlgorithmConfig(use_reference=False), temperature=1.0, torch_threads=1)
    samples = [{"token_ids": list(range(10 + i, 40 + i)), "loss_mask": [0] * 5 + [1] * 25,
                "rollout_logprobs": [-1.0] * 30, "advantages": [0.5] * 30} for i in range(4)]
    assert "actor/loss" in group.train_step(samples, 0).result()  # both ranks work
    ray.kill(group.workers[1])  # rank 1's process is gone
    started = time.monotonic()
    with pytest.raises(TrainerRankDied, match="an? actor rank died.*resume=true continues from the last checkpoint"):
        group.train_step(samples, 1).result()  # rank 0 would wait in its all-reduce for rank 1
    assert time.monotonic() - started < 60  # not the collective's timeout (30 min)
    group.shutdown()
