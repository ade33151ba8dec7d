"""The trainer groups (rl/group.py) on N ranks against one rank: the actor's PPO step and the critic's value step
on the same global batch of rollout-shaped samples.

    python bench/trainer_scaling.py [--model tiny-random|smollm2-shape|glm52-1b-shape|PATH] [--ranks 1 2]
                                    [--samples 16] [--lengths 48 320] [--steps 3] [--zero 0] [--layouts packed padded]
                                    [--offload] [--sync-bucket-mb 64] [--gpus-per-rank 0] [--matmul fp32 tf32]
                                    [--parallel 1x1 2x1 1x2] [--checkpointing] [--longest 4096 --longest-max 262144]

Each world is a real `TrainerGroup` of `ActorWorker`s / `CriticWorker`s in a Ray placement group (gloo on the
CPU, NCCL with `--gpus-per-rank 1` on a GPU host), the samples split by token count. Per world and micro-batch
layout: seconds per step after the first (the warm-up), training tokens/s of the whole group and per rank, each
rank's peak resident memory (and peak GPU memory on a GPU), and the final loss; printed as ratios against the
first world (one rank, the first layout) measured in the same run. Then the actor's weight sync to the
LocalEngines' path: every bucket put into Ray's object store by the ranks (each its share) and pulled back, in
seconds and GB/s. On a 2-core CPU the ranks share the cores, so the figure to read there is that the ranks split
the work evenly (per-rank tokens/s × ranks against one rank) and that memory per rank falls with ZeRO; speed-ups
need one device per rank.

GLM-5.2-architecture models (`glm52-1b-shape`: 1.3B parameters, 58% of them routed experts) also run under expert
and sequence parallelism: `--parallel ExS` layouts (E ranks split every MoE layer's experts, S ranks split each
sample's positions; a layout runs at every rank count it divides). `--longest L` then finds, per world and layout,
the longest single sample the actor's update trains: lengths L, 2L, 4L, ... up to `--longest-max`, stopping at the
first that fails (out of memory, or a rank that does not answer within `--longest-timeout`), with the peak memory
per rank of the longest that trained. Under S-way sequence parallelism one sample spreads over S ranks, so that is
the figure that grows with the GPU count.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import time
from pathlib import Path

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


def glm52_1b_shape() -> dict:
    """A GLM-5.2-architecture model of 1.3B parameters: the smallest layout SGLang's GLM-5.2 kernels serve (MLA with
    the real head sizes, the DSA indexer at top-2,048 with IndexShare, MTP) at 16 layers and 64 routed experts, with
    GLM-5.2's vocabulary; positions up to 256K so that the longest-context search is not cut by the config."""
    from models.glm5.tiny import SMALL_CONFIG

    return {**SMALL_CONFIG, "vocab_size": 154880, "num_hidden_layers": 16, "n_routed_experts": 64,
            "max_position_embeddings": 262144}


def model_path(name: str) -> str:
    """A built-in model name or folder, or random weights of a shape: `smollm2-shape` (the default policy's) or
    `glm52-1b-shape` (stored in bf16), written once under the temp folder and reused by later invocations."""
    if name not in ("smollm2-shape", "glm52-1b-shape"):
        from models import resolve_model_path

        return str(resolve_model_path(name))
    import shutil
    import tempfile

    folder = Path(tempfile.gettempdir()) / "trainer-scaling" / name
    if (folder / "config.json").exists():
        return str(folder)
    folder.parent.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    if name == "smollm2-shape":
        from transformers import LlamaConfig, LlamaForCausalLM

        from models.tiny import SMOLLM2_SHAPE

        model = LlamaForCausalLM(LlamaConfig(**SMOLLM2_SHAPE))
    else:
        from models.glm5.config import Glm5Config
        from models.glm5.model import Glm5ForCausalLM

        previous = torch.get_default_dtype()
        torch.set_default_dtype(torch.bfloat16)  # built in bf16: half the host memory and time of an fp32 build
        try:
            model = Glm5ForCausalLM(Glm5Config(**glm52_1b_shape()))
        finally:
            torch.set_default_dtype(previous)
    partial = Path(tempfile.mkdtemp(prefix=f"{name}.", dir=folder.parent))
    model.save_pretrained(partial)
    shutil.rmtree(folder, ignore_errors=True)
    partial.rename(folder)  # whole or absent: an invocation killed while writing leaves no half folder behind
    return str(folder)


