"""Routed-expert replay end to end on the CPU (glm52-tiny, fp32): the LocalEngine reports the experts it routed
every position to, the ledger and the segment carry them, and the trainer's forward replays them, so that the
logprobs it trains on are the ones the engine sampled with."""

import asyncio
import copy

import numpy as np
import pytest
import torch

from models import policy_logprobs, resolve_model_path
from models.batching import make_micro_batches
from rl.actor import ActorWorker
from rl.batch import replay_metrics, to_samples
from rl.config import AlgorithmConfig
from models.deepspeed_worker import OptimConfig
from rollout.ledger import TokenLedger
from rollout.local_engine import LocalEngine
from rollout.types import SamplingParams, Trajectory

TURNS = 2
NEW_TOKENS = 24  # a context past the tiny model's indexer top-k (16): the sparse path runs


def perturbed_router(model, std: float = 0.5):
    """A copy whose routers pick other experts: the selection-only bias moves, the gates' weights do not (so the
    replayed forward must equal the engine's again)."""
    other = copy.deepcopy(model)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, buf in other.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.add_(torch.randn(buf.shape, generator=g) * std)
    return other


def episodes(model, n: int = 3, speculative: int = 0) -> list[Trajectory]:
    """n two-turn episodes through the ledger, as the agent runs them: prompt, generation, an observation,
    generation, a closing context the engine never ran."""
    engine = LocalEngine(model, max_batch_size=8, return_routed_experts=True, speculative_steps=speculative)
    g = torch.Generator().manual_seed(0)

    async def one(i: int) -> Trajectory:
        ledger = TokenLedger()
        ledger.append_context(torch.randint(100, 5000, (10 + 7 * i,), generator=g).tolist())
        for turn in range(TURNS):
            result = await engine.generate(ledger.ids, SamplingParams(max_new_tokens=NEW_TOKENS, seed=10 * i + turn,
                                                                      ignore_eos=True))
            assert result.meta["routed_experts"].shape[0] == len(ledger) + len(result.output_ids) - 1
            ledger.append_output(result.output_ids, result.output_logprobs, result.versions(),
                                 routing=result.meta.pop("routed_experts"))
            ledger.append_context(torch.randint(100, 5000, (5,), generator=g).tolist())
        segment = ledger.to_segment(f"r{i}", 0, "final")
        return Trajectory(f"r{i}", f"t{i}", [segment], reward=1.0, finish_reason="submitted")

    async def all_of_them():
        return await asyncio.gather(*(one(i) for i in range(n)))

    try:
        return asyncio.run(all_of_them())
    finally:
        engine.close()


@pytest.fixture(scope="module")
def trajectories(glm52_policy):
    return episodes(glm52_policy)


def max_diff(model, samples, replay: bool, packed: bool) -> float:
    """max |trainer logprob − engine logprob| over the action tokens."""
    fields = ("loss_mask", "rollout_logprobs") + (("routed_experts",) if replay else ())
    worst = 0.0
    with torch.no_grad():
        for mb in make_micro_batches(samples, fields, max_tokens=200, packed=packed):
            t = mb.tensors
            logp, _ = policy_logprobs(model, t["input_ids"], t["attention_mask"], only=t["loss_mask"],
                                      position_ids=mb.position_ids, routed_experts=t.get("routed_experts"))
            diff = ((logp - t["rollout_logprobs"]).abs() * t["loss_mask"]).max()
            worst = max(worst, float(diff))
    return worst


def test_the_segment_carries_the_engines_routing(trajectories, glm52_policy):
    """Every position but those after the last generation has its experts: the MoE layers' from the engine (equal
    to a full forward's routing of the finished sequence), −1 in the dense layers and in the closing context."""
    config = glm52_policy.config
    for traj in trajectories:
        seg = traj.segments[0]
        routing = seg.replay["routed_experts"]
        n = len(seg.token_ids)
        assert routing.dtype == np.int16 and routing.shape == (n, config.num_hidden_layers,
                                                               config.num_experts_per_tok)
        last_run = n - 5 - 1  # the closing observation (5 tokens) and the last sampled token were never run
        assert (routing[last_run:] == -1).all() and (routing[:last_run] >= 0).flatten().any()
        dense = [i for i, kind in enumerate(config.mlp_layer_types) if kind == "dense"]
        moe = [i for i, kind in enumerate(config.mlp_layer_types) if kind == "sparse"]
        assert (routing[:, dense] == -1).all() and (routing[:last_run, moe] >= 0).all()
        with torch.no_grad():
            out = glm52_policy(input_ids=torch.tensor([seg.token_ids[:last_run]]), return_routing=True,
                               use_cache=False, logits_to_keep=1)
        for layer in moe:
            own = out.routed_experts[layer][0].sort(-1).values
            engine = torch.from_numpy(routing[:last_run, layer].astype(np.int64)).sort(-1).values
            assert (own == engine).all(-1).float().mean() > 0.99  # a near-tie may flip between batch shapes


