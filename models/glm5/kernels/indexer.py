"""The lightning indexer's scores fused in Triton: I = Σ_j w_j · ReLU(d_I^{−½} q_j · k), never per head.

For a block of queries × a block of keys, one program loads the key block once, walks the H_I index heads
(one [M, d_I] × [d_I, N] dot each, fp32 accumulation) and keeps only the weighted ReLU sum, so the output is the
[queries, keys] score matrix the top-k needs. The torch version (`Indexer.scores`) writes the per-head
[queries, H_I, keys] dots in fp32 (32× the output), passes them through ReLU and reduces them in a second einsum;
on the H200 that and its fp32 GEMM were about a fifth of a training step at 8K tokens (docs/BENCHMARKS.md), and
the indexer is the part of DSA that grows with S² (docs/GLM52.md §10).

Precision: q and k enter the dots in their own dtype (bf16 on the GPU) with fp32 accumulation; the weights, the
ReLU and the sum are fp32. DeepSeek-V3.2's and SGLang's production indexer runs its dots in fp8.
"""

from __future__ import annotations

import torch

from models.glm5.kernels import launch, triton

if triton is not None:
    import triton.language as tl

    @triton.jit
    def _index_scores(Q, W, K, OUT, C, T, H, scale,
                      stride_qb, stride_qc, stride_qh, stride_wb, stride_wc, stride_kb, stride_kt,
                      stride_ob, stride_oc,
                      D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
        m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        b = tl.program_id(2)
        d = tl.arange(0, BLOCK_D)
        mm, nm, dm = m < C, n < T, d < D
        k = tl.load(K + b * stride_kb + n[:, None] * stride_kt + d[None, :], mask=nm[:, None] & dm[None, :], other=0.0)
        q_rows = Q + b * stride_qb + m[:, None] * stride_qc + d[None, :]
        w_rows = W + b * stride_wb + m * stride_wc
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for h in range(H):
            q = tl.load(q_rows + h * stride_qh, mask=mm[:, None] & dm[None, :], other=0.0)
            w = tl.load(w_rows + h, mask=mm, other=0.0)
            acc += tl.maximum(tl.dot(q, tl.trans(k)) * scale, 0.0) * w[:, None]
        tl.store(OUT + b * stride_ob + m[:, None] * stride_oc + n[None, :], acc, mask=mm[:, None] & nm[None, :])


LAUNCH = {"scores": dict(BLOCK_M=64, BLOCK_N=64, num_warps=4)}


def index_scores_fused(q: torch.Tensor, w: torch.Tensor, k: torch.Tensor, scale: float) -> torch.Tensor:
    """I [B, c, t] fp32 for queries q [B, c, H_I, d_I], head weights w [B, c, H_I] and keys k [B, t, d_I]."""
    b, c, h, d = q.shape
    t = k.shape[1]
    q = q if q.stride(-1) == 1 else q.contiguous()
    k = k.to(q.dtype) if k.stride(-1) == 1 else k.to(q.dtype).contiguous()
    w = w.float().contiguous()
    out = torch.empty(b, c, t, dtype=torch.float32, device=q.device)
    cfg = launch(LAUNCH, "scores")
    grid = (triton.cdiv(c, cfg["BLOCK_M"]), triton.cdiv(t, cfg["BLOCK_N"]), b)
    _index_scores[grid](q, w, k, out, c, t, h, scale, q.stride(0), q.stride(1), q.stride(2), w.stride(0),
                        w.stride(1), k.stride(0), k.stride(1), out.stride(0), out.stride(1),
                        D=d, BLOCK_D=max(16, triton.next_power_of_2(d)), **cfg)
    return out
