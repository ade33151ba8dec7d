"""Actor and critic workers under DeepSpeed (one CPU process, gloo), without Ray."""

import math

import pytest
import torch

from critic.worker import CriticWorker
from models.batching import TokenBatch, split_per_sample
from models.deepspeed_worker import OptimConfig
from rl.actor import ActorWorker
from rl.config import AlgorithmConfig


def batch(n_samples=3):
    g = torch.Generator().manual_seed(0)
    out = []
    for i in range(n_samples):
        n = 30 + 7 * i
        out.append({"token_ids": torch.randint(100, 5000, (n,), generator=g).tolist(),
                    "loss_mask": [0] * 12 + [1] * (n - 12)})
    return out


@pytest.fixture(scope="module")
def actor(tiny_path):
    return ActorWorker(tiny_path, OptimConfig(learning_rate=1e-3, micro_batch_tokens=80), AlgorithmConfig(),
                       temperature=1.0)


def mean_logp(actor, samples):
    lp = split_per_sample(samples, actor.compute_logprobs(samples)["old_logprobs"])
    vals = [x for s, l in zip(samples, lp) for x, m in zip(l, s["loss_mask"]) if m]
    return sum(vals) / len(vals)


def test_a_step_without_reference_logprobs_trains_and_logs_no_kl(tiny_path):
    """algorithm.reference_every > 1: on the steps between reference passes the samples carry no ref_logprobs;
    the update runs as usual and reports no KL (not a KL of 0). The pass skips π_ref when asked to."""
    actor = ActorWorker(tiny_path, OptimConfig(learning_rate=1e-3, micro_batch_tokens=80), AlgorithmConfig(),
                        temperature=1.0)  # its own: these updates must not move the module's shared actor
    samples = batch()
    assert set(actor.compute_logprobs(samples, True, False)) == {"old_logprobs"}
    lp = {k: split_per_sample(samples, v) for k, v in actor.compute_logprobs(samples).items()}
    for s, old in zip(samples, lp["old_logprobs"]):
        s.update(rollout_logprobs=old.clone(), advantages=list(s["loss_mask"]))
    without = actor.train_step(samples)
    assert "actor/kl_ref" not in without and math.isfinite(without["actor/grad_norm"])
    for s, ref in zip(samples, lp["ref_logprobs"]):
        s["ref_logprobs"] = ref
    assert actor.train_step(samples)["actor/kl_ref"] > 0  # one update has moved the policy off the reference


def test_ppo_step_moves_the_policy_along_the_advantage(actor):
    samples = batch()
    for sign in (+1.0, -1.0):
        lp = {k: split_per_sample(samples, v) for k, v in actor.compute_logprobs(samples).items()}
        for s, old, ref in zip(samples, lp["old_logprobs"], lp["ref_logprobs"]):
            s.update(old_logprobs=old, ref_logprobs=ref, rollout_logprobs=old.clone(),
                     advantages=[sign * m for m in s["loss_mask"]])
        before = mean_logp(actor, samples)
        metrics = actor.train_step(samples)
        after = mean_logp(actor, samples)
        assert (after - before) * sign > 0, (sign, before, after)
        assert metrics["actor/approx_kl"] == pytest.approx(0.0, abs=1e-5)  # first pass: π_θ = π_old
        assert metrics["mismatch/train_rollout_logprob_abs_diff"] < 1e-5
        assert metrics["actor/grad_norm"] > 0 and "actor/kl_ref" in metrics


def test_micro_batching_does_not_change_the_update(tiny_path):
    """Whole-batch token-mean: the same loss and gradient whatever the micro-batch split."""
    results = []
    for budget in (40, 10_000):
        w = ActorWorker(tiny_path, OptimConfig(learning_rate=1e-2, micro_batch_tokens=budget),
                        AlgorithmConfig(use_reference=False), temperature=1.0)
        samples = batch()
        lp = split_per_sample(samples, w.compute_logprobs(samples)["old_logprobs"])
        for s, old in zip(samples, lp):
            s.update(old_logprobs=old, rollout_logprobs=old.clone(), advantages=[0.5 * m for m in s["loss_mask"]])
        results.append(w.train_step(samples))
    assert results[0]["actor/loss"] == pytest.approx(results[1]["actor/loss"], rel=1e-5)
    assert results[0]["actor/grad_norm"] == pytest.approx(results[1]["actor/grad_norm"], rel=1e-4)
    assert results[0]["actor/entropy"] == pytest.approx(results[1]["actor/entropy"], rel=1e-5)