@pytest.mark.parametrize("packed", [True, False])
def test_replay_makes_the_trainer_forward_the_engines(trajectories, glm52_policy, packed):
    """Same weights: replayed logprobs equal the engine's (1e-5). A trainer whose routers choose otherwise differs
    without replay and equals the engine again with it."""
    samples = to_samples(trajectories)
    assert max_diff(glm52_policy, samples, replay=True, packed=packed) < 1e-5
    other = perturbed_router(glm52_policy)
    assert max_diff(other, samples, replay=False, packed=packed) > 1e-2
    assert max_diff(other, samples, replay=True, packed=packed) < 1e-5


def test_speculative_decoding_reports_the_routing_of_what_it_kept(glm52_policy):
    """MTP drafts the verify forward rejects are not positions of the sequence: only the kept ones' routing is
    reported, and replay still reproduces the engine's logprobs."""
    trajs = episodes(glm52_policy, n=2, speculative=2)
    samples = to_samples(trajs)
    assert max_diff(perturbed_router(glm52_policy), samples, replay=True, packed=True) < 1e-5


def test_samples_and_metrics(trajectories):
    """A segment without routing (another engine) gets −1 rows; the replayed fraction counts the positions the
    trained logprobs depend on."""
    trajs = copy.deepcopy(trajectories)
    trajs[0].segments[0].replay = None
    samples = to_samples(trajs)
    assert (samples[0]["routed_experts"] == -1).all() and samples[0]["routed_experts"].dtype == torch.int16
    m = replay_metrics(samples)
    last = [int(s["loss_mask"].nonzero()[-1]) for s in samples]
    assert m["replay/tokens_replayed_frac"] == pytest.approx(sum(last[1:]) / sum(last))
    assert m["replay/bytes_per_token"] == 2 * samples[1]["routed_experts"][0].numel()
    assert replay_metrics(to_samples(trajs[:1])) == {}  # no segment with routing: no replay at all
    assert "routed_experts" not in to_samples(trajs[:1])[0]


def test_the_actor_replays_in_its_logprob_pass_and_its_update(trajectories, glm52_path):
    """ActorWorker under DeepSpeed with a perturbed router: π_old (and π_ref) from compute_logprobs, and the
    update's own forward, equal the engine's logprobs only with the routing replayed."""
    samples = to_samples(trajectories)
    worker = ActorWorker(glm52_path, OptimConfig(learning_rate=1e-3, micro_batch_tokens=150),
                         AlgorithmConfig(use_reference=True), temperature=1.0)
    worker.reference = perturbed_router(worker.reference)
    worker.engine.module.load_state_dict(perturbed_router(worker.module).state_dict())
    masks = [s["loss_mask"] > 0 for s in samples]

    def worst(out, key):
        per = [v[m] - s["rollout_logprobs"][m] for v, s, m in zip(worker_split(out[key]), samples, masks)]
        return float(torch.cat(per).abs().max())

    def worker_split(flat):
        return list(torch.split(flat, [len(s["token_ids"]) for s in samples]))

    replayed = worker.compute_logprobs(samples)
    assert worst(replayed, "old_logprobs") < 1e-5 and worst(replayed, "ref_logprobs") < 1e-5
    plain = worker.compute_logprobs([{k: v for k, v in s.items() if k != "routed_experts"} for s in samples])
    assert worst(plain, "old_logprobs") > 1e-2 and worst(plain, "ref_logprobs") > 1e-2
    for s, ref in zip(samples, worker_split(replayed["ref_logprobs"])):
        s.update(advantages=s["loss_mask"].clone(), ref_logprobs=ref)
    metrics = worker.train_step(samples)  # one optimiser step: π_old is its own forward's, replayed
    assert metrics["mismatch/train_rollout_logprob_abs_diff"] < 1e-6


