"""Sequence parallelism through the GPU kernels, and the one-rank path free of collectives (skipped without a CUDA
GPU; tests/models/glm5/test_sequence_parallel.py and test_expert_parallel.py check the math on the CPU).

Two ranks share the one GPU over gloo (NCCL refuses two ranks on one device; gloo gathers and sums CUDA tensors
through the host): each runs its half of every row through the bf16 Triton kernels (the fused sparse MLA, the
indexer scores), and together they give the logprobs and gradients one process gives. At one rank, a training
forward and backward of GLM-5.2 with routed experts runs no collective at all (a profile of its operators)."""

from __future__ import annotations

import pickle

import pytest
import torch
import torch.multiprocessing as mp

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

T = 1024  # the indexer's top-k is 64: sparse from the 65th key on, through the fused kernel


def _model():
    from models.glm5.config import Glm5Config
    from models.glm5.tiny import KERNEL_CONFIG, build_random

    config = Glm5Config(**{**KERNEL_CONFIG, "num_hidden_layers": 4, "vocab_size": 4096, "masked_attn_max_keys": 0})
    return build_random(config, 0).to("cuda", torch.bfloat16)


def _batch():
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(2, 4096, (2, T), generator=g).cuda()
    mask = torch.ones(2, T, dtype=torch.long, device="cuda")
    mask[1, 900:] = 0
    return ids, mask


def _step(model, sequence=None):
    from models import policy_logprobs

    ids, mask = _batch()
    model.zero_grad(set_to_none=True)
    logp, _ = policy_logprobs(model, ids, mask, only=mask, sequence=sequence)
    own = mask.bool() if sequence is None else mask.bool() & sequence.owned(T, mask.device)
    logp[own].sum().backward()
    return logp.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def _rank(rank: int, port: int, out: str) -> None:
    import os

    from models.glm5.sequence_parallel import SequenceShard

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.distributed.init_process_group("gloo", rank=rank, world_size=2)
    shard = SequenceShard(torch.distributed.group.WORLD, rank, 2, T)
    model = _model()
    logp, grads = _step(model, shard)
    logp = shard.combine(logp)
    names = [None, None]
    torch.distributed.all_gather_object(names, sorted(grads))
    params = dict(model.named_parameters())
    summed = {}
    for name in sorted(set().union(*names)):
        g = grads.get(name, torch.zeros_like(params[name])).float()
        torch.distributed.all_reduce(g)
        summed[name] = g.cpu()
    if rank == 0:
        with open(out, "wb") as f:
            pickle.dump({"logp": logp.cpu(), "grads": summed}, f)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def test_sequence_parallel_through_the_gpu_kernels_equals_one_process(tmp_path):
    from models.deepspeed_worker import free_port

    out = str(tmp_path / "sp.pkl")
    mp.spawn(_rank, args=(free_port(), out), nprocs=2, join=True)
    with open(out, "rb") as f:
        got = pickle.load(f)
    logp, grads = _step(_model())
    ids, mask = _batch()
    real = mask.bool().cpu()
    real[:, 0] = False
    diff = (got["logp"] - logp.cpu())[real].abs()
    assert float(diff.mean()) < 0.02 and float(diff.max()) < 0.3  # bf16 kernels on other shapes (as packed vs padded)
    one = torch.cat([grads[n].float().flatten().cpu() for n in sorted(grads)])
    two = torch.cat([got["grads"][n].flatten() for n in sorted(grads)])
    assert float(torch.nn.functional.cosine_similarity(one, two, dim=0)) > 0.99


def test_one_rank_runs_no_collective():
    """E = S = 1: the MoE layer calls its experts and attention reads its own keys; no all-to-all, gather or
    reduction appears among a training step's operators."""
    from torch.profiler import ProfilerActivity, profile

    model = _model()
    _step(model)  # warm-up (Triton compiles)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        _step(model)
    names = {e.key for e in prof.key_averages()}
    assert any("grouped_mm" in n or "mm" in n for n in names)  # the step ran its experts
    collectives = [n for n in names if any(c in n.lower() for c in ("c10d", "nccl", "all_to_all", "allgather",
                                                                     "all_gather", "allreduce", "all_reduce"))]
    assert collectives == []