def test_weight_buckets_cover_every_parameter(actor):
    buckets = actor.weight_buckets(bucket_mb=1)
    names = [n for b in buckets for n in b]
    assert len(buckets) > 1 and sorted(names) == sorted(dict(actor.module.named_parameters()))


def value_losses(critic, samples, steps: int) -> list[float]:
    """The value loss of `steps` updates towards returns of 0.7 on every action token."""
    losses = []
    for _ in range(steps):
        values = split_per_sample(samples, critic.compute_values(samples))
        for s, v in zip(samples, values):
            s.update(old_values=v, returns=[0.7 * m for m in s["loss_mask"]])
        losses.append(critic.train_step(samples)["critic/value_loss"])
    return losses


def test_critic_learns_returns(tiny_path):
    critic = CriticWorker(tiny_path, OptimConfig(learning_rate=1e-3), value_clip=None)
    samples = batch()
    values = split_per_sample(samples, critic.compute_values(samples))
    assert all(v == 0.0 for vs in values for v in vs)  # fresh head: V ≡ 0
    losses = value_losses(critic, samples, 8)
    assert losses[-1] < 0.5 * losses[0]


def test_the_value_head_at_its_own_learning_rate_reaches_the_returns_sooner(tiny_path):
    """trainer.critic_head_learning_rate: the zero-initialised head in a group of its own; at the body's small
    rate the values hardly leave 0 in three steps, with the head's they close most of the gap to the returns."""
    def fit(head_lr):
        critic = CriticWorker(tiny_path, OptimConfig(learning_rate=1e-5, head_learning_rate=head_lr), value_clip=None)
        samples = batch()
        for _ in range(3):
            for s, v in zip(samples, split_per_sample(samples, critic.compute_values(samples))):
                s.update(old_values=v, returns=[0.7 * m for m in s["loss_mask"]])
            critic.train_step(samples)
        values = split_per_sample(samples, critic.compute_values(samples))
        masked = [v for s, vs in zip(samples, values) for v, m in zip(vs, s["loss_mask"]) if m]
        groups = {g["name"]: (g["lr"], len(g["params"])) for g in critic.engine.optimizer.param_groups}
        return sum(masked) / len(masked), groups

    slow, groups = fit(0.0)
    assert set(groups) == {"dense"} and groups["dense"][0] == 1e-5
    fast, groups = fit(1e-2)
    assert groups["value_head"] == (1e-2, 2) and groups["dense"][0] == 1e-5  # score.weight, score.bias
    assert abs(slow) < 0.05, slow
    assert abs(fast - 0.7) < 0.5 * abs(slow - 0.7), (slow, fast)


