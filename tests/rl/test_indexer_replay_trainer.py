"""Margin-gated indexer replay end to end on the CPU (glm52-tiny, fp32): the LocalEngine's rows under the margin
go through the ledger and the segment into the samples, are placed in packed or padded micro-batches, and the
trainer's forward (policy_logprobs, the ActorWorker's π_old and update) replays them, so that a trainer whose
indexer rounds differently still computes the logprobs the engine sampled with."""

import asyncio
import copy

import numpy as np
import pytest
import torch

from models import policy_logprobs
from models.batching import make_micro_batches
from models.deepspeed_worker import OptimConfig
from rl.actor import ActorWorker
from rl.batch import replay_metrics, to_samples
from rl.config import AlgorithmConfig
from rollout.ledger import TokenLedger
from rollout.local_engine import LocalEngine
from rollout.types import SamplingParams, Trajectory

TAU = 3e-4  # above twice the score error a 0.1% indexer perturbation makes here (1e-4 is not, for one row)


def perturbed_indexer(model, scale: float = 1e-3):
    """A copy whose indexer weights are off by `scale` (relative), as another implementation's rounding may be."""
    other = copy.deepcopy(model)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in other.named_parameters():
            if ".indexer." in name and "norm" not in name:
                p.mul_(1 + scale * torch.randn(p.shape, generator=g))
    return other


@pytest.fixture(scope="module")
def trajectories(glm52_policy):
    """Four two-turn episodes through the ledger, as the agent runs them (a closing context the engine never ran)."""
    engine = LocalEngine(glm52_policy, max_batch_size=8, indexer_replay_margin=TAU)
    g = torch.Generator().manual_seed(0)

    async def one(i: int) -> Trajectory:
        ledger = TokenLedger()
        ledger.append_context(torch.randint(100, 4000, (14 + 6 * i,), generator=g).tolist())
        for turn in range(2):
            result = await engine.generate(ledger.ids, SamplingParams(max_new_tokens=14, seed=10 * i + turn,
                                                                      ignore_eos=True))
            ledger.append_output(result.output_ids, result.output_logprobs, result.versions(),
                                 indexer_rows=result.meta.pop("indexer_replay"))
            ledger.append_context(torch.randint(100, 4000, (5,), generator=g).tolist())
        return Trajectory(f"r{i}", f"t{i}", [ledger.to_segment(f"r{i}", 0, "final")], reward=1.0,
                          finish_reason="submitted")

    async def all_of_them():
        return await asyncio.gather(*(one(i) for i in range(4)))

    try:
        return asyncio.run(all_of_them())
    finally:
        engine.close()


def max_diff(model, samples, replay: bool, packed: bool) -> float:
    """max |trainer logprob − engine logprob| over the action tokens."""
    fields = ("loss_mask", "rollout_logprobs") + (("indexer_replay",) if replay else ())
    worst = 0.0
    with torch.no_grad():
        for mb in make_micro_batches(samples, fields, max_tokens=200, packed=packed):
            t = mb.tensors
            assert (mb.indexer_rows is not None) == replay  # sparse: the micro-batch holds its samples' rows only
            if replay:
                shipped = [s["indexer_replay"] for s in (samples[i] for i in mb.indices)]
                assert len(mb.indexer_rows) == sum(len(r["positions"]) for r in shipped)
            logp, _ = policy_logprobs(model, t["input_ids"], t["attention_mask"], only=t["loss_mask"],
                                      position_ids=mb.position_ids, indexer_topk=mb.indexer_topk())
            worst = max(worst, float(((logp - t["rollout_logprobs"]).abs() * t["loss_mask"]).max()))
    return worst


def test_the_segments_carry_each_positions_rows_from_the_first_generation_that_ran_it(trajectories, glm52_policy):
    k = glm52_policy.config.index_topk
    for traj in trajectories:
        seg = traj.segments[0]
        rows = seg.replay["indexer_replay"]
        last_run = len(seg.token_ids) - 5 - 1  # the closing observation and the last sampled token never ran
        assert len(rows["positions"]) > 0 and rows["keys"].dtype == np.int32 and rows["keys"].shape[1] == k
        assert ((rows["positions"] >= k) & (rows["positions"] < last_run)).all()
        assert (rows["keys"] <= rows["positions"][:, None]).all()
    samples = to_samples(trajectories)
    assert all(s["indexer_replay"] is t.segments[0].replay["indexer_replay"] for s, t in zip(samples, trajectories))
    m = replay_metrics(samples)
    tokens = sum(len(s["token_ids"]) for s in samples)
    rows = sum(len(t.segments[0].replay["indexer_replay"]["positions"]) for t in trajectories)
    assert m["replay/indexer_rows_per_token"] == pytest.approx(rows / tokens)
    assert m["replay/indexer_bytes_per_token"] == pytest.approx(rows * (4 + 2 + 4 * k) / tokens)
    assert "replay/tokens_replayed_frac" not in m  # no expert routing was asked for


@pytest.mark.parametrize("packed", [True, False])
def test_replaying_the_rows_gives_a_differently_rounding_trainer_the_engines_logprobs(trajectories, glm52_policy,
                                                                                      packed):
    samples = to_samples(trajectories)
    assert max_diff(glm52_policy, samples, replay=True, packed=packed) < 1e-5
    other = perturbed_indexer(glm52_policy)
    assert max_diff(other, samples, replay=False, packed=packed) > 1e-3
    assert max_diff(other, samples, replay=True, packed=packed) < 1e-5


def test_the_actor_replays_the_rows_in_its_logprob_pass_and_its_update(trajectories, glm52_path):
    samples = to_samples(trajectories)
    worker = ActorWorker(glm52_path, OptimConfig(learning_rate=1e-3, micro_batch_tokens=150),
                         AlgorithmConfig(use_reference=False), temperature=1.0)
    worker.engine.module.load_state_dict(perturbed_indexer(worker.module).state_dict())
    masks = [s["loss_mask"] > 0 for s in samples]

    def worst(flat):
        per = torch.split(flat, [len(s["token_ids"]) for s in samples])
        return float(torch.cat([v[m] - s["rollout_logprobs"][m] for v, s, m in zip(per, samples, masks)]).abs().max())

    assert worst(worker.compute_logprobs(samples)["old_logprobs"]) < 1e-5
    plain = [{k: v for k, v in s.items() if k != "indexer_replay"} for s in samples]
    assert worst(worker.compute_logprobs(plain)["old_logprobs"]) > 1e-3
    for s in samples:
        s["advantages"] = s["loss_mask"].clone()
    metrics = worker.train_step(samples)  # one optimiser step: π_old is its own forward's, replayed
    assert metrics["mismatch/train_rollout_logprob_abs_diff"] < 1e-6
