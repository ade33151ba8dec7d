"""Sparse MLA fused in Triton: each query reads its k selected latents straight from the KV, nothing gathered.

The same function as `models.glm5.sparse_mla.SparseMLA` (read its docstring for the math), one program per
query token and all heads at once (the absorbed form shares one 576-wide latent per key across heads, so a key
block is loaded once for all H heads, as in FlashMLA's sparse decode kernel):

forward, over the query's slots in blocks of N (online softmax, FlashAttention-2 style, base 2):

    a = q̃ K_blkᵀ · scale · log2(e),  m' = max(m, max a),  l = l·2^(m−m') + Σ 2^(a−m'),
    acc = acc·2^(m−m') + 2^(a−m') K_blk[:, :d_c]  →  o = acc / l,   lse₂ = m + log2 l

backward, per block again (p recomputed from lse₂, δ = Σ_d do ⊙ o computed once outside):

    p = 2^(a − lse₂),  ds = p ⊙ (do K_blk[:, :d_c]ᵀ − δ) · scale,  dq̃ += ds K_blk,
    dK_blk = dsᵀ q̃ (+ pᵀ do on the first d_c columns), added into an fp32 dkv with atomics.

Why: the torch version materialises the gathered [chunk, k, 576] block twice (forward and backward) and
scatters its gradient with `index_add_`; on an H200 at 4K tokens that gather, scatter and the casts around them
were about 70% of a training step of the kernel config (docs/BENCHMARKS.md). Here the only full-size traffic is
reading the selected rows (which mostly hit L2: neighbouring queries select overlapping keys) and the atomic
adds of dK. Slots are cleaned once in torch (`valid_keys`: −1, causally later and padded keys become −1) so the
kernels only test idx ≥ 0. A query with no valid slot gets o = 0 and lse₂ = +inf, hence p = 0 and no gradient.

Tested against the naive loop under Triton's interpreter on the CPU and natively on the GPU
(tests/models/glm5/test_sparse_mla.py).
"""

from __future__ import annotations

import math

import torch

from models.glm5.kernels import launch, triton
from models.glm5.layers import valid_keys

