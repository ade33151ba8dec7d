"""N data-parallel ranks train exactly like one rank (CPU, gloo): the actor's PPO step and the critic's value step
over the same global batch, sharded by tokens, give the same loss, gradient norm and updated weights.

Each world runs in processes of its own (torch.multiprocessing), the ranks of one world talking over gloo."""

from __future__ import annotations

import faulthandler
import pickle

import numpy as np
import pytest
import torch

from models.batching import shard_by_tokens
from models.deepspeed_worker import DistEnv, OptimConfig, free_port
from tests.ranks import spawn


def global_batch(n: int = 7, equal: bool = False, replay: bool = False, late: bool = False) -> list[dict]:
    """`equal`: every sample 48 tokens, so that no rank pads its micro-batches wider than one rank does (right
    padding moves GLM-5.2's hidden states by ~1e-6, enough to flip a near-tied expert or indexer choice).
    `replay`: routed experts as an engine reports them for glm52-tiny (8 layers, the first 2 dense: −1, 2 of 8
    experts a token; the last 3 positions never ran: −1), and some indexer rows of its full layers (0, 1, 2, 6). `late`: 30 prompt tokens, so that under sequence
    parallelism of two a sample's first chunk predicts nothing the loss takes."""
    g = torch.Generator().manual_seed(1)
    out = []
    for i in range(n):
        length = 48 if equal else 20 + 9 * i
        ids = torch.randint(100, 4000, (length,), generator=g).tolist()
        prompt = 30 if late else 8
        mask = [0] * prompt + [1] * (length - prompt)
        logp = (-torch.rand(length, generator=g) * 3).tolist()  # the behaviour policy's logprobs
        out.append({"token_ids": ids, "loss_mask": mask, "rollout_logprobs": logp,
                    "advantages": [(1.0 if i % 2 else -0.5) * m for m in mask],
                    "returns": [0.8 * m * (1 + t / length) for t, m in enumerate(mask)], "old_values": [0.0] * length})
        if replay:
            experts = torch.stack([torch.randperm(8, generator=g)[:2] for _ in range(length * 8)])
            experts = experts.view(length, 8, 2).to(torch.int16)
            experts[:, :2] = -1
            experts[-3:] = -1
            out[-1]["routed_experts"] = experts
            # and a few indexer rows (positions past the top-k of 16, where there is a choice), kept sparse
            positions = torch.randint(16, length - 3, (6,), generator=g).unique()
            rows = [(p, layer, torch.randperm(p + 1, generator=g)[:16]) for p in positions.tolist()
                    for layer in (0, 2, 6)]
            out[-1]["indexer_replay"] = {"positions": np.array([r[0] for r in rows], np.int32),
                                         "layers": np.array([r[1] for r in rows], np.int16),
                                         "keys": np.stack([r[2].numpy() for r in rows]).astype(np.int32)}
    return out


