"""The sparse attention core with a hand-written backward: queries over their gathered top-k latents.

For one chunk of c queries (absorbed form, models.glm5.attention), with K_t = kv[S_t] the k gathered latents
[c_kv ; k_r] of query t (d = d_c + d_r wide) and V_t = K_t[:, :d_c]:

    a = scale · q̃ K_tᵀ   (per head),   p = softmax over the valid slots of S_t,   o = p V_t

and the backward, with do the gradient of o:

    dp = do V_tᵀ,   ds = p ⊙ (dp − Σ_s p dp),   dq̃ = scale · ds K_t
    dK_t = scale · dsᵀ q̃  (+ pᵀ do on the first d_c columns),   dkv[s] = Σ over every (t, slot) that picked s of dK_t

Written out because autograd through the gather is what made the naive version slow: it keeps (or, under
checkpointing, recomputes) the [c, k, d] gathered block for three separate backward nodes — the slice V_t = K_t[:d_c]
zero-fills a full [c, k, d] gradient and adds it to the other, and the gather's backward scatters with a sorted
`index_put_`. Here the backward re-gathers K_t once, recomputes p from it (nothing of size c·k·H is kept between
forward and backward: at 32K tokens that would be gigabytes per layer), builds one dK_t and scatters it with a
single fp32 `index_add_`. Slots that are invalid (−1, causally later, padding) get p = 0 and so contribute nothing.
"""

from __future__ import annotations

import torch

from models.glm5.layers import masked_softmax, valid_keys


def _gather(kv: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """kv [B, T, d], idx [B, c, k] (valid indices) → [B, c, k, d]."""
    rows = torch.arange(kv.shape[0], device=kv.device)[:, None, None]
    return kv[rows, idx]


def _keys_and_probs(q, kv, sel, query_index, key_mask, scale):
    """(the gathered latents, p fp32 [B, c, H, k], the clamped indices)."""
    idx = sel.clamp(0, kv.shape[1] - 1)
    keys = _gather(kv, idx)
    ok = valid_keys(sel, query_index, key_mask)
    return keys, masked_softmax(torch.einsum("bchd,bckd->bchk", q, keys) * scale, ok[:, :, None, :]), idx


class SparseMLA(torch.autograd.Function):
    """o [B, c, H, d_c] = softmax(scale · q̃ K_tᵀ) V_t for q [B, c, H, d], kv [B, T, d], sel [B, c, k] (−1 = empty
    slot), query_index [B, c] and key_mask [B, T] or None deciding which slots count (`valid_keys`). Gradients
    for q and kv. Saves only its inputs (views the layer keeps anyway), so nothing of size c·k is held."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, kv: torch.Tensor, sel: torch.Tensor, query_index: torch.Tensor,
                key_mask: torch.Tensor | None, scale: float, d_c: int) -> torch.Tensor:
        keys, p, _ = _keys_and_probs(q, kv, sel, query_index, key_mask, scale)
        ctx.save_for_backward(q, kv, sel, query_index, key_mask)
        ctx.scale, ctx.d_c = scale, d_c
        return torch.einsum("bchk,bckd->bchd", p.to(q.dtype), keys[..., :d_c])

    @staticmethod
    def backward(ctx, do: torch.Tensor):
        q, kv, sel, query_index, key_mask = ctx.saved_tensors
        scale, d_c = ctx.scale, ctx.d_c
        keys, p, idx = _keys_and_probs(q, kv, sel, query_index, key_mask, scale)
        do = do.to(q.dtype)
        acc = p.dtype  # fp32 (fp64 for fp64 inputs)
        dp = torch.einsum("bchd,bckd->bchk", do, keys[..., :d_c]).to(acc)
        ds = (p * (dp - (p * dp).sum(-1, keepdim=True)) * scale).to(q.dtype)
        dq = torch.einsum("bchk,bckd->bchd", ds, keys) if ctx.needs_input_grad[0] else None
        dkv = None
        if ctx.needs_input_grad[1]:
            del keys
            d_keys = torch.einsum("bchk,bchd->bckd", ds, q).to(acc)
            d_keys[..., :d_c] += torch.einsum("bchk,bchd->bckd", p.to(q.dtype), do).to(acc)
            b, t, d = kv.shape
            flat = (idx + torch.arange(b, device=idx.device)[:, None, None] * t).flatten()
            dkv = torch.zeros(b * t, d, dtype=acc, device=kv.device)
            dkv.index_add_(0, flat, d_keys.reshape(-1, d))
            dkv = dkv.view(b, t, d).to(kv.dtype)
        return dq, dkv, None, None, None, None, None


def sparse_mla(q: torch.Tensor, kv: torch.Tensor, sel: torch.Tensor, query_index: torch.Tensor,
               key_mask: torch.Tensor | None, scale: float, d_c: int) -> torch.Tensor:
    return SparseMLA.apply(q, kv, sel, query_index, key_mask, scale, d_c)