if triton is not None:
    import triton.language as tl

    @triton.jit
    def _query(Q, b, s, h, c, r, hm, cm, rm, stride_qb, stride_qs, stride_qh, D_C: tl.constexpr):
        """One query's absorbed heads split at d_c: q̃[:, :d_c] [BLOCK_H, BLOCK_C], q̃[:, d_c:] [BLOCK_H, BLOCK_R]."""
        q_row = Q + b * stride_qb + s * stride_qs + h[:, None] * stride_qh
        qc = tl.load(q_row + c[None, :], mask=hm[:, None] & cm[None, :], other=0.0)
        qr = tl.load(q_row + D_C + r[None, :], mask=hm[:, None] & rm[None, :], other=0.0)
        return qc, qr

    @triton.jit
    def _key_block(kv_b, idx_row, start, K_SEL, stride_kvt, c, r, cm, rm, D_C: tl.constexpr,
                   BLOCK_N: tl.constexpr):
        """Slots [start, start + BLOCK_N) of one query: their key indices (int64), validity, and the selected
        latents read in place, split at d_c (invalid slots read as 0)."""
        n = start + tl.arange(0, BLOCK_N)
        idx = tl.load(idx_row + n, mask=n < K_SEL, other=-1)
        valid = idx >= 0
        key = idx[:, None].to(tl.int64)
        kc = tl.load(kv_b + key * stride_kvt + c[None, :], mask=valid[:, None] & cm[None, :], other=0.0)
        kr = tl.load(kv_b + key * stride_kvt + D_C + r[None, :], mask=valid[:, None] & rm[None, :], other=0.0)
        return key, valid, kc, kr

    @triton.jit
    def _sparse_mla_fwd(Q, KV, IDX, O, LSE, S, H, K_SEL, scale_log2,
                        stride_qb, stride_qs, stride_qh, stride_kvb, stride_kvt, stride_ib, stride_is,
                        stride_ob, stride_os, stride_oh,
                        D_C: tl.constexpr, D_R: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_C: tl.constexpr, BLOCK_R: tl.constexpr):
        row = tl.program_id(0)
        b, s = row // S, row % S
        h = tl.arange(0, BLOCK_H)
        c = tl.arange(0, BLOCK_C)
        r = tl.arange(0, BLOCK_R)
        hm, cm, rm = h < H, c < D_C, r < D_R
        qc, qr = _query(Q, b, s, h, c, r, hm, cm, rm, stride_qb, stride_qs, stride_qh, D_C)
        kv_b = KV + b * stride_kvb
        idx_row = IDX + b * stride_ib + s * stride_is

        m = tl.full([BLOCK_H], float("-inf"), tl.float32)
        l = tl.zeros([BLOCK_H], tl.float32)
        acc = tl.zeros([BLOCK_H, BLOCK_C], tl.float32)
        for start in range(0, K_SEL, BLOCK_N):
            _, valid, kc, kr = _key_block(kv_b, idx_row, start, K_SEL, stride_kvt, c, r, cm, rm, D_C, BLOCK_N)
            a = (tl.dot(qc, tl.trans(kc)) + tl.dot(qr, tl.trans(kr))) * scale_log2
            a = tl.where(valid[None, :], a, float("-inf"))
            m_new = tl.maximum(m, tl.max(a, 1))
            shift = tl.where(m_new == float("-inf"), 0.0, m_new)  # no valid slot yet: keep everything at 0
            alpha = tl.exp2(m - shift)
            p = tl.exp2(a - shift[:, None])
            l = l * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p.to(kc.dtype), kc)
            m = m_new
        has = l > 0
        o = acc / tl.where(has, l, 1.0)[:, None]
        o_row = O + b * stride_ob + s * stride_os + h[:, None] * stride_oh
        tl.store(o_row + c[None, :], o.to(O.dtype.element_ty), mask=hm[:, None] & cm[None, :])
        lse = tl.where(has, m + tl.log2(tl.where(has, l, 1.0)), float("inf"))
        tl.store(LSE + row * H + h, lse, mask=hm)

    @triton.jit
    def _sparse_mla_bwd(Q, KV, IDX, DO, LSE, DELTA, DQ, DKV, S, H, K_SEL, scale_log2, scale,
                        stride_qb, stride_qs, stride_qh, stride_kvb, stride_kvt, stride_ib, stride_is,
                        stride_ob, stride_os, stride_oh, stride_db, stride_dt,
                        D_C: tl.constexpr, D_R: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_C: tl.constexpr, BLOCK_R: tl.constexpr):
        row = tl.program_id(0)
        b, s = row // S, row % S
        h = tl.arange(0, BLOCK_H)
        c = tl.arange(0, BLOCK_C)
        r = tl.arange(0, BLOCK_R)
        hm, cm, rm = h < H, c < D_C, r < D_R
        qc, qr = _query(Q, b, s, h, c, r, hm, cm, rm, stride_qb, stride_qs, stride_qh, D_C)
        do = tl.load(DO + b * stride_ob + s * stride_os + h[:, None] * stride_oh + c[None, :],
                     mask=hm[:, None] & cm[None, :], other=0.0)
        lse = tl.load(LSE + row * H + h, mask=hm, other=float("inf"))
        delta = tl.load(DELTA + row * H + h, mask=hm, other=0.0)
        kv_b = KV + b * stride_kvb
        dkv_b = DKV + b * stride_db
        idx_row = IDX + b * stride_ib + s * stride_is

        dqc = tl.zeros([BLOCK_H, BLOCK_C], tl.float32)
        dqr = tl.zeros([BLOCK_H, BLOCK_R], tl.float32)
        for start in range(0, K_SEL, BLOCK_N):
            key, valid, kc, kr = _key_block(kv_b, idx_row, start, K_SEL, stride_kvt, c, r, cm, rm, D_C, BLOCK_N)
            a = (tl.dot(qc, tl.trans(kc)) + tl.dot(qr, tl.trans(kr))) * scale_log2
            p = tl.where(valid[None, :], tl.exp2(a - lse[:, None]), 0.0)
            dp = tl.dot(do, tl.trans(kc))
            ds = (p * (dp - delta[:, None]) * scale).to(kc.dtype)
            dqc += tl.dot(ds, kc)
            dqr += tl.dot(ds, kr)
            dkc = tl.dot(tl.trans(ds), qc) + tl.dot(tl.trans(p.to(kc.dtype)), do)
            dkr = tl.dot(tl.trans(ds), qr)
            # relaxed: nothing reads dkv before the kernel ends (the default acq_rel orders every add; slower)
            dk_row = dkv_b + key * stride_dt
            tl.atomic_add(dk_row + c[None, :], dkc, mask=valid[:, None] & cm[None, :], sem="relaxed")
            tl.atomic_add(dk_row + D_C + r[None, :], dkr, mask=valid[:, None] & rm[None, :], sem="relaxed")
        dq_row = DQ + b * stride_qb + s * stride_qs + h[:, None] * stride_qh  # dq has q's (contiguous) strides
        tl.store(dq_row + c[None, :], dqc.to(DQ.dtype.element_ty), mask=hm[:, None] & cm[None, :])
        tl.store(dq_row + D_C + r[None, :], dqr.to(DQ.dtype.element_ty), mask=hm[:, None] & rm[None, :])