def parse_layout(text: str) -> tuple[int, int]:
    """`ExS` → (expert-parallel E, sequence-parallel S)."""
    try:
        e, s = (int(x) for x in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: a parallel layout is ExS, e.g. 2x1 or 1x4") from None
    if e < 1 or s < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: E and S must be >= 1")
    return e, s


def describe(error: BaseException) -> str:
    """`Type: first line` of the error a rank raised: Ray's wrapper (RayTaskError) is unwrapped to its cause, whose
    message is what says why (CUDA out of memory, and how much it tried to allocate)."""
    cause = getattr(error, "cause", None) or error
    lines = [line for line in str(cause).splitlines() if line.strip()]
    return f"{type(cause).__name__}: {lines[0][:300] if lines else ''}"


def longest_trainable(trains, start: int, maximum: int) -> dict:
    """Double the length from `start` while `trains(length)` succeeds (it returns what it measured, or raises).
    Returns the longest length that trained (0: not even `start`), what that attempt measured, and the first
    length that failed with why (None: it reached `maximum`)."""
    best = {"longest": 0, "at_longest": None, "failed_at": None, "failure": None}
    length = start
    while length <= maximum:
        try:
            measured = trains(length)
        except Exception as e:  # noqa: BLE001 - any failure ends the search; it is reported, not raised
            best.update(failed_at=length, failure=describe(e))
            break
        best.update(longest=length, at_longest=measured)
        length *= 2
    return best


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def peak_gpu_mib() -> float:
    return torch.cuda.max_memory_allocated() / 2**20 if torch.cuda.is_available() else 0.0


def reset_peaks() -> None:
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()


def run_world(ranks: int, packed: bool, args, matmul: str = "fp32", layout: tuple[int, int] = (1, 1)) -> dict:
    from critic.worker import CriticWorker
    from models.deepspeed_worker import OptimConfig
    from rl.actor import ActorWorker
    from rl.config import AlgorithmConfig
    from rl.group import TrainerGroup

    path = args.model_path
    ep, sp = layout
    optim = OptimConfig(learning_rate=1e-5, micro_batch_tokens=args.micro_batch_tokens, zero_stage=args.zero,
                        pack_micro_batches=packed, offload_optimizer=args.offload and args.zero >= 1,
                        offload_params=args.offload and args.zero == 3, tf32=matmul == "tf32",
                        expert_parallel=ep, sequence_parallel=sp, gradient_checkpointing=args.checkpointing)
    threads = max(1, (os.cpu_count() or 1) // ranks) if args.gpus_per_rank == 0 else 4
    algo = AlgorithmConfig(use_reference=False, mask_low=0, mask_high=0, veto=0)
    batch = samples(args.samples, lengths=tuple(args.lengths))
    tokens = sum(len(s["token_ids"]) for s in batch)
    result = {"ranks": ranks, "layout": ("packed" if packed else "padded") + ("" if matmul == "fp32" else f" {matmul}"),
              "expert_parallel": ep, "sequence_parallel": sp, "tokens_per_step": tokens}
    for name in args.roles:
        group = (TrainerGroup(ActorWorker, ranks, args.gpus_per_rank, "actor", path, optim, algo, temperature=1.0,
                              dtype=args.dtype, torch_threads=threads, sequence_parallel=sp) if name == "actor" else
                 TrainerGroup(CriticWorker, ranks, args.gpus_per_rank, "critic", path, optim, 0.2, dtype=args.dtype,
                              torch_threads=threads, sequence_parallel=sp))
        try:
            times, metrics = [], {}
            for _ in range(args.steps):
                started = time.perf_counter()
                metrics = group.train_step(batch).result()
                times.append(time.perf_counter() - started)
            timed = times[1:] or times
            step_s = sum(timed) / len(timed)
            rss, gpu = peaks(group)
            result[name] = {"step_s": step_s, "tokens_per_s": tokens / step_s,
                            "tokens_per_s_per_rank": tokens / step_s / ranks, "peak_rss_mib_per_rank": rss,
                            "peak_gpu_mib_per_rank": gpu,
                            "loss": metrics.get("actor/loss", metrics.get("critic/value_loss"))}
            if name == "actor":
                result["sync"] = measure_sync(group, args.sync_bucket_mb)
                if args.longest:  # last: a failed attempt can leave the group unusable
                    result["longest"] = longest_trainable(lambda n: train_one(group, n, args.longest_timeout),
                                                          args.longest, args.longest_max)
        finally:
            group.shutdown()
            wait_until_dead(group.workers)
    return result


def wait_until_dead(workers, timeout_s: float = 120.0) -> None:
    """Until Ray reports every killed rank dead: a rank that ran out of memory still holds its GPU until its
    process is gone, and the next world's ranks start on the same GPUs."""
    deadline = time.perf_counter() + timeout_s
    for w in workers:
        while time.perf_counter() < deadline:
            try:
                ray.get(w.__ray_ready__.remote(), timeout=5)
            except ray.exceptions.RayActorError:
                break
            except ray.exceptions.GetTimeoutError:
                pass
            time.sleep(0.5)


def peaks(group) -> tuple[list[float], list[float]]:
    """Each rank's peak resident memory and peak GPU memory (MiB)."""
    return (ray.get([w.__ray_call__.remote(lambda self: peak_rss_mib()) for w in group.workers]),
            ray.get([w.__ray_call__.remote(lambda self: peak_gpu_mib()) for w in group.workers]))


def train_one(group, length: int, timeout_s: float) -> dict:
    """The actor's update on one sample of `length` tokens; its seconds and each rank's peak memory. Raises when a
    rank fails (out of memory) or does not answer within `timeout_s` (a rank left waiting in a collective)."""
    ray.get([w.__ray_call__.remote(lambda self: reset_peaks()) for w in group.workers])
    started = time.perf_counter()
    pending = group.train_step(samples(1, seed=length, lengths=(length, length + 1)))
    waiting = list(pending.refs)
    while waiting:
        done, waiting = ray.wait(waiting, num_returns=1, timeout=max(0.0, timeout_s - (time.perf_counter() - started)))
        if not done:
            raise TimeoutError(f"{len(waiting)} rank(s) did not answer within {timeout_s:.0f} s")
        ray.get(done[0])  # a rank's error (torch.OutOfMemoryError) raises here
    seconds = time.perf_counter() - started
    pending.result()
    rss, gpu = peaks(group)
    return {"seconds": seconds, "peak_rss_mib_per_rank": rss, "peak_gpu_mib_per_rank": gpu}


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
    p.add_argument("--parallel", nargs="+", type=parse_layout, default=[(1, 1)], metavar="ExS",
                   help="expert x sequence parallel layouts (GLM-5.2 models), each at every rank count it divides")
    p.add_argument("--checkpointing", action="store_true", help="gradient checkpointing (trainer.gradient_checkpointing)")
    p.add_argument("--longest", type=int, default=0, metavar="L",
                   help="then find the longest one-sample update the actor trains: L, 2L, ... (0: off)")
    p.add_argument("--longest-max", type=int, default=262144)
    p.add_argument("--longest-timeout", type=float, default=180.0, help="seconds one attempt may take")
    p.add_argument("--roles", nargs="+", default=["actor", "critic"], choices=["actor", "critic"])
    p.add_argument("--out", default="", help="the results as JSON, rewritten after every world")
    args = p.parse_args(argv)
    if any(e > 1 for e, _ in args.parallel) and args.zero not in (1, 2):
        p.error("expert parallelism (E > 1) needs --zero 1 or 2")
    worlds = [(r, e, s) for r in args.ranks for e, s in args.parallel if r % e == 0 and r % s == 0]
    if not worlds:
        p.error(f"no layout in --parallel divides a rank count in --ranks {args.ranks}")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(num_cpus=os.cpu_count(), num_gpus=torch.cuda.device_count(), include_dashboard=False,
             log_to_driver=False)
    args.model_path = model_path(args.model)
    results, failed = [], []
    for r, e, s in worlds:
        for layout in args.layouts:
            for matmul in args.matmul:
                try:
                    results.append(run_world(r, layout == "packed", args, matmul, (e, s)))
                except Exception as error:  # noqa: BLE001 - one world's failure (out of memory) is reported; the rest run
                    failed.append({"ranks": r, "expert_parallel": e, "sequence_parallel": s, "layout": layout,
                                   "matmul": matmul, "error": describe(error)})
                    print(f"  ranks {r} E{e} S{s} {layout} {matmul} failed: {failed[-1]['error']}", flush=True)
                if args.out:  # after every world: a run cut short by its time limit keeps what it measured
                    Path(args.out).write_text(json.dumps(results + failed, indent=1))
    ray.shutdown()
    if not results:
        raise SystemExit("every world failed")
    base = results[0]
    print(f"{args.model} ({args.dtype}), ZeRO-{args.zero}{' offload' if args.offload else ''}, {args.samples} samples "
          f"({base['tokens_per_step']} tokens) a step, micro-batches of {args.micro_batch_tokens} positions")
    label = lambda r: (f"ranks {r['ranks']} {r['layout']}" +  # noqa: E731
                       (f" E{r['expert_parallel']} S{r['sequence_parallel']}" if args.parallel != [(1, 1)] else ""))
    for r in results:
        for name in args.roles:
            m, b = r[name], base[name]
            gpu = (f", peak GPU per rank {'/'.join(f'{x:.0f}' for x in m['peak_gpu_mib_per_rank'])} MiB"
                   if any(m["peak_gpu_mib_per_rank"]) else "")
            print(f"  {name:6s} {label(r)}: {m['step_s']:.2f} s/step, {m['tokens_per_s']:.0f} tok/s "
                  f"({m['tokens_per_s'] / b['tokens_per_s']:.2f}x of {label(base)}), per rank "
                  f"{m['tokens_per_s_per_rank']:.0f} tok/s ({m['tokens_per_s_per_rank'] / b['tokens_per_s_per_rank']:.2f}x),"
                  f" peak RSS per rank {'/'.join(f'{x:.0f}' for x in m['peak_rss_mib_per_rank'])} MiB{gpu}, "
                  f"loss {m['loss']:.6f} (|Δ| {abs(m['loss'] - b['loss']):.1e})")
        if "sync" in r:
            s, b = r["sync"], base["sync"]
            print(f"  sync   {label(r)}: {s['buckets']} buckets, {s['gb']:.3f} GB in {s['seconds']:.3f} s = "
                  f"{s['gb_per_s']:.2f} GB/s ({s['gb_per_s'] / b['gb_per_s']:.2f}x), put {s['put_s']:.3f} s")
        if "longest" in r:
            x = r["longest"]
            at = x["at_longest"] or {}
            memory = at.get("peak_gpu_mib_per_rank") if any(at.get("peak_gpu_mib_per_rank") or []) else \
                at.get("peak_rss_mib_per_rank")
            print(f"  longest {label(r)}: {x['longest']} tokens trained"
                  + (f" ({at['seconds']:.1f} s, peak per rank {'/'.join(f'{v:.0f}' for v in memory)} MiB)" if at else "")
                  + (f"; {x['failed_at']} failed: {x['failure']}" if x["failed_at"] else "; reached --longest-max"))
    return results


if __name__ == "__main__":
    main()
