"""The trainer groups (rl/group.py) on N ranks against one rank: the actor's PPO step and the critic's value step
on the same global batch of rollout-shaped samples.

    python bench/trainer_scaling.py [--model tiny-random] [--ranks 1 2] [--samples 16] [--steps 3] [--zero 0]

Each world is a real `TrainerGroup` of `ActorWorker`s / `CriticWorker`s in a Ray placement group (gloo on the
CPU, NCCL with `--gpus-per-rank 1` on a GPU host), the samples split by token count. Per world: seconds per
step after the first (the warm-up), training tokens/s of the whole group and per rank, each rank's peak resident
memory, and the final loss; printed as ratios against one rank measured in the same run. On a 2-core CPU the
ranks share the cores, so the figure to read there is that the ranks split the work evenly (per-rank tokens/s
× ranks against one rank) and that memory per rank falls with ZeRO; speed-ups need one device per rank.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import time

import ray
import torch


def samples(n: int, seed: int = 0) -> list[dict]:
    """Rollout-shaped samples: prompt tokens (no loss) then action tokens, lengths spread like agent episodes."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        length = int(torch.randint(48, 320, (1,), generator=g))
        prompt = length // 3
        ids = torch.randint(100, 4000, (length,), generator=g).tolist()
        mask = [0] * prompt + [1] * (length - prompt)
        out.append({"token_ids": ids, "loss_mask": mask, "rollout_logprobs": [-8.3] * length,
                    "advantages": [float(torch.randn(1, generator=g)) * m for m in mask],
                    "returns": [0.5 * m for m in mask], "old_values": [0.0] * length})
    return out


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def run_world(ranks: int, args) -> dict:
    from critic.worker import CriticWorker
    from models import resolve_model_path
    from models.training import OptimConfig
    from rl.actor import ActorWorker
    from rl.config import AlgorithmConfig
    from rl.group import TrainerGroup

    path = str(resolve_model_path(args.model))
    optim = OptimConfig(learning_rate=1e-5, micro_batch_tokens=args.micro_batch_tokens, zero_stage=args.zero)
    threads = max(1, (os.cpu_count() or 1) // ranks) if args.gpus_per_rank == 0 else 4
    algo = AlgorithmConfig(use_reference=False, mask_low=0, mask_high=0, veto=0)
    actor = TrainerGroup(ActorWorker, ranks, args.gpus_per_rank, "actor", path, optim, algo, temperature=1.0,
                         torch_threads=threads)
    critic = TrainerGroup(CriticWorker, ranks, args.gpus_per_rank, "critic", path, optim, 0.2, torch_threads=threads)
    batch = samples(args.samples)
    tokens = sum(len(s["token_ids"]) for s in batch)
    result = {"ranks": ranks, "tokens_per_step": tokens}
    for name, group, step in (("actor", actor, lambda: actor.train_step(batch)),
                              ("critic", critic, lambda: critic.train_step(batch))):
        times, metrics = [], {}
        for _ in range(args.steps):
            started = time.perf_counter()
            metrics = step()
            times.append(time.perf_counter() - started)
        timed = times[1:] or times
        step_s = sum(timed) / len(timed)
        rss = ray.get([w.__ray_call__.remote(lambda self: peak_rss_mib()) for w in group.workers])
        result[name] = {"step_s": step_s, "tokens_per_s": tokens / step_s, "tokens_per_s_per_rank": tokens / step_s / ranks,
                        "peak_rss_mib_per_rank": rss,
                        "loss": metrics.get("actor/loss", metrics.get("critic/value_loss"))}
        group.shutdown()
    return result


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="tiny-random")
    p.add_argument("--ranks", type=int, nargs="+", default=[1, 2])
    p.add_argument("--samples", type=int, default=16)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--zero", type=int, default=0)
    p.add_argument("--gpus-per-rank", type=float, default=0.0)
    p.add_argument("--micro-batch-tokens", type=int, default=2048)
    p.add_argument("--out", default="")
    args = p.parse_args(argv)
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(num_cpus=os.cpu_count(), num_gpus=torch.cuda.device_count(), include_dashboard=False,
             log_to_driver=False)
    results = [run_world(r, args) for r in args.ranks]
    ray.shutdown()
    base = results[0]
    print(f"{args.model}, ZeRO-{args.zero}, {args.samples} samples ({base['tokens_per_step']} tokens) a step")
    for r in results:
        for name in ("actor", "critic"):
            m, b = r[name], base[name]
            print(f"  {name:6s} ranks {r['ranks']}: {m['step_s']:.2f} s/step, {m['tokens_per_s']:.0f} tok/s "
                  f"({m['tokens_per_s'] / b['tokens_per_s']:.2f}x of {base['ranks']} rank), per rank "
                  f"{m['tokens_per_s_per_rank']:.0f} tok/s, peak RSS per rank "
                  f"{'/'.join(f'{x:.0f}' for x in m['peak_rss_mib_per_rank'])} MiB, loss {m['loss']:.6f} "
                  f"(vs {b['loss']:.6f})")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
    return results


if __name__ == "__main__":
    main()