def test_sglang_routing_reaches_the_trainer(glm52_path, glm52_policy, tmp_path):
    """engine=sglang: `engine.return_routed_experts` starts the servers with --enable-return-routed-experts, the
    client decodes SGLang's base64 int32 routing, and the trainer replays it (a server speaking SGLang's HTTP,
    tests/fakes/sglang_server.py, generating with the same model)."""
    import sys
    from pathlib import Path

    from rollout.config import EngineConfig, SGLangConfig
    from rollout.sglang.fleet import SGLangFleet
    from rollout.worker import make_sglang_engine

    fake = [sys.executable, str(Path(__file__).resolve().parents[1] / "fakes" / "sglang_server.py")]
    cfg = EngineConfig(type="sglang", return_routed_experts=True,
                       sglang=SGLangConfig(launch_command=fake, router="off", startup_timeout_s=120))
    assert cfg.server_config().args == {"enable-return-routed-experts": True, "cuda-graph-max-bs-decode": 40}
    fleet = SGLangFleet(cfg.server_config(), glm52_path, log_dir=str(tmp_path), use_ray=False)
    fleet.start()
    try:
        async def go():
            engine = make_sglang_engine(glm52_path, cfg, {"urls": fleet.urls})
            try:
                ledger = TokenLedger()
                ledger.append_context(list(range(200, 230)))
                for turn in range(TURNS):
                    result = await engine.generate(ledger.ids, SamplingParams(max_new_tokens=NEW_TOKENS, seed=turn,
                                                                              ignore_eos=True))
                    ledger.append_output(result.output_ids, result.output_logprobs, result.versions(),
                                         routing=result.meta.pop("routed_experts"))
                    ledger.append_context(list(range(300, 305)))
                return ledger.to_segment("s0", 0, "final")
            finally:
                await engine.close()

        segment = asyncio.run(go())
    finally:
        fleet.stop()
    assert segment.replay["routed_experts"].shape[1:] == (glm52_policy.config.num_hidden_layers,
                                                          glm52_policy.config.num_experts_per_tok)
    samples = to_samples([Trajectory("s0", "t0", [segment])])
    assert max_diff(perturbed_router(glm52_policy), samples, replay=True, packed=True) < 1e-5


def test_replay_is_refused_by_a_model_that_cannot_take_it_and_filled_where_missing(tiny_model, trajectories):
    """transformers' models take **kwargs and would drop the replay without a word: refused instead. Samples of
    which only some carry routing (per-trajectory batches) become one batch with −1 rows for the others."""
    from models.batching import as_token_batch

    ids = torch.tensor([[5, 6, 7, 8]])
    with pytest.raises(ValueError, match="no routed-expert replay"):
        policy_logprobs(tiny_model, ids, torch.ones_like(ids), routed_experts=torch.zeros(1, 4, 2, 2))
    with_routing = to_samples(trajectories[:1])
    without = [{k: v for k, v in s.items() if k != "routed_experts"} for s in to_samples(trajectories[1:2])]
    batch = as_token_batch(with_routing + without, ("loss_mask", "routed_experts"))
    assert batch.has("routed_experts") and (batch.sample(1, "routed_experts") == -1).all()
    assert (batch.sample(0, "routed_experts") == with_routing[0]["routed_experts"]).all()


def test_the_actor_and_its_reference_load_with_the_trainer_overrides():
    """model.trainer_overrides (rl.config) reach the policy and the reference of the ActorWorker."""
    from models.glm5.indexer import Indexer

    worker = ActorWorker(str(resolve_model_path("glm52-tiny")), OptimConfig(learning_rate=1e-3),
                         AlgorithmConfig(use_reference=True), torch_threads=1, model_overrides={"indexer_fp8": True})
    for model in (worker.module, worker.reference):
        indexers = [m for m in model.modules() if isinstance(m, Indexer)]
        assert indexers and all(m.fp8 for m in indexers)