def _rank(rank: int, world: int, port: int, model: str, role: str, zero: int, out: str, ep: int = 1,
          sp: int = 1) -> None:
    from critic.worker import CriticWorker
    from models import resolve_model_path
    from rl.actor import ActorWorker
    from rl.config import AlgorithmConfig

    faulthandler.enable(all_threads=True)  # a rank that aborts in C++ says where it was
    path = str(resolve_model_path(model))
    late = role == "actor-late"  # one sample a micro-batch: shards of 4 and 3 make a padding micro-batch
    optim = OptimConfig(learning_rate=1e-2, micro_batch_tokens=48 if late else 100, zero_stage=zero,
                        expert_parallel=ep, sequence_parallel=sp)
    dist = DistEnv(rank=rank, world_size=world, master_port=port)
    replay = role == "actor-replay"
    samples = global_batch(equal=model.startswith("glm52"), replay=replay, late=late)
    if replay:  # the engine sampled with the initial weights and these experts: μ is the replayed forward's
        for s, logp in zip(samples, _initial_logprobs(model, samples, replay=True)):
            s["rollout_logprobs"] = logp
    mine = [samples[i] for i in shard_by_tokens(samples, world // sp)[rank // sp]]  # a sequence group: one shard
    if role.startswith("actor"):
        # no mismatch masking: the made-up behaviour logprobs are far from the model's (TIS weights still apply)
        algo = AlgorithmConfig(use_reference=False, mask_low=0, mask_high=0, veto=0)
        worker = ActorWorker(path, optim, algo, temperature=1.0, torch_threads=1,
                             dist=dist)
        metrics = worker.train_step(mine)
    elif role == "sft":  # rl.sft's supervised step: the token-mean NLL of the masked tokens over all ranks
        worker = ActorWorker(path, optim, AlgorithmConfig(use_reference=False), torch_threads=1, dist=dist)
        metrics = worker.sft_step(mine)
        metrics.update({"actor/loss": metrics["sft/loss"], "actor/grad_norm": metrics["sft/grad_norm"]})
    else:
        worker = CriticWorker(path, optim, value_clip=0.2, torch_threads=1, dist=dist)
        metrics = worker.train_step(mine)
    state = worker.gathered_state()
    worker.close()
    if rank == 0:
        with open(out, "wb") as f:
            pickle.dump({"metrics": metrics, "state": state}, f)


def train_world(world: int, model: str, role: str, zero: int, tmp_path, ep: int = 1, sp: int = 1) -> dict:
    out = str(tmp_path / f"{role}-{model}-{world}-{zero}-{ep}-{sp}.pkl")
    spawn(_rank, (world, free_port(), model, role, zero, out, ep, sp), world)
    with open(out, "rb") as f:
        return pickle.load(f)


_ONE_RANK: dict[tuple[str, str], dict] = {}


def one_rank_reference(model: str, role: str, tmp_path_factory) -> dict:
    """One rank's step for (model, role): it depends on nothing else, so the parametrisations that share it
    train it once (a world of one costs a process start, a model load and a step)."""
    if (model, role) not in _ONE_RANK:
        _ONE_RANK[model, role] = train_world(1, model, role, 0, tmp_path_factory.mktemp("one-rank"))
    return _ONE_RANK[model, role]


def test_shards_balance_tokens():
    samples = [{"token_ids": [0] * n} for n in (50, 10, 40, 30, 20, 5)]
    shards = shard_by_tokens(samples, 2)
    assert sorted(i for s in shards for i in s) == list(range(6))
    loads = [sum(len(samples[i]["token_ids"]) for i in s) for s in shards]
    assert abs(loads[0] - loads[1]) <= 5  # 80 / 75
    assert shard_by_tokens(samples[:1], 3) == [[0], [], []]


@pytest.mark.parametrize("role,model,world,zero,ep,sp", [
    ("actor", "tiny-random", 2, 0, 1, 1), ("critic", "tiny-random", 2, 0, 1, 1), ("actor", "tiny-random", 4, 3, 1, 1),
    ("critic", "tiny-random", 4, 3, 1, 1), ("actor", "glm52-tiny", 2, 2, 1, 1), ("actor", "glm52-tiny", 2, 3, 1, 1),
    ("critic", "glm52-tiny", 2, 3, 1, 1), ("actor-replay", "glm52-tiny", 2, 3, 1, 1),
    # expert parallelism: E = 2 on 2 ranks, and on 4 (two expert groups, each expert on two ranks)
    ("actor", "glm52-tiny", 2, 1, 2, 1), ("critic", "glm52-tiny", 2, 2, 2, 1),
    ("actor-replay", "glm52-tiny", 4, 2, 2, 1),
    # sequence parallelism: S = 2 (48-token samples, 24 positions a rank, the indexer's top-k 16: sparse), with
    # ZeRO-3, and composed with data and expert parallelism on 4 ranks
    ("actor", "glm52-tiny", 2, 0, 1, 2), ("critic", "glm52-tiny", 2, 3, 1, 2),
    ("actor-replay", "glm52-tiny", 4, 2, 2, 2),
    # a chunk with nothing to predict, and a padding micro-batch, under ZeRO-3 (the LM head's calls stay in step)
    ("actor-late", "glm52-tiny", 4, 3, 1, 2),
    # the supervised cold start (rl.sft) on the same ranks, ZeRO-3
    ("sft", "tiny-random", 2, 3, 1, 1)])
def test_n_ranks_equal_one_rank(role, model, world, zero, ep, sp, tmp_path, tmp_path_factory):
    # The reference is one rank without ZeRO (plain DDP-free training), so a fault of a ZeRO stage itself shows
    # too (ZeRO-3 once kept only the last micro-batch's gradient, on one rank as on four).
    one = one_rank_reference(model, role, tmp_path_factory)
    many = train_world(world, model, role, zero, tmp_path, ep, sp)
    # actor-replay: the engine's routed experts and indexer rows replayed in every forward (packed rows, ZeRO,
    # expert and sequence chunks)
    prefix = "critic" if role == "critic" else "actor"
    loss = "critic/value_loss" if role == "critic" else "actor/loss"
    assert many["metrics"][loss] == pytest.approx(one["metrics"][loss], rel=1e-5, abs=1e-7)
    assert many["metrics"][f"{prefix}/grad_norm"] == pytest.approx(one["metrics"][f"{prefix}/grad_norm"], rel=1e-4)
    if role == "critic":
        for key in ("critic/explained_variance", "critic/value_mean", "critic/value_clipfrac"):
            assert many["metrics"][key] == pytest.approx(one["metrics"][key], rel=1e-5, abs=1e-7), key
    elif role != "sft":
        for key in ("actor/entropy", "mismatch/train_rollout_logprob_abs_diff"):
            assert many["metrics"][key] == pytest.approx(one["metrics"][key], rel=1e-5), key
    if role == "actor-replay":  # the workers replayed: their π_old is μ, which their own routing is not
        samples = global_batch(equal=True, replay=True)
        replayed = _initial_logprobs(model, samples, replay=True)
        own = _initial_logprobs(model, samples, replay=False)
        gap = max(max(abs(a - b) for a, b, m in zip(r, o, s["loss_mask"]) if m)
                  for r, o, s in zip(replayed, own, samples))
        assert gap > 1e-2 and one["metrics"]["mismatch/train_rollout_logprob_abs_diff"] < 1e-5
    a, b = one["state"], many["state"]
    assert a.keys() == b.keys() and len(a) > 0
    # Adam's first step is lr·g/(|g| + 1e-8), ~lr·sign(g): where |g| is near 1e-8, the fp32 noise of another
    # reduction order (~1e-10) moves an element by ~lr·Δg/4ε, up to a few 1e-4 on a handful of elements (seen at
    # 1.8e-4 in glm52-tiny's kv_b_proj under ZeRO-1, with or without experts split). A wrong gradient moves many
    # elements by up to 2·lr = 2e-2. So: nothing off by 1e-3, and at most one element in 10,000 off by 1e-4.
    diffs = {k: (a[k] - b[k]).abs() for k in a}
    worst, where = max((float(d.max()), k) for k, d in diffs.items())
    off = sum(int((d > 1e-4).sum()) for d in diffs.values()) / sum(d.numel() for d in diffs.values())
    assert worst < 1e-3 and off < 1e-4, (worst, where, off)
    from models import load_model

    initial = dict(load_model(model, "value" if role == "critic" else "policy").named_parameters())
    moved = max(float((a[k] - initial[k].detach()).abs().max()) for k in a if k in initial)
    assert moved > 5e-3 and moved > 5 * worst, (moved, worst)  # the step moved the weights: equality is not trivial


def _initial_logprobs(model: str, samples: list[dict], replay: bool) -> list[list[float]]:
    """The initial policy's logprobs of each sample's action tokens (0 elsewhere), with or without its replay."""
    from models import load_model, policy_logprobs
    from rollout.indexer_replay import model_replay

    policy = load_model(model, "policy").eval()
    out = []
    for s in samples:
        ids = torch.tensor([s["token_ids"]])
        mask = torch.tensor([s["loss_mask"]], dtype=torch.float32)
        with torch.no_grad():
            logp, _ = policy_logprobs(policy, ids, torch.ones_like(ids), only=mask,
                                      routed_experts=s["routed_experts"][None] if replay else None,
                                      indexer_topk=model_replay(s["indexer_replay"]) if replay else None)
        out.append(logp[0].tolist())
    return out


def _script(rank: int, world: int, port: int, model: str, role: str, zero: int, ops: list, out: str,
            ep: int = 1) -> None:
    """One world runs `ops` in order: ("step",) a train step on its shard of the global batch, ("save", folder),
    ("load", folder); rank 0 dumps the final weights."""
    from critic.worker import CriticWorker
    from models import resolve_model_path
    from rl.actor import ActorWorker
    from rl.config import AlgorithmConfig

    faulthandler.enable(all_threads=True)
    path = str(resolve_model_path(model))
    optim = OptimConfig(learning_rate=1e-2, micro_batch_tokens=100, zero_stage=zero, expert_parallel=ep)
    dist = DistEnv(rank=rank, world_size=world, master_port=port)
    if role == "actor":
        worker = ActorWorker(path, optim, AlgorithmConfig(use_reference=False, mask_low=0, mask_high=0, veto=0),
                             temperature=1.0, torch_threads=1, dist=dist)
    else:
        worker = CriticWorker(path, optim, value_clip=0.2, torch_threads=1, dist=dist)
    samples = global_batch()
    mine = [samples[i] for i in shard_by_tokens(samples, world)[rank]]
    for op, *args in ops:
        if op == "step":
            worker.train_step(mine)
        elif op == "save":
            worker.save(args[0])
        else:
            worker.load(args[0])
    state = worker.gathered_state()
    worker.close()
    if rank == 0:
        with open(out, "wb") as f:
            pickle.dump(state, f)


def run_script(world: int, model: str, role: str, zero: int, ops: list, out: str, ep: int = 1) -> dict:
    spawn(_script, (world, free_port(), model, role, zero, ops, out, ep), world)
    with open(out, "rb") as f:
        return pickle.load(f)


@pytest.mark.parametrize("role,zero,saved_on,resumed_on", [("actor", 2, 2, 1), ("critic", 3, 1, 2)])
def test_resume_on_another_rank_count_restores_weights_and_adam_moments(role, zero, saved_on, resumed_on, tmp_path):
    """A ZeRO-partitioned checkpoint from `saved_on` ranks resumes on `resumed_on` ranks (through DeepSpeed's
    universal checkpoint) and the next step lands where an uninterrupted run's does; starting the second step from
    the HF export instead (weights only, fresh Adam moments) lands elsewhere, so the comparison can fail."""
    ckpt = str(tmp_path / "ckpt")
    straight = run_script(1, "tiny-random", role, zero, [("step",), ("step",)], str(tmp_path / "a.pkl"))
    run_script(saved_on, "tiny-random", role, zero, [("step",), ("save", ckpt)], str(tmp_path / "b0.pkl"))
    resumed = run_script(resumed_on, "tiny-random", role, zero, [("load", ckpt), ("step",)], str(tmp_path / "b.pkl"))
    assert (tmp_path / "ckpt" / "state" / "universal" / "state" / ".complete").exists()  # converted once, kept
    worst = max(float((straight[k] - resumed[k]).abs().max()) for k in straight)
    assert worst < 1e-4, worst

    # the same second step from the weights alone (a fresh optimizer): Adam's moments made the difference
    from critic.worker import CriticWorker
    from rl.actor import ActorWorker
    from rl.config import AlgorithmConfig

    optim = OptimConfig(learning_rate=1e-2, micro_batch_tokens=100, zero_stage=0)
    hf = str(tmp_path / "ckpt" / "hf")
    worker = (ActorWorker(hf, optim, AlgorithmConfig(use_reference=False, mask_low=0, mask_high=0, veto=0),
                          temperature=1.0, torch_threads=1) if role == "actor"
              else CriticWorker(hf, optim, value_clip=0.2, torch_threads=1))
    worker.train_step(global_batch())
    fresh = worker.gathered_state()
    assert max(float((straight[k] - fresh[k]).abs().max()) for k in straight) > 100 * max(worst, 1e-7)


def test_expert_parallel_checkpoint_resumes_exactly_and_exports_every_expert(tmp_path):
    """E = 2 on 2 ranks: a checkpoint (DeepSpeed's per-expert files, each rank's ZeRO-2 partition) resumes into the
    step an uninterrupted run takes; its HF export holds every expert under its global name, equal to the
    gathered weights; resuming on another layout is refused with the way out."""
    from models import load_model

    ckpt = str(tmp_path / "ckpt")
    straight = run_script(2, "glm52-tiny", "actor", 2, [("step",), ("step",)], str(tmp_path / "a.pkl"), ep=2)
    saved = run_script(2, "glm52-tiny", "actor", 2, [("step",), ("save", ckpt)], str(tmp_path / "b0.pkl"), ep=2)
    resumed = run_script(2, "glm52-tiny", "actor", 2, [("load", ckpt), ("step",)], str(tmp_path / "b.pkl"), ep=2)
    worst = max(float((straight[k] - resumed[k]).abs().max()) for k in straight)
    assert worst < 1e-5, worst
    assert max(float((straight[k] - saved[k]).abs().max()) for k in straight) > 1e-3  # the second step moved them

    exported = dict(load_model(f"{ckpt}/hf", "policy").named_parameters())
    assert exported.keys() == saved.keys() and "model.layers.7.mlp.experts.7.down_proj.weight" in exported
    assert all(torch.equal(exported[k].detach(), saved[k]) for k in saved)

    with pytest.raises(Exception, match="expert_parallel=2"):  # the ValueError, re-raised by the spawned rank
        run_script(1, "glm52-tiny", "actor", 2, [("load", ckpt)], str(tmp_path / "c.pkl"))


def _stream_rank(rank: int, world: int, port: int, zero: int, folder: str, out: str) -> None:
    """Walk the shared weight stream of a `world`-rank actor; record, per bucket, the parameters that were
    gathered (whole) while it was yielded, and this rank's share; write the streamed HF export."""
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    from models import resolve_model_path
    from rl.actor import ActorWorker
    from rl.config import AlgorithmConfig

    worker = ActorWorker(str(resolve_model_path("tiny-random")), OptimConfig(zero_stage=zero),
                         AlgorithmConfig(use_reference=False), torch_threads=1,
                         dist=DistEnv(rank=rank, world_size=world, master_port=port))
    params = dict(worker.module.named_parameters())
    stream = worker.weight_stream(bucket_mb=0.05, shared=True)
    seen = []
    for index, bucket in enumerate(stream):
        whole = [n for n, p in params.items() if getattr(p, "ds_status", None) == ZeroParamStatus.AVAILABLE]
        seen.append({"index": index, "planned": stream.plan[index], "gathered": whole, "mine": bucket})
    written = worker.save_hf(folder)
    with open(f"{out}.{rank}", "wb") as f:
        pickle.dump({"seen": seen, "written": written, "buckets": len(stream)}, f)


def test_zero3_weight_stream_gathers_one_bucket_at_a_time_and_each_rank_keeps_its_share(tmp_path):
    """Weight sync and the HF export from ZeRO-3 shards: while a bucket is yielded only its own parameters are
    whole (never the whole model on a rank), bucket i is kept by rank i mod N, and together the shares are the
    model; the streamed HF export loads in transformers with the same weights."""
    world, out, folder = 2, str(tmp_path / "stream"), str(tmp_path / "hf")
    spawn(_stream_rank, (world, free_port(), 3, folder, out), world)
    ranks = []
    for r in range(world):
        with open(f"{out}.{r}", "rb") as f:
            ranks.append(pickle.load(f))
    assert ranks[0]["buckets"] > 3
    from models import load_model

    reference = dict(load_model("tiny-random", "policy").named_parameters())
    got = {}
    for r, result in enumerate(ranks):
        for b in result["seen"]:
            assert set(b["gathered"]) <= set(b["planned"]), b["index"]  # only this bucket is gathered
            assert bool(b["mine"]) == (b["index"] % world == r)
            got.update(b["mine"])
    assert got.keys() == reference.keys()
    assert all(torch.equal(got[k], reference[k].detach()) for k in got)
    assert ranks[0]["written"] > 0 and ranks[1]["written"] == 0
    from transformers import AutoModelForCausalLM

    loaded = dict(AutoModelForCausalLM.from_pretrained(folder).named_parameters())
    assert all(torch.equal(loaded[k].detach(), reference[k].detach()) for k in reference)
