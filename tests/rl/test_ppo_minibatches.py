"""PPO with several optimiser steps per rollout batch (`algorithm.ppo_epochs`, `algorithm.mini_batches`).

The update is checked against the same steps taken one by one, and its clipping statistics against a
hand computation from the policy's logprobs at the start of the second step."""

import pytest
import torch

from critic.worker import CriticWorker
from models.batching import ppo_mini_batches, split_per_sample
from models.deepspeed_worker import OptimConfig
from rl.actor import ActorWorker, needs_logprob_pass, reference_due
from rl.config import AlgorithmConfig
from tests.rl.test_workers import batch

CLIP_LOW, CLIP_HIGH = 0.2, 0.28


def test_mini_batches_partition_every_epoch():
    samples = [{"i": i} for i in range(7)]
    assert list(ppo_mini_batches(samples)) == [(0, samples)]  # the default: the batch as it is, one step
    steps = list(ppo_mini_batches(samples, mini_batches=3, epochs=2, seed=5))
    assert [e for e, _ in steps] == [0, 0, 0, 1, 1, 1]
    for epoch in (0, 1):
        groups = [[s["i"] for s in g] for e, g in steps if e == epoch]
        assert sorted(i for g in groups for i in g) == list(range(7)) and {len(g) for g in groups} == {2, 3}
    assert steps == list(ppo_mini_batches(samples, 3, 2, seed=5))  # reproducible
    assert [g for _, g in steps[:3]] != [g for _, g in steps[3:]]  # a fresh split each epoch
    assert len(list(ppo_mini_batches(samples[:2], mini_batches=4))) == 2  # never an empty step
    with pytest.raises(ValueError):
        list(ppo_mini_batches(samples, mini_batches=0))
    assert not needs_logprob_pass(AlgorithmConfig(use_reference=False))
    assert needs_logprob_pass(AlgorithmConfig(use_reference=False, mini_batches=2))


def test_the_reference_pass_runs_on_every_nth_step_when_only_logged():
    every3 = AlgorithmConfig(use_reference=True, reference_every=3)
    assert [reference_due(every3, s) for s in range(7)] == [True, False, False, True, False, False, True]
    assert [needs_logprob_pass(every3, s) for s in range(4)] == [True, False, False, True]
    several = AlgorithmConfig(use_reference=True, reference_every=3, ppo_epochs=2)  # π_old is needed on every step
    assert all(needs_logprob_pass(several, s) for s in range(4))
    assert [reference_due(several, s) for s in range(4)] == [True, False, False, True]
    assert all(reference_due(AlgorithmConfig(use_reference=True), s) for s in range(4))
    assert not any(reference_due(AlgorithmConfig(use_reference=False), s) for s in range(4))
    # a penalty needs π_ref on every step (validation refuses the combination; this holds without it too)
    assert all(reference_due(AlgorithmConfig(kl_loss_coef=0.1, reference_every=3), s) for s in range(4))


def _actor(tiny_path, **algo):
    return ActorWorker(tiny_path, OptimConfig(learning_rate=3e-2, micro_batch_tokens=80),
                       AlgorithmConfig(use_reference=False, clip_low=CLIP_LOW, clip_high=CLIP_HIGH, dual_clip=0,
                                       **algo), temperature=1.0)


def _ppo_samples(worker, n=4):
    samples = batch(n)
    old = split_per_sample(samples, worker.compute_logprobs(samples)["old_logprobs"])
    for k, (s, lp) in enumerate(zip(samples, old)):
        sign = 1.0 if k % 2 == 0 else -1.0
        s.update(old_logprobs=lp, rollout_logprobs=lp.clone(), advantages=[sign * m for m in s["loss_mask"]])
    return samples


def test_two_mini_batches_equal_two_single_steps_and_the_clip_acts(tiny_path):
    torch.manual_seed(0)
    multi = _actor(tiny_path, mini_batches=2)
    samples = _ppo_samples(multi)
    (_, first), (_, second) = list(ppo_mini_batches(samples, 2, 1, seed=11))
    metrics = multi.train_step(samples, seed=11)
    assert metrics["actor/optim_steps"] == 2

    single = _actor(tiny_path)  # same initial weights (the same tiny checkpoint), one step at a time
    single.train_step(first)
    # Hand computation of the second step's clip statistics from the policy after the first step.
    now = split_per_sample(second, single.compute_logprobs(second)["old_logprobs"])
    clipped = approx_kl = tokens = 0.0
    for s, lp in zip(second, now):
        for logp, old, adv, m in zip(lp, s["old_logprobs"], s["advantages"], s["loss_mask"]):
            if not m:
                continue
            ratio = torch.exp(torch.as_tensor(logp - old)).item()
            tokens += 1
            approx_kl += float(old - logp)
            # the clipped branch is the larger loss exactly when the ratio left [1 - ε_low, 1 + ε_high] on the
            # side the advantage rewards
            clipped += (adv > 0 and ratio > 1 + CLIP_HIGH) or (adv < 0 and ratio < 1 - CLIP_LOW)
    total = sum(sum(s["loss_mask"]) for s in samples)
    assert clipped > 0, "the learning rate is meant to move the ratio past the clip in one step"
    assert metrics["actor/clipfrac"] == pytest.approx(clipped / total, abs=0.5 / total)
    assert metrics["actor/approx_kl"] == pytest.approx(approx_kl / total, rel=1e-3, abs=1e-6)

    single.train_step(second)
    a, b = multi.gathered_state(), single.gathered_state()
    assert all(torch.allclose(a[k], b[k], atol=1e-6) for k in a)


def test_several_steps_need_old_logprobs(tiny_path):
    worker = _actor(tiny_path, ppo_epochs=2)
    samples = _ppo_samples(worker, 2)
    for s in samples:
        del s["old_logprobs"]
    with pytest.raises(ValueError, match="old_logprobs"):
        worker.train_step(samples)


def test_the_value_clip_binds_from_the_second_step(tiny_path):
    def run(epochs):
        critic = CriticWorker(tiny_path, OptimConfig(learning_rate=3e-2), value_clip=0.05)
        samples = batch(4)
        for s, v in zip(samples, split_per_sample(samples, critic.compute_values(samples))):
            s.update(old_values=v, returns=[2.0 * m for m in s["loss_mask"]])
        return critic.train_step(samples, mini_batches=2, epochs=epochs, seed=3)

    one, three = run(1), run(3)
    assert one["critic/optim_steps"] == 2 and three["critic/optim_steps"] == 6
    # The first step starts at V = V_old: nothing is clipped there; later steps move V past ε = 0.05.
    assert three["critic/value_clipfrac"] > one["critic/value_clipfrac"] >= 0
    assert three["critic/value_clipfrac"] > 0.3


def test_trainer_tf32_sets_the_workers_matmul_precision(tiny_path):
    """trainer.tf32 reaches the worker's process (the GPU's TF32 tensor cores for fp32 matmuls); off again by
    default, so that the CPU suite and fp32 parity tests keep full fp32."""
    try:
        ActorWorker(tiny_path, OptimConfig(tf32=True), AlgorithmConfig(use_reference=False), temperature=1.0)
        assert torch.backends.cuda.matmul.allow_tf32 and torch.backends.cudnn.allow_tf32
        ActorWorker(tiny_path, OptimConfig(), AlgorithmConfig(use_reference=False), temperature=1.0)
        assert not torch.backends.cuda.matmul.allow_tf32 and not torch.backends.cudnn.allow_tf32
    finally:
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
