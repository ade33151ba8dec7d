"""One layer's sparse attention core, fused Triton kernel against the chunked torch path, forward and backward.

    python bench/sparse_mla.py                          # H200: 4K-32K tokens, top-k 2048, GLM-5.2's 576-wide latents
    python bench/sparse_mla.py --seqs 8192 --tune       # also time other key blocks, warps and pipeline depths

Inputs as in the model (docs/GLM52.md §9B: 16 heads, d_c 512 + d_r 64, bf16): q̃ [1, S, H, 576], kv [1, S, 576] and
each query's top-k selection of its causal prefix (random scores, −1 where fewer than k keys exist). The torch
side is models.glm5.sparse_mla.SparseMLA in the model's 256-query chunks. Prints ms per call and the ratio.
"""

from __future__ import annotations

import argparse
import itertools
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from models.glm5.kernels import sparse_mla as fused_kernel  # noqa: E402
from models.glm5.sparse_mla import sparse_mla  # noqa: E402


def selection(seq: int, k: int, device: str) -> torch.Tensor:
    """Each query's top-k of random scores over keys ≤ itself, −1 in the slots it cannot fill: [1, S, k]."""
    out = torch.empty(1, seq, k, dtype=torch.long, device=device)
    keys = torch.arange(seq, device=device)
    for a in range(0, seq, 1024):
        q = torch.arange(a, min(a + 1024, seq), device=device)
        scores = torch.rand(len(q), seq, device=device).masked_fill(keys > q[:, None], -1.0)
        top = scores.topk(min(k, seq), dim=-1)
        idx = torch.where(top.values >= 0, top.indices, -1)
        out[0, a:a + len(q), :idx.shape[1]] = idx
        out[0, a:a + len(q), idx.shape[1]:] = -1
    return out


def torch_path(q, kv, sel, qi, key_mask, scale, d_c, chunk=256):
    return torch.cat([sparse_mla(q[:, a:a + chunk], kv, sel[:, a:a + chunk], qi[:, a:a + chunk], key_mask, scale, d_c)
                      for a in range(0, q.shape[1], chunk)], dim=1)


def timed(fn, reps: int) -> float:
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def measure(impl, q, kv, sel, qi, scale, d_c, reps) -> tuple[float, float]:
    """(forward ms, forward + backward ms)."""
    grad = torch.randn(*q.shape[:3], d_c, device=q.device, dtype=q.dtype)

    def forward():
        with torch.no_grad():
            impl(q, kv, sel, qi, None, scale, d_c)

    def both():
        qq, kk = q.detach().requires_grad_(), kv.detach().requires_grad_()
        torch.autograd.backward(impl(qq, kk, sel, qi, None, scale, d_c), grad)

    return timed(forward, reps), timed(both, reps)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seqs", type=int, nargs="+", default=[4096, 8192, 16384, 32768])
    p.add_argument("--topk", type=int, default=2048)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--tune", action="store_true", help="time other key blocks, warps, pipeline depths at the first length")
    args = p.parse_args()
    d_c, d_r, h = 512, 64, args.heads
    scale = 1 / math.sqrt(192 + d_r)
    for seq in args.seqs:
        g = torch.Generator("cuda").manual_seed(seq)
        q = torch.randn(1, seq, h, d_c + d_r, device="cuda", generator=g).bfloat16()
        kv = torch.randn(1, seq, d_c + d_r, device="cuda", generator=g).bfloat16()
        sel = selection(seq, args.topk, "cuda")
        qi = torch.arange(seq, device="cuda")[None]
        fused = measure(fused_kernel.sparse_mla_fused, q, kv, sel, qi, scale, d_c, args.reps)
        plain = measure(torch_path, q, kv, sel, qi, scale, d_c, args.reps)
        print(f"seq {seq:>6}: fused fwd {fused[0]:8.2f} ms, fwd+bwd {fused[1]:8.2f} ms | torch fwd {plain[0]:8.2f} "
              f"ms, fwd+bwd {plain[1]:8.2f} ms | fused/torch speed-up fwd {plain[0] / fused[0]:.1f}x, "
              f"fwd+bwd {plain[1] / fused[1]:.1f}x", flush=True)
        if args.tune and seq == args.seqs[0]:
            base = {k: dict(v) for k, v in fused_kernel.LAUNCH.items()}
            blocks = [dict(BLOCK_N=n, num_warps=w) for n, w in itertools.product([16, 32, 64, 128], [4, 8])]
            for kind in ("fwd", "bwd"):  # then pipelining depths at the kind's own tuned block
                for launch in blocks + [dict(base[kind], num_stages=stages) for stages in (1, 2, 3, 4)]:
                    fused_kernel.LAUNCH[kind] = launch
                    label = f"  {kind} " + " ".join(f"{k} {v}" for k, v in launch.items())
                    try:
                        t = measure(fused_kernel.sparse_mla_fused, q, kv, sel, qi, scale, d_c, args.reps)
                        print(f"{label}: fwd {t[0]:7.2f} ms, fwd+bwd {t[1]:7.2f} ms", flush=True)
                    except Exception as e:  # e.g. out of shared memory at the largest blocks
                        print(f"{label}: {type(e).__name__}: {str(e)[:80]}", flush=True)
                    fused_kernel.LAUNCH.update({k: dict(v) for k, v in base.items()})


if __name__ == "__main__":
    main()