def test_checkpoint_roundtrip_restores_weights_and_optimizer(tiny_path, tmp_path):
    def make():
        return CriticWorker(tiny_path, OptimConfig(learning_rate=1e-3), value_clip=None)

    def step(w):
        samples = batch(2)
        for s, v in zip(samples, split_per_sample(samples, w.compute_values(samples))):
            s.update(old_values=v, returns=[1.0 * m for m in s["loss_mask"]])
        w.train_step(samples)

    a = make()
    step(a)
    a.save(str(tmp_path / "ckpt"))
    step(a)  # continue without interruption
    b = make()
    b.load(str(tmp_path / "ckpt"))
    step(b)  # resumed: must land on exactly the same weights (Adam moments restored)
    sa, sb = a.gathered_state(), b.gathered_state()
    assert all(torch.allclose(sa[k], sb[k], atol=1e-7) for k in sa)
    from transformers import AutoModelForTokenClassification

    hf = AutoModelForTokenClassification.from_pretrained(tmp_path / "ckpt" / "hf")
    assert hf.config.num_labels == 1
    # resumed with another learning rate: the config's applies (the optimizer state alone would restore 1e-3)
    c = CriticWorker(tiny_path, OptimConfig(learning_rate=4e-3), value_clip=None)
    c.load(str(tmp_path / "ckpt"))
    assert {g["lr"] for g in c.engine.optimizer.param_groups} == {4e-3}
    assert {g["lr"] for g in b.engine.optimizer.param_groups} == {1e-3}
    # the value head in a group of its own (trainer.critic_head_learning_rate) resumes at its own rate, and a
    # checkpoint resumes only into the same grouping (torch would refuse it, a universal checkpoint drop state)
    with pytest.raises(ValueError, match="critic_head_learning_rate"):
        CriticWorker(tiny_path, OptimConfig(learning_rate=1e-3, head_learning_rate=5e-2),
                     value_clip=None).load(str(tmp_path / "ckpt"))
    d = CriticWorker(tiny_path, OptimConfig(learning_rate=1e-3, head_learning_rate=5e-2), value_clip=None)
    step(d)
    d.save(str(tmp_path / "head"))
    e = CriticWorker(tiny_path, OptimConfig(learning_rate=2e-3, head_learning_rate=3e-2), value_clip=None)
    e.load(str(tmp_path / "head"))
    assert {g["name"]: g["lr"] for g in e.engine.optimizer.param_groups} == {"dense": 2e-3, "value_head": 3e-2}
    with pytest.raises(ValueError, match="critic_head_learning_rate"):
        make().load(str(tmp_path / "head"))
    with pytest.raises(ValueError, match="no value head"):
        ActorWorker(tiny_path, OptimConfig(head_learning_rate=1e-3), AlgorithmConfig(use_reference=False),
                    temperature=1.0)


