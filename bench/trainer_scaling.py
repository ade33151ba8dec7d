"""The trainer groups (rl/group.py) on N ranks against one rank: the actor's PPO step and the critic's value step
on the same global batch of rollout-shaped samples.

    python bench/trainer_scaling.py [--model tiny-random|smollm2-shape|PATH] [--ranks 1 2] [--samples 16]
                                    [--lengths 48 320] [--steps 3] [--zero 0] [--layouts packed padded]
                                    [--offload] [--sync-bucket-mb 64] [--gpus-per-rank 0] [--matmul fp32 tf32]

Each world is a real `TrainerGroup` of `ActorWorker`s / `CriticWorker`s in a Ray placement group (gloo on the
CPU, NCCL with `--gpus-per-rank 1` on a GPU host), the samples split by token count. Per world and micro-batch
layout: seconds per step after the first (the warm-up), training tokens/s of the whole group and per rank, each
rank's peak resident memory (and peak GPU memory on a GPU), and the final loss; printed as ratios against the
first world (one rank, the first layout) measured in the same run. Then the actor's weight sync to the
LocalEngines' path: every bucket put into Ray's object store by the ranks (each its share) and pulled back, in
seconds and GB/s. On a 2-core CPU the ranks share the cores, so the figure to read there is that the ranks split
the work evenly (per-rank tokens/s × ranks against one rank) and that memory per rank falls with ZeRO; speed-ups
need one device per rank.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import time

import ray
import torch


def samples(n: int, seed: int = 0, lengths: tuple[int, int] = (48, 320)) -> list[dict]:
    """Rollout-shaped samples: prompt tokens (no loss) then action tokens, lengths uniform in `lengths` (agent
    segments vary widely, which is what padding wastes)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        length = int(torch.randint(lengths[0], lengths[1], (1,), generator=g))
        prompt = length // 3
        ids = torch.randint(100, 4000, (length,), generator=g).tolist()
        mask = [0] * prompt + [1] * (length - prompt)
        out.append({"token_ids": ids, "loss_mask": mask, "rollout_logprobs": [-8.3] * length,
                    "advantages": [float(torch.randn(1, generator=g)) * m for m in mask],
                    "returns": [0.5 * m for m in mask], "old_values": [0.0] * length})
    return out


# SmolLM2-135M's shape (the default policy), for hosts without its weights: speed does not depend on them.
SMOLLM2_SHAPE = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                     num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192, rope_theta=100000.0,
                     tie_word_embeddings=True)


def model_path(name: str) -> str:
    """A built-in model name or folder, or `smollm2-shape`: random weights of the default policy's shape."""
    if name != "smollm2-shape":
        from models import resolve_model_path

        return str(resolve_model_path(name))
    import tempfile

    from transformers import LlamaConfig, LlamaForCausalLM

    folder = tempfile.mkdtemp(prefix="smollm2-shape-")
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**SMOLLM2_SHAPE)).save_pretrained(folder)
    return folder


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def peak_gpu_mib() -> float:
    return torch.cuda.max_memory_allocated() / 2**20 if torch.cuda.is_available() else 0.0


