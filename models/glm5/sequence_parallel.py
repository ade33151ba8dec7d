"""Sequence parallelism for GLM-5.2: one sequence split over the S ranks of a group, each running its own chunk of
queries through the whole model, the attention reading every rank's keys.

Rank r of the group holds positions [r·c, (r+1)·c) of every row (c = T / S; the caller pads T to a multiple of S)
and runs embeddings, projections, MoE, norms and the head on those tokens alone. Attention is where the chunks
meet: MLA's keys and values are one 576-wide latent per token shared by every head ([c_kv ; k_r]), and the DSA
indexer's keys are one 128-wide vector per token, so each layer all-gathers those two along the sequence and
every rank attends its own queries, all heads, over the whole key axis, exactly as a decode step attends new
queries over a KV cache (`SequenceShard` is handed to the model as its cache). Causality, padding and packed rows
are bounded by the queries' global key indices, as with a cache. The backward of a gather sums every rank's
gradient for a chunk's latents and hands it to the chunk's owner.

Why not Ulysses' all-to-all from sequence to heads around attention (DeepSpeed's `DistributedAttention`)? It
splits the heads of K and V too, and MLA has one latent KV head: Ulysses would have to replicate the latent per
head and move H× the bytes (GLM-5.2: 64 heads × 576 numbers a token each way for the queries alone, against 576
+ 128 a token gathered here). The indexer needs no cross-rank reduction either: each rank scores its own queries
with every indexer head against the gathered keys, so the top-k is the one-rank top-k bit for bit. Per-token
work is balanced for the sparse layers (2,048 keys a query whatever its position); the indexer's scoring and the
dense layers grow with the position, so the last chunk works most (a zigzag chunk order would even it out).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F


def sequence_groups(size: int):
    """Groups of `size` consecutive ranks (every rank makes every group, as torch.distributed requires) → (this
    rank's group, its rank in it)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    if size < 1 or world % size:
        raise ValueError(f"sequence_parallel={size} must divide the trainer's {world} ranks")
    mine = None
    for first in range(0, world, size):
        group = dist.new_group(list(range(first, first + size)))
        if first <= rank < first + size:
            mine = group
    return mine, rank % size


class _GatherSequence(torch.autograd.Function):
    """[B, c, …] on every rank → [B, S·c, …] in rank order; the backward sums the ranks' gradients of the whole and
    returns each rank its chunk's."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group, rank: int, size: int) -> torch.Tensor:
        ctx.group, ctx.rank, ctx.size = group, rank, size
        parts = [torch.empty_like(x) for _ in range(size)]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=1)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        # summed in fp32 (bf16 latents' gradients from S ranks would lose what one rank's sum keeps), in a copy
        # (autograd's incoming gradient is not ours to change)
        total = grad.to(torch.float32, copy=True).contiguous()
        dist.all_reduce(total, group=ctx.group)
        return total.chunk(ctx.size, dim=1)[ctx.rank].to(grad.dtype).contiguous(), None, None, None


class SequenceShard:
    """This rank's share of a sequence-parallel forward, given to the model as its `cache`: the model reads
    `get_seq_length()` (the chunk's first position) for its queries' key indices and `total_keys` for the key
    axis, and each attention layer's `update` returns every rank's latents (or indexer keys) along the sequence."""

    def __init__(self, group, rank: int, size: int, total: int):
        if total % size:
            raise ValueError(f"a sequence of {total} positions does not split into {size} equal chunks: pad it to a "
                             f"multiple of trainer.sequence_parallel")
        self.group, self.rank, self.size, self.total = group, rank, size, total
        self.chunk = total // size
        self.lo, self.hi = rank * self.chunk, (rank + 1) * self.chunk

    @property
    def total_keys(self) -> int:
        return self.total

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.lo

    def update(self, keys: torch.Tensor, values: torch.Tensor, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        return _GatherSequence.apply(keys, self.group, self.rank, self.size), values

    def local(self, t: torch.Tensor | None) -> torch.Tensor | None:
        """This rank's positions of a [B, T, …] tensor."""
        return None if t is None else t[:, self.lo:self.hi]

    def next_token(self, t: torch.Tensor, fill=0) -> torch.Tensor:
        """t [B, T] shifted left by one (what each position predicts), this rank's positions; the last position
        of the sequence gets `fill`."""
        return F.pad(t[:, 1:], (0, 1), value=fill)[:, self.lo:self.hi]

    def place(self, local: torch.Tensor) -> torch.Tensor:
        """This rank's predictions for positions [lo, hi) → the [B, T] columns they belong to (column p + 1 holds
        the prediction made at p; the last position's falls off), zeros elsewhere. `combine` then sums the ranks'
        into the one-rank result."""
        full = local.new_zeros(local.shape[0], self.total + 1, *local.shape[2:])
        full[:, self.lo + 1:self.hi + 1] = local
        return full[:, :self.total]

    def owned(self, width: int, device=None) -> torch.Tensor:
        """[width] booleans: the columns `place` fills on this rank (the others belong to other ranks)."""
        cols = torch.arange(width, device=device)
        return (cols > self.lo) & (cols <= self.hi)

    def any_rank(self, flags: torch.Tensor) -> torch.Tensor:
        """Booleans, true where any rank's is (a decision about a whole sample from each rank's part of it)."""
        t = flags.to(torch.int32)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return t.bool()

    def combine(self, t: torch.Tensor) -> torch.Tensor:
        """The ranks' `place`d tensors summed (every column comes from one rank): the whole result, on every rank
        (no gradient)."""
        t = t.detach().clone()
        dist.all_reduce(t, group=self.group)
        return t
