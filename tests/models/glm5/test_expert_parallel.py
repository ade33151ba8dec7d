"""Expert parallelism of GLM-5.2's MoE layer (models/glm5/expert_parallel.py) against the whole layer on one
process: two and four gloo ranks, each with its own tokens and 1/E of the experts, give every rank the outputs and
input gradients the whole layer gives its tokens, and each expert the gradient the whole layer gives it from all
tokens — with experts that receive no token from some rank, or from any rank, and with the loop and the grouped
GEMMs."""

from __future__ import annotations

import pickle

import pytest
import torch

from models.glm5.config import Glm5Config
from models.glm5.moe import MoE
from models.glm5.tiny import TINY_CONFIG
from models.deepspeed_worker import free_port
from tests.ranks import spawn

TOKENS = 5


def _layer(impl: str) -> tuple[MoE, Glm5Config]:
    config = Glm5Config(vocab_size=256, **{**TINY_CONFIG, "moe_impl": impl})
    torch.manual_seed(0)
    moe = MoE(config)
    torch.nn.init.normal_(moe.gate.weight, std=0.5)
    return moe, config


def _inputs(rank: int, config: Glm5Config) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank r's tokens and the experts they are made to use (replayed): rank 0 uses experts 0-1 only, so experts
    2-7 get nothing from it; rank 1 uses 0 and 5; the others spread. Experts 2, 3 get no token from anyone."""
    g = torch.Generator().manual_seed(10 + rank)
    x = torch.randn(1, TOKENS, config.hidden_size, generator=g)
    choices = {0: [0, 1], 1: [0, 5]}.get(rank)
    if choices is None:
        experts = torch.tensor([[4, 5], [6, 7], [1, 4], [7, 6], [5, 0]])[None]
    else:
        experts = torch.tensor([choices] * TOKENS)[None]
    return x, experts


def _run_rank(rank: int, world: int, ep: int, impl: str, port: int, out: str) -> None:
    import deepspeed

    from models.glm5.expert_parallel import shard_experts
    from models.deepspeed_worker import DistEnv, init_distributed

    torch.set_num_threads(1)
    init_distributed(DistEnv(rank=rank, world_size=world, master_port=port))
    moe, config = _layer(impl)
    shard_experts(moe_holder := torch.nn.ModuleDict({"mlp": moe}), ep)
    x, experts = _inputs(rank, config)
    x.requires_grad_(True)
    y, ids = moe(x, experts)
    y.square().sum().backward()
    grads = {n: p.grad for n, p in moe_holder.named_parameters() if p.grad is not None}
    result = {"y": y.detach(), "x_grad": x.grad, "ids": ids, "grads": grads,
              "names": {n: list(p.shape) for n, p in moe_holder.named_parameters()}}
    parts = [None] * world
    torch.distributed.all_gather_object(parts, result)
    if rank == 0:
        with open(out, "wb") as f:
            pickle.dump(parts, f)
    deepspeed.comm.barrier()
    torch.distributed.destroy_process_group()


@pytest.mark.parametrize("world,ep,impl", [(2, 2, "loop"), (4, 2, "loop"), (4, 4, "grouped")])
def test_expert_parallel_layer_equals_the_whole_layer(world, ep, impl, tmp_path):
    out = str(tmp_path / "ranks.pkl")
    spawn(_run_rank, (world, ep, impl, free_port(), out), world)
    with open(out, "rb") as f:
        ranks = pickle.load(f)
    moe, config = _layer(impl)
    xs = [_inputs(r, config) for r in range(world)]
    whole_grads = {}
    for r, (x, experts) in enumerate(xs):  # the whole layer, rank by rank; gradients summed over the ranks
        x = x.clone().requires_grad_(True)
        moe.zero_grad(set_to_none=True)
        y, ids = moe(x, experts)
        y.square().sum().backward()
        torch.testing.assert_close(ranks[r]["y"], y.detach(), rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(ranks[r]["x_grad"], x.grad, rtol=1e-5, atol=1e-6)
        assert torch.equal(ranks[r]["ids"], ids)
        for n, p in moe.named_parameters():
            if p.grad is not None:
                whole_grads[n] = whole_grads.get(n, 0) + p.grad
    n_local = config.n_routed_experts // ep
    for r, rank in enumerate(ranks):
        prefix = "mlp.experts.deepspeed_moe.experts.deepspeed_experts."
        local = sorted({int(n[len(prefix):].split(".")[0]) for n in rank["names"] if n.startswith(prefix)})
        assert local == list(range(n_local))  # each rank holds n / E experts
        for name, grad in rank["grads"].items():
            if name.startswith(prefix):
                j, rest = name[len(prefix):].split(".", 1)
                e = (r % ep) * n_local + int(j)
                ref = whole_grads.get(f"experts.{e}.{rest}")
                if ref is None:  # an expert no rank routed to: no gradient, or a zero one
                    assert not grad.any()
                else:  # one rank's share of the expert's gradient: its expert group's tokens only
                    group = range(r // ep * ep, r // ep * ep + ep)
                    part = _group_grad(moe, xs, group, f"experts.{e}.{rest}")
                    torch.testing.assert_close(grad, part, rtol=1e-5, atol=1e-6)
            else:  # data-parallel weights: this rank's own tokens
                assert name.startswith("mlp.") and not name.startswith("mlp.experts.")
    assert {2, 3}.isdisjoint(ranks[0]["ids"].flatten().tolist())


def _group_grad(moe: MoE, xs: list, group, name: str) -> torch.Tensor:
    """The whole layer's gradient of `name` from the tokens of the ranks in `group` (before any data-parallel
    reduction, which DeepSpeed does over the ranks holding the same experts)."""
    total = 0
    params = dict(moe.named_parameters())
    for r in group:
        x, experts = xs[r]
        moe.zero_grad(set_to_none=True)
        y, _ = moe(x, experts)
        y.square().sum().backward()
        if params[name].grad is not None:
            total = total + params[name].grad
    return total if torch.is_tensor(total) else torch.zeros_like(params[name])
