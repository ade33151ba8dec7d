"""GAE benchmark: our vectorised skip-observation GAE against the per-timestep loop verl runs.

    python bench/gae.py [--batch 256] [--length 16384] [--repeat 3]

Rows of `length` tokens, about half of them action tokens (in runs, as in agent traces: a turn of sampled tokens
followed by an observation), values ~ N(0, 1), a terminal reward on each row's last action token. Both run on
the same inputs in the same process; the results must agree to 1e-5.
"""

from __future__ import annotations

import argparse
import platform
import time

import torch

from critic.gae import compute_gae
from critic.reference import gae_naive


def make_inputs(batch: int, length: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    mask = torch.zeros(batch, length, dtype=torch.bool)
    for row in range(batch):  # alternating runs of action and observation tokens, mean run length 64
        pos, action = 0, True
        while pos < length:
            run = int(torch.randint(16, 113, (1,), generator=g))
            mask[row, pos:pos + run] = action
            pos, action = pos + run, not action
    values = torch.randn(batch, length, generator=g)
    rewards = torch.zeros(batch, length)
    last = length - 1 - torch.argmax(mask.flip(1).int(), dim=1)
    rewards[torch.arange(batch), last] = torch.rand(batch, generator=g)
    return rewards, values, mask


def timed(fn, repeat):
    best, out = float("inf"), None
    for _ in range(repeat):
        start = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - start)
    return best, out


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--length", type=int, default=16384)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--gamma", type=float, default=1.0)
    p.add_argument("--lam", type=float, default=0.95)
    args = p.parse_args()
    r, v, m = make_inputs(args.batch, args.length)
    print(f"GAE on [{args.batch} x {args.length}], {m.float().mean():.2f} action tokens, gamma={args.gamma} "
          f"lam={args.lam}; torch {torch.__version__}, {torch.get_num_threads()} threads, {platform.processor()}")
    t_ours, (adv, ret) = timed(lambda: compute_gae(r, v, m, args.gamma, args.lam), args.repeat)
    t_naive, (n_adv, n_ret) = timed(lambda: gae_naive(r, v, m, args.gamma, args.lam), max(1, args.repeat - 2))
    # the exact answer: the same naive loop in float64
    ref_adv, ref_ret = gae_naive(r.double(), v.double(), m, args.gamma, args.lam)

    def err(a, b):
        return max(float((a[0].double() - b[0]).abs().max()), float((a[1].double() - b[1]).abs().max()))
    ours_err, naive_err = err((adv, ret), (ref_adv, ref_ret)), err((n_adv, n_ret), (ref_adv, ref_ret))
    ours_vs_naive = err((adv, ret), (n_adv.double(), n_ret.double()))
    print(f"naive per-timestep loop (verl), float32: {t_naive * 1000:9.1f} ms   max error {naive_err:.2e}")
    print(f"compute_gae (ours), float32:             {t_ours * 1000:9.1f} ms   max error {ours_err:.2e}")
    print(f"speed-up: {t_naive / t_ours:.1f}x   max |ours - naive|: {ours_vs_naive:.2e}   "
          "(errors against the float64 loop)")
    if ours_err > 1e-5:
        raise SystemExit(f"compute_gae is off by {ours_err:.2e} > 1e-5")


if __name__ == "__main__":
    main()
