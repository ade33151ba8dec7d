"""Small building blocks: RMSNorm, interleaved RoPE, the SwiGLU MLP, and the shared key-validity rule."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    """y = g ⊙ (x / sqrt(mean(x²) + ε)), normalised in fp32 and cast back to the input dtype *before* the gain
    (the order transformers and SGLang use; it matters in bf16)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"


class SwiGLU(nn.Module):
    """FFN(z) = W_down(silu(W_gate z) ⊙ W_up z): the dense MLP, each routed expert and the shared expert."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=False)
        self.up_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def rope_angles(positions: torch.Tensor, dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin of φ_{p,j} = p · θ^(−2j/dim), j = 0..dim/2−1, in fp32: [..., dim/2] each."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32, device=positions.device) / dim))
    angles = positions.float()[..., None] * inv_freq
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Interleaved (GPT-J) RoPE on the last dim of x ([B, S, ..., d]; cos/sin [B, S, d/2], broadcast over the
    middle dims).

    The pair (x_{2j}, x_{2j+1}) is rotated by φ_j: (a, b) → (a cos − b sin, b cos + a sin). Like transformers ≥ 5.13
    we emit the rotated pairs *de-interleaved*, [all first members ; all second members]. That is a fixed permutation
    of the interleaved result, applied to queries and keys alike, so every q·k (the only thing attention and the
    indexer use) is the same; our KV cache holds keys in this layout throughout.
    """
    while cos.dim() < x.dim():
        cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    a, b = x[..., 0::2], x[..., 1::2]
    return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)


def key_bounds(query_index: torch.Tensor) -> torch.Tensor:
    """[S] int64 on the host: how many keys the queries up to each position can see at most (1 + the largest query
    index so far; a prefix maximum, so never too small even if positions are not increasing). One host sync; the
    loops that walk queries in chunks read their key bounds from it instead of syncing once per chunk (each sync
    drains the GPU's queue)."""
    return (query_index.amax(0).cummax(0).values + 1).cpu()


def chunk_key_ends(bounds: torch.Tensor, chunk: int) -> list[int]:
    """The key bound of each `chunk`-query chunk, from `key_bounds`."""
    s = bounds.shape[0]
    return bounds[[min(a + chunk, s) - 1 for a in range(0, s, chunk)]].tolist()


def valid_keys(idx: torch.Tensor, query_index: torch.Tensor, key_mask: torch.Tensor | None) -> torch.Tensor:
    """Which gathered key slots a query may attend to.

    idx [B, c, k] key indices on the cache axis (−1 = empty slot), query_index [B, c] the query's own index on that
    axis (a key s is visible iff s ≤ query_index: causal, including itself), key_mask [B, T] 1 for real tokens,
    0 for padding. Replayed indices that break causality or point at padding are thereby ignored.
    """
    ok = (idx >= 0) & (idx <= query_index[..., None])
    if key_mask is not None:
        ok = ok & key_mask.bool().gather(1, idx.clamp(min=0).flatten(1)).view_as(idx)
    return ok


def masked_softmax(scores: torch.Tensor, ok: torch.Tensor) -> torch.Tensor:
    """softmax over the last dim restricted to `ok`, in fp32 (fp64 stays fp64); rows with no valid entry give all
    zeros (a padded query row then outputs 0 instead of NaN, which would leak into its KV and, through p = 0 · NaN,
    into others)."""
    s = scores.to(torch.promote_types(scores.dtype, torch.float32)).masked_fill(~ok, float("-inf"))
    peak = s.amax(-1, keepdim=True).clamp(min=torch.finfo(s.dtype).min).detach()  # shift-invariant
    e = torch.exp(s - peak)
    return e / e.sum(-1, keepdim=True).clamp(min=torch.finfo(s.dtype).tiny)