def run_world(ranks: int, packed: bool, args, matmul: str = "fp32") -> dict:
    from critic.worker import CriticWorker
    from models.deepspeed_worker import OptimConfig
    from rl.actor import ActorWorker
    from rl.config import AlgorithmConfig
    from rl.group import TrainerGroup

    path = args.model_path
    optim = OptimConfig(learning_rate=1e-5, micro_batch_tokens=args.micro_batch_tokens, zero_stage=args.zero,
                        pack_micro_batches=packed, offload_optimizer=args.offload and args.zero >= 1,
                        offload_params=args.offload and args.zero == 3, tf32=matmul == "tf32")
    threads = max(1, (os.cpu_count() or 1) // ranks) if args.gpus_per_rank == 0 else 4
    algo = AlgorithmConfig(use_reference=False, mask_low=0, mask_high=0, veto=0)
    batch = samples(args.samples, lengths=tuple(args.lengths))
    tokens = sum(len(s["token_ids"]) for s in batch)
    result = {"ranks": ranks, "layout": ("packed" if packed else "padded") + ("" if matmul == "fp32" else f" {matmul}"),
              "tokens_per_step": tokens}
    for name in ("actor", "critic"):
        group = (TrainerGroup(ActorWorker, ranks, args.gpus_per_rank, "actor", path, optim, algo, temperature=1.0,
                              dtype=args.dtype, torch_threads=threads) if name == "actor" else
                 TrainerGroup(CriticWorker, ranks, args.gpus_per_rank, "critic", path, optim, 0.2, dtype=args.dtype,
                              torch_threads=threads))
        times, metrics = [], {}
        for _ in range(args.steps):
            started = time.perf_counter()
            metrics = group.train_step(batch).result()
            times.append(time.perf_counter() - started)
        timed = times[1:] or times
        step_s = sum(timed) / len(timed)
        rss = ray.get([w.__ray_call__.remote(lambda self: peak_rss_mib()) for w in group.workers])
        gpu = ray.get([w.__ray_call__.remote(lambda self: peak_gpu_mib()) for w in group.workers])
        result[name] = {"step_s": step_s, "tokens_per_s": tokens / step_s, "tokens_per_s_per_rank": tokens / step_s / ranks,
                        "peak_rss_mib_per_rank": rss, "peak_gpu_mib_per_rank": gpu,
                        "loss": metrics.get("actor/loss", metrics.get("critic/value_loss"))}
        if name == "actor":
            result["sync"] = measure_sync(group, args.sync_bucket_mb)
        group.shutdown()
    return result


def measure_sync(actor, bucket_mb: int, repeats: int = 3) -> dict:
    """The LocalEngine sync path without the engines: the ranks put their shares of the buckets into the object
    store, a consumer (here the driver) pulls every bucket. Best of `repeats`."""
    best = None
    for _ in range(repeats):
        started = time.perf_counter()
        refs = actor.weight_bucket_refs(bucket_mb)
        put_s = time.perf_counter() - started
        nbytes = sum(t.numel() * t.element_size() for b in ray.get(refs) for t in b.values())
        total_s = time.perf_counter() - started
        if best is None or total_s < best["seconds"]:
            best = {"seconds": total_s, "put_s": put_s, "buckets": len(refs), "gb": nbytes / 1e9,
                    "gb_per_s": nbytes / 1e9 / total_s}
        del refs
    return best


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="tiny-random")
    p.add_argument("--ranks", type=int, nargs="+", default=[1, 2])
    p.add_argument("--layouts", nargs="+", default=["packed", "padded"], choices=["packed", "padded"])
    p.add_argument("--samples", type=int, default=16)
    p.add_argument("--lengths", type=int, nargs=2, default=[48, 320], metavar=("MIN", "MAX"))
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--zero", type=int, default=0)
    p.add_argument("--offload", action="store_true", help="offload the optimizer (ZeRO>=1) and params (ZeRO-3)")
    p.add_argument("--gpus-per-rank", type=float, default=0.0)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--micro-batch-tokens", type=int, default=2048)
    p.add_argument("--sync-bucket-mb", type=int, default=64)
    p.add_argument("--matmul", nargs="+", default=["fp32"], choices=["fp32", "tf32"],
                   help="fp32 weights' matmuls: plain fp32, or on TF32 tensor cores (trainer.tf32; GPU only)")
    p.add_argument("--out", default="")
    args = p.parse_args(argv)
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(num_cpus=os.cpu_count(), num_gpus=torch.cuda.device_count(), include_dashboard=False,
             log_to_driver=False)
    args.model_path = model_path(args.model)
    results = [run_world(r, layout == "packed", args, matmul) for r in args.ranks for layout in args.layouts
               for matmul in args.matmul]
    ray.shutdown()
    base = results[0]
    print(f"{args.model} ({args.dtype}), ZeRO-{args.zero}{' offload' if args.offload else ''}, {args.samples} samples "
          f"({base['tokens_per_step']} tokens) a step, micro-batches of {args.micro_batch_tokens} positions")
    for r in results:
        for name in ("actor", "critic"):
            m, b = r[name], base[name]
            gpu = (f", peak GPU per rank {'/'.join(f'{x:.0f}' for x in m['peak_gpu_mib_per_rank'])} MiB"
                   if any(m["peak_gpu_mib_per_rank"]) else "")
            print(f"  {name:6s} ranks {r['ranks']} {r['layout']}: {m['step_s']:.2f} s/step, {m['tokens_per_s']:.0f} "
                  f"tok/s ({m['tokens_per_s'] / b['tokens_per_s']:.2f}x of {base['ranks']} rank {base['layout']}), "
                  f"per rank {m['tokens_per_s_per_rank']:.0f} tok/s, peak RSS per rank "
                  f"{'/'.join(f'{x:.0f}' for x in m['peak_rss_mib_per_rank'])} MiB{gpu}, loss {m['loss']:.6f} "
                  f"(vs {b['loss']:.6f})")
        s, b = r["sync"], base["sync"]
        print(f"  sync   ranks {r['ranks']} {r['layout']}: {s['buckets']} buckets, {s['gb']:.3f} GB in "
              f"{s['seconds']:.3f} s = {s['gb_per_s']:.2f} GB/s ({s['gb_per_s'] / b['gb_per_s']:.2f}x), put "
              f"{s['put_s']:.3f} s")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
    return results


if __name__ == "__main__":
    main()
