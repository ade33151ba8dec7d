"""ZeRO-3 data-parallel training of a GLM-5.2-architecture model on N ranks against one rank, same data.

    python bench/zero3_glm5.py --worlds 1 2 [--config kernel --layers 16 --experts 32 --seq 2048 --batch 16]
    python bench/zero3_glm5.py --device cpu --config tiny --seq 64 --batch 4 --steps 3   # gloo, the CPU test's

Each world trains the same seeded model on the same global batches (rank r takes rows r, r+N, ...; one rank
takes them all, in micro-batches of the same size as a rank's, so the per-GPU work is equal) with DeepSpeed
ZeRO-3 and AdamW. Per world: loss per step (mean over the global batch), training tokens/s per GPU after the
warm-up steps, peak memory per GPU. Printed: the ratio of the N-rank figures to the one-rank ones and the largest
loss difference between the curves. The data is learnable (each row repeats a random motif) so the curve falls.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch

from models.glm5.config import Glm5Config
from models.glm5.tiny import KERNEL_CONFIG, REFERENCE_CONFIG, TINY_CONFIG, build_random
from models.deepspeed_worker import (
    DistEnv,
    accumulate_and_step,
    deepspeed_engine,
    init_distributed,
)

CONFIGS = {"tiny": dict(TINY_CONFIG, vocab_size=512), "reference": REFERENCE_CONFIG, "kernel": KERNEL_CONFIG}


def model_config(args) -> Glm5Config:
    fields = dict(CONFIGS[args.config])
    if args.layers:
        fields["num_hidden_layers"] = args.layers
    if args.experts:
        fields["n_routed_experts"] = args.experts
    fields["max_position_embeddings"] = max(fields.get("max_position_embeddings", 0), args.seq)
    return Glm5Config(**fields)


def global_batch(step: int, rows: int, seq: int, vocab: int, motif: int = 16) -> torch.Tensor:
    """Step `step`'s [rows, seq] tokens: each row a random motif repeated (next-token loss falls as it learns
    to copy). Seeded by step only, so every world sees the same batches."""
    g = torch.Generator().manual_seed(1000 + step)
    motifs = torch.randint(0, vocab, (rows, motif), generator=g)
    return motifs.repeat(1, seq // motif + 1)[:, :seq]


def train_rank(rank: int, world: int, port: int, args, out: str) -> None:
    cuda = args.device == "cuda"
    if cuda:
        torch.cuda.set_device(rank)
    if not cuda:  # a CPU run on a GPU machine: hidden GPUs make both init_distributed (gloo) and DeepSpeed's
        # accelerator (where it places the model and the ZeRO-3 partitions) choose the CPU
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    init_distributed(DistEnv(rank=rank, world_size=world, local_rank=rank, master_port=port))
    dist = torch.distributed
    config = model_config(args)
    dtype = torch.bfloat16 if cuda else torch.float32
    model = build_random(config, seed=0, randomise=False)  # same seed on every rank: the same initial weights
    n_params = sum(p.numel() for p in model.parameters())
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    model = model.to(device=device, dtype=dtype).train()
    if args.checkpointing:
        model.gradient_checkpointing_enable()
    engine = deepspeed_engine(model, args.lr, 0.0, 1.0, zero_stage=3, dtype=dtype)
    per_rank = args.batch // world
    micro = args.micro_rows
    losses, times, tokens = [], [], 0
    for step in range(args.steps):
        rows = global_batch(step, args.batch, args.seq, config.vocab_size)[rank::world].to(device)
        if cuda:
            torch.cuda.synchronize()
        started = time.perf_counter()
        seen = []

        def micro_loss(chunk, seen=seen):
            def compute():
                loss = engine(input_ids=chunk, labels=chunk, logits_to_keep=None).loss
                seen.append(loss.detach().float())
                return loss * chunk.shape[0] / per_rank  # the rank's mean over its rows
            return compute

        accumulate_and_step(engine, [micro_loss(rows[i:i + micro]) for i in range(0, per_rank, micro)])
        mean = torch.stack(seen).mean().to(device)
        dist.all_reduce(mean)
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - started)
        losses.append(float(mean) / world)
        if step >= args.warmup:
            tokens += per_rank * args.seq
        if rank == 0:
            print(f"  world {world} step {step + 1}: loss {losses[-1]:.5f} ({times[-1]:.2f} s)", flush=True)
    timed = sum(times[args.warmup:]) or float("nan")
    result = {"world": world, "rank": rank, "params": n_params, "losses": losses, "step_s": times,
              "tokens_per_s_per_gpu": tokens / timed,
              "peak_memory_gib": torch.cuda.max_memory_allocated(device) / 2**30 if cuda else None}
    Path(out).write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


def _spawned(rank: int, world: int, port: int, args, folder: str) -> None:
    train_rank(rank, world, port, args, f"{folder}/rank{rank}.json")


def run_world(world: int, args, folder: Path) -> dict:
    import torch.multiprocessing as mp

    from models.deepspeed_worker import free_port

    folder.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("NCCL_CUMEM_ENABLE", "0")
    mp.spawn(_spawned, args=(world, free_port(), args, str(folder)), nprocs=world, join=True)
    ranks = [json.loads((folder / f"rank{r}.json").read_text()) for r in range(world)]
    return {"world": world, "params": ranks[0]["params"], "losses": ranks[0]["losses"],
            "step_s": [max(r["step_s"][i] for r in ranks) for i in range(args.steps)],
            "tokens_per_s_per_gpu": min(r["tokens_per_s_per_gpu"] for r in ranks),
            "peak_memory_gib": [r["peak_memory_gib"] for r in ranks]}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser()
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--worlds", type=int, nargs="+", default=[1, 2])
    p.add_argument("--config", choices=sorted(CONFIGS), default="kernel")
    p.add_argument("--layers", type=int, default=0)
    p.add_argument("--experts", type=int, default=0)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--batch", type=int, default=16, help="rows per global batch (divisible by every world)")
    p.add_argument("--micro-rows", type=int, default=0, help="rows per forward; default: a rank's share at the "
                   "largest world, so every GPU does the same work per micro-batch")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--checkpointing", action="store_true")
    p.add_argument("--out", default="outputs/bench/zero3_glm5")
    args = p.parse_args(argv)
    if any(args.batch % w for w in args.worlds):
        p.error(f"--batch {args.batch} is not divisible by every world in {args.worlds}")
    args.micro_rows = args.micro_rows or args.batch // max(args.worlds)
    if args.device == "cuda" and max(args.worlds) > torch.cuda.device_count():
        p.error(f"--worlds {args.worlds}: only {torch.cuda.device_count()} GPU(s) here")
    args.warmup = min(args.warmup, args.steps - 1)
    results = {w: run_world(w, args, Path(args.out) / f"world{w}") for w in args.worlds}
    base = results[min(args.worlds)]
    print(f"\nGLM-5.2 architecture, {base['params'] / 1e6:.0f}M parameters ({args.config}), ZeRO-3, {args.device}, "
          f"seq {args.seq}, global batch {args.batch} rows, micro-batch {args.micro_rows} rows, {args.steps} steps")
    print(f"{'world':>5} {'tokens/s/GPU':>13} {'vs 1':>6} {'peak GiB/GPU':>13} {'max |Δloss| vs 1':>17}")
    for w, r in results.items():
        diff = max(abs(a - b) for a, b in zip(r["losses"], base["losses"]))
        r["max_loss_diff"] = diff
        mem = max(m for m in r["peak_memory_gib"] if m is not None) if args.device == "cuda" else float("nan")
        print(f"{w:>5} {r['tokens_per_s_per_gpu']:>13.0f} {r['tokens_per_s_per_gpu'] / base['tokens_per_s_per_gpu']:>6.2f} "
              f"{mem:>13.2f} {diff:>17.2e}")
    summary = {"args": vars(args), "results": results}
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "summary.json").write_text(json.dumps(summary, indent=1))
    return summary


if __name__ == "__main__":
    main()