# Key-block size, warps and pipeline depth per pass, tuned on an H200 at the kernel config (bench/sparse_mla.py
# --tune): two stages took the forward from 5.13 to 4.36 ms at 8K and 19.4 to 16.5 ms at 32K; the backward is
# best at Triton's default depth.
LAUNCH = {"fwd": dict(BLOCK_N=64, num_warps=4, num_stages=2), "bwd": dict(BLOCK_N=16, num_warps=4)}


def _blocks(h: int, d_c: int, d_r: int) -> dict:
    pow2 = triton.next_power_of_2
    return dict(BLOCK_H=max(16, pow2(h)), BLOCK_C=max(16, pow2(d_c)), BLOCK_R=max(16, pow2(d_r)))


class SparseMLATriton(torch.autograd.Function):
    """Same contract as SparseMLA: o [B, c, H, d_c] for q [B, c, H, d], kv [B, T, d], sel [B, c, k]."""

    @staticmethod
    def forward(ctx, q, kv, sel, query_index, key_mask, scale: float, d_c: int):
        q, kv = q.contiguous(), kv.contiguous()
        b, s, h, d = q.shape
        idx = torch.where(valid_keys(sel, query_index, key_mask), sel, -1).to(torch.int32).contiguous()
        o = torch.empty(b, s, h, d_c, dtype=q.dtype, device=q.device)
        lse = torch.empty(b, s, h, dtype=torch.float32, device=q.device)
        _sparse_mla_fwd[(b * s,)](q, kv, idx, o, lse, s, h, idx.shape[-1], scale * math.log2(math.e),
                                  *q.stride()[:3], *kv.stride()[:2], *idx.stride()[:2], *o.stride()[:3],
                                  D_C=d_c, D_R=d - d_c, **_blocks(h, d_c, d - d_c), **launch(LAUNCH, "fwd"))
        ctx.save_for_backward(q, kv, idx, o, lse)
        ctx.scale, ctx.d_c = scale, d_c
        return o

    @staticmethod
    def backward(ctx, do):
        q, kv, idx, o, lse = ctx.saved_tensors
        b, s, h, d = q.shape
        do = do.to(q.dtype).contiguous()
        delta = (do.float() * o.float()).sum(-1).contiguous()
        dq = torch.empty_like(q)
        dkv = torch.zeros(kv.shape, dtype=torch.float32, device=kv.device)
        _sparse_mla_bwd[(b * s,)](q, kv, idx, do, lse, delta, dq, dkv, s, h, idx.shape[-1],
                                  ctx.scale * math.log2(math.e), ctx.scale,
                                  *q.stride()[:3], *kv.stride()[:2], *idx.stride()[:2], *do.stride()[:3],
                                  *dkv.stride()[:2], D_C=ctx.d_c, D_R=d - ctx.d_c,
                                  **_blocks(h, ctx.d_c, d - ctx.d_c), **launch(LAUNCH, "bwd"))
        return dq, dkv.to(kv.dtype), None, None, None, None, None


def sparse_mla_fused(q: torch.Tensor, kv: torch.Tensor, sel: torch.Tensor, query_index: torch.Tensor,
                      key_mask: torch.Tensor | None, scale: float, d_c: int) -> torch.Tensor:
    return SparseMLATriton.apply(q, kv, sel, query_index, key_mask, scale, d_c)
