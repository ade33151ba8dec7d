"""Sequence parallelism of GLM-5.2 (models/glm5/sequence_parallel.py) against one process: S = 2 and 4 gloo ranks,
each running its chunk of every row, give the policy's logprobs and entropies, the critic's values and every
parameter's gradient that one process gives on the whole rows — with the sequence four times longer than the
indexer's top-k (the sparse path, IndexShare's shared layers following their full layer) and longer than one
rank's share, on right-padded rows and on packed rows (two samples end to end)."""

from __future__ import annotations

import pickle

import pytest
import torch

from models.glm5.config import Glm5Config
from models.glm5.tiny import TINY_CONFIG, build_random
from models.deepspeed_worker import free_port
from tests.ranks import spawn

T = 64  # positions per row; index_topk 16: every layer past the first 16 keys is sparse


def _models():
    config = Glm5Config(vocab_size=256, **TINY_CONFIG)
    policy = build_random(config, seed=3)
    from models.glm5.model import Glm5ForValue

    torch.manual_seed(4)
    critic = Glm5ForValue(config)
    torch.nn.init.normal_(critic.score.weight, std=0.5)
    critic.load_state_dict(policy.state_dict(), strict=False)  # the same backbone, a live value head
    return policy, critic


def _batch(packed: bool):
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, 256, (2, T), generator=g)
    mask = torch.ones(2, T, dtype=torch.long)
    mask[1, 41:] = 0  # right padding
    positions = None
    if packed:  # row 0: samples of 27 and 37 tokens; row 1: 50 tokens then padding
        positions = torch.cat([torch.arange(27), torch.arange(37)])[None].repeat(2, 1)
        positions[1] = torch.cat([torch.arange(50), torch.zeros(14, dtype=torch.long)])
        mask[1] = (torch.arange(T) < 50).long()
    weights = torch.randn(2, T, generator=g)  # a per-token weighting, like advantages
    return ids, mask, positions, weights


def _run(policy, critic, packed: bool, sequence=None):
    from models.logprobs import policy_logprobs, token_values

    ids, mask, positions, weights = _batch(packed)
    for m in (policy, critic):
        m.zero_grad(set_to_none=True)
    logp, ent = policy_logprobs(policy, ids, mask, with_entropy=True, only=mask, position_ids=positions,
                                sequence=sequence)
    values = token_values(critic, ids, mask, positions, sequence=sequence)
    own = mask.bool() if sequence is None else mask.bool() & sequence.owned(T)
    loss = (logp * weights)[own].sum() + (ent * weights)[own].sum() * 0.1 + ((values - weights) ** 2)[own].sum()
    loss.backward()
    grads = {f"{tag}.{n}": p.grad.clone() for tag, m in (("policy", policy), ("critic", critic))
             for n, p in m.named_parameters() if p.grad is not None}
    return logp.detach(), ent.detach(), values.detach(), grads


def _rank(rank: int, world: int, packed: bool, port: int, out: str) -> None:
    from models.glm5.sequence_parallel import SequenceShard
    from models.deepspeed_worker import DistEnv, init_distributed

    torch.set_num_threads(1)
    init_distributed(DistEnv(rank=rank, world_size=world, master_port=port))
    shard = SequenceShard(torch.distributed.group.WORLD, rank, world, T)
    policy, critic = _models()
    logp, ent, values, grads = _run(policy, critic, packed, shard)
    logp, ent, values = shard.combine(logp), shard.combine(ent), shard.combine(values)
    present = [None] * world  # an expert no token of this rank chose has no gradient here
    torch.distributed.all_gather_object(present, sorted(grads))
    params = {f"{tag}.{n}": p for tag, m in (("policy", policy), ("critic", critic)) for n, p in m.named_parameters()}
    for name in sorted(set().union(*present)):  # what the data-parallel reduction does with them
        grads.setdefault(name, torch.zeros_like(params[name]))
        torch.distributed.all_reduce(grads[name])
    if rank == 0:
        with open(out, "wb") as f:
            pickle.dump({"logp": logp, "ent": ent, "values": values, "grads": grads}, f)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


@pytest.mark.parametrize("world,packed", [(2, False), (4, True), (4, False)])
def test_sequence_parallel_equals_one_process(world, packed, tmp_path):
    out = str(tmp_path / "sp.pkl")
    spawn(_rank, (world, packed, free_port(), out), world)
    with open(out, "rb") as f:
        got = pickle.load(f)
    policy, critic = _models()
    logp, ent, values, grads = _run(policy, critic, packed)
    ids, mask, positions, _ = _batch(packed)
    real = mask.bool()
    real[:, 0] = False  # position 0 predicts nothing
    assert logp[real].abs().min() > 0  # every real position was scored
    torch.testing.assert_close(got["logp"], logp, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got["ent"], ent, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got["values"], values, rtol=1e-5, atol=1e-5)
    assert sorted(got["grads"]) == sorted(grads) and len(grads) > 50
    for name, ref in grads.items():  # fp32 sums in another order: tolerance relative to the tensor's scale
        scale = float(ref.abs().max())
        torch.testing.assert_close(got["grads"][name], ref, rtol=1e-4, atol=1e-4 * scale + 1e-8,
                                   msg=lambda m: f"{name}: {m}")
    # the sparse path was taken: a full layer's selection is a strict subset of its causal keys
    with torch.no_grad():
        from models.logprobs import _mask_and_positions

        out = policy.model(input_ids=ids, **_mask_and_positions(mask, positions), use_cache=False,
                           return_routing=True)
    full = min(out.indexer_topk)
    assert out.indexer_topk[full].shape[-1] == 16 and T > 16 * 2