def test_resume_from_weights_only_trains_on_and_keeps_the_reference(tiny_path, tmp_path):
    """A checkpoint whose optimizer state was dropped (carried between machines without it) resumes only under
    trainer.resume_weights_only: the trained models load its HF weights, π_ref stays model.name's."""
    import shutil

    from rl.config import Config
    from rl.train import model_sources

    trained = ActorWorker(tiny_path, OptimConfig(learning_rate=1e-2, micro_batch_tokens=80), AlgorithmConfig(),
                          temperature=1.0)
    samples = batch()
    before = trained.compute_logprobs(samples, True, False)["old_logprobs"]
    for s, old in zip(samples, split_per_sample(samples, before)):
        s.update(old_logprobs=old, rollout_logprobs=old.clone(), advantages=list(s["loss_mask"]))
    trained.train_step(samples)
    ckpt = tmp_path / "step_000001"
    trained.save(str(ckpt / "actor"))
    CriticWorker(tiny_path, OptimConfig(learning_rate=1e-3), value_clip=None).save(str(ckpt / "critic"))
    cfg = Config()
    cfg.model.name = tiny_path
    assert model_sources(cfg, None) == (tiny_path, tiny_path, tiny_path)
    assert model_sources(cfg, ckpt) == (tiny_path, tiny_path, tiny_path)  # exact resume: the states load later
    for model in ("actor", "critic"):
        shutil.rmtree(ckpt / model / "state")
    with pytest.raises(ValueError, match="trainer.resume_weights_only=true"):
        model_sources(cfg, ckpt)
    cfg.trainer.resume_weights_only = True
    policy, critic, reference = model_sources(cfg, ckpt)
    assert (policy, critic, reference) == (str(ckpt / "actor" / "hf"), str(ckpt / "critic" / "hf"), tiny_path)
    resumed = ActorWorker(policy, OptimConfig(learning_rate=1e-2, micro_batch_tokens=80), AlgorithmConfig(),
                          temperature=1.0, reference_path=reference)
    now = resumed.compute_logprobs(samples)
    base = ActorWorker(tiny_path, OptimConfig(), AlgorithmConfig(use_reference=False), temperature=1.0)
    torch.testing.assert_close(now["old_logprobs"], trained.compute_logprobs(samples, True, False)["old_logprobs"])
    torch.testing.assert_close(now["ref_logprobs"], base.compute_logprobs(samples, True, False)["old_logprobs"])
    assert (now["old_logprobs"] - now["ref_logprobs"]).abs().max() > 1e-3  # the update moved it off π_ref
    shutil.rmtree(ckpt / "critic" / "hf")
    with pytest.raises(ValueError, match="no HF weights"):
        model_sources(cfg, ckpt)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_stages_train_and_export(tiny_path, tmp_path, stage):
    """(with the value head at a rate of its own: ZeRO partitions both groups, a resume sets each group's rate)"""
    critic = CriticWorker(tiny_path, OptimConfig(learning_rate=1e-3, head_learning_rate=5e-3, zero_stage=stage),
                          value_clip=None)
    samples = batch(2)
    for s, v in zip(samples, split_per_sample(samples, critic.compute_values(samples))):
        s.update(old_values=v, returns=[1.0 * m for m in s["loss_mask"]])
    first = critic.train_step(samples)["critic/value_loss"]
    for s, v in zip(samples, split_per_sample(samples, critic.compute_values(samples))):
        s.update(old_values=v)
    assert critic.train_step(samples)["critic/value_loss"] < first
    state = critic.gathered_state()
    assert state["score.weight"].shape == (1, 64) and state["score.weight"].abs().sum() > 0
    critic.save(str(tmp_path / "c"))
    from transformers import AutoModelForTokenClassification

    hf = AutoModelForTokenClassification.from_pretrained(tmp_path / "c" / "hf")
    assert torch.allclose(hf.score.weight, state["score.weight"])
    resumed = CriticWorker(tiny_path, OptimConfig(learning_rate=2e-3, head_learning_rate=7e-3, zero_stage=stage),
                           value_clip=None)
    resumed.load(str(tmp_path / "c"))
    assert {g["name"]: g["lr"] for g in resumed.engine.optimizer.param_groups} == {"dense": 2e-3, "value_head": 7e-3}
    assert torch.allclose(resumed.gathered_state()["score.weight"], state["score.weight"])


def test_old_logprobs_from_the_update_forward_equal_a_separate_pass(tiny_path):
    """One optimiser step per batch: π_old taken from the update's own forward is the recomputed π_old."""
    results = []
    for separate in (True, False):
        w = ActorWorker(tiny_path, OptimConfig(learning_rate=1e-3, micro_batch_tokens=60),
                        AlgorithmConfig(use_reference=False), temperature=0.9)
        samples = batch()
        if separate:
            for s, old in zip(samples, split_per_sample(samples, w.compute_logprobs(samples)["old_logprobs"])):
                s["old_logprobs"] = old
        for s in samples:
            s.update(rollout_logprobs=[-5.0 * m for m in s["loss_mask"]],
                     advantages=[(-1.0) ** i * m for i, m in enumerate(s["loss_mask"])])
        results.append(w.train_step(samples))
    for key in ("actor/loss", "actor/grad_norm", "mismatch/tis_truncated_frac", "mismatch/masked_frac"):
        assert results[0][key] == pytest.approx(results[1][key], rel=1e-5, abs=1e-7), key


@pytest.mark.parametrize("stage,offload_params", [(2, False), (3, True)])
def test_offload_trains_like_no_offload(tiny_path, stage, offload_params):
    """trainer.offload_optimizer (and offload_params under ZeRO-3): the optimizer state (and the parameter
    shards) live in host memory; the step is the same one."""
    states = []
    for offload in (False, True):
        critic = CriticWorker(tiny_path, OptimConfig(learning_rate=1e-3, zero_stage=stage, offload_optimizer=offload,
                                                     offload_params=offload and offload_params), value_clip=None)
        if offload:
            assert critic.engine.zero_offload_optimizer() is not None or critic.engine.zero_cpu_offload()
        samples = batch(2)
        for s, v in zip(samples, split_per_sample(samples, critic.compute_values(samples))):
            s.update(old_values=v, returns=[1.0 * m for m in s["loss_mask"]])
        critic.train_step(samples)
        states.append(critic.gathered_state())
    moved = float((states[0]["score.weight"]).abs().max())
    assert moved > 0
    assert all(torch.allclose(states[0][k], states[1][k], atol=1e-6) for k in states[0])


def test_offload_needs_a_zero_stage_that_partitions_it():
    with pytest.raises(ValueError, match="zero_stage >= 1"):
        OptimConfig(offload_optimizer=True)
    with pytest.raises(ValueError, match="zero_stage = 3"):
        OptimConfig(zero_stage=2, offload_params=True)


def test_zero3_accumulates_every_micro_batch_like_zero0(tiny_path):
    """Several micro-batches in one optimiser step under ZeRO-3 give ZeRO-0's update. (Our forwards call the
    engine's module, bypassing engine.forward, where ZeRO-3 counts micro-steps; without that bookkeeping each
    micro-batch's backward replaced the gradient of the ones before, and only the last one's was applied.)"""
    states, norms = [], []
    for stage in (0, 3):
        w = ActorWorker(tiny_path, OptimConfig(learning_rate=1e-2, micro_batch_tokens=40, zero_stage=stage),
                        AlgorithmConfig(use_reference=False), temperature=1.0)
        samples = batch()
        assert len(w.micro_batches(TokenBatch.from_samples(samples), ())) > 2
        for s, old in zip(samples, split_per_sample(samples, w.compute_logprobs(samples)["old_logprobs"])):
            s.update(old_logprobs=old, rollout_logprobs=old.clone(), advantages=[0.5 * m for m in s["loss_mask"]])
        norms.append(w.train_step(samples)["actor/grad_norm"])
        states.append(w.gathered_state())
    assert norms[1] == pytest.approx(norms[0], rel=1e-4)
    assert max(float((states[0][k] - states[1][k]).abs().max()) for k in states[0]) < 1e-4


def test_the_mismatch_by_staleness_is_the_hand_computed_mean_per_lag(tiny_path):
    """`mismatch/abs_diff_lag{k}`: mean |π_old − μ| over the action tokens sampled k versions ago (the sums are
    kept on the device through the micro-batches and read once), checked against the same mean by hand."""
    actor = ActorWorker(tiny_path, OptimConfig(learning_rate=1e-3, micro_batch_tokens=40),
                        AlgorithmConfig(use_reference=False), temperature=1.0)
    samples = batch()
    olds = split_per_sample(samples, actor.compute_logprobs(samples)["old_logprobs"])
    g = torch.Generator().manual_seed(3)
    by_lag: dict[int, list[float]] = {}
    for s, old in zip(samples, olds):
        mask = torch.tensor(s["loss_mask"], dtype=torch.float32)
        shift = 0.05 * torch.randn(len(old), generator=g)  # μ: π_old off by a little (a stale or rounded engine)
        lag = torch.randint(0, 3, (len(old),), generator=g).float() * mask
        s.update(old_logprobs=old, rollout_logprobs=old + shift, advantages=list(s["loss_mask"]), staleness=lag)
        for k, d, m in zip(lag.tolist(), shift.abs().tolist(), mask.tolist()):
            if m:
                by_lag.setdefault(int(k), []).append(d)
    metrics = actor.train_step(samples)
    for k, diffs in by_lag.items():
        assert metrics[f"mismatch/abs_diff_lag{k}"] == pytest.approx(sum(diffs) / len(diffs), rel=1e-4)
    assert "mismatch/abs_diff_lag3" not in metrics  # no token lags three versions


def test_host_floats_reads_tensors_and_floats_in_order():
    from models.deepspeed_worker import host_floats

    values = [1.5, torch.tensor(2.25, dtype=torch.float64), torch.tensor([0.1], dtype=torch.float32), 3]
    assert host_floats(values) == [1.5, 2.25, float(torch.tensor(0.1)), 3.0]
    assert host_floats([0.0, 2]) == [0.0, 2.0]
