"""Where a trainer step's time goes: one ActorWorker (no Ray, one process) runs the PPO step's two passes on
rollout-shaped samples, π_old/π_ref logprobs and the update, timed each and then under torch.profiler, whose
top operators (by device time, then host time) are printed and written to --out.

    python bench/profile_step.py --model smollm2-shape --samples 64 --lengths 1200 2048 \
        --micro-batch-tokens 16384 --tf32 --out /tmp/profile          # the long-horizon recipe's step, one GPU
    ... --autocast      # the same step with bf16 autocast (trainer.bf16_autocast), against it without, in one run

The long-horizon runs train ~550k tokens a step at 35-38k tokens/s on an H100 (docs/RESULTS.md, sixth run), a few
percent of what the GPU's TF32 tensor cores do for a 135M model; this says which operators take the rest. The
ratio printed is against the update's own forward pass (the logprob pass), measured in the same process.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from trainer_scaling import model_path, samples  # noqa: E402  (bench/, the script's folder)
from models.batching import split_per_sample  # noqa: E402
from models.deepspeed_worker import OptimConfig  # noqa: E402
from rl.actor import ActorWorker  # noqa: E402
from rl.config import AlgorithmConfig  # noqa: E402


def synced(fn):
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    started = time.perf_counter()
    out = fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return out, time.perf_counter() - started


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-shape")
    p.add_argument("--samples", type=int, default=64)
    p.add_argument("--lengths", type=int, nargs=2, default=(1200, 2048), metavar=("MIN", "MAX"))
    p.add_argument("--micro-batch-tokens", type=int, default=16384)
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--tf32", action="store_true")
    p.add_argument("--autocast", action="store_true", help="bf16 autocast of the forward passes (trainer."
                   "bf16_autocast), timed against the same worker without it (the peer), in this process")
    p.add_argument("--mini-batches", type=int, default=1)
    p.add_argument("--attn", default="", help="transformers' attention implementation for the policy and the "
                   "reference (sdpa, the default; flex_attention skips the masked blocks of packed rows but compiles per "
                   "micro-batch shape: it did not finish in 150 s on an H100; eager)")
    p.add_argument("--rows", type=int, default=25, help="operators shown per table")
    p.add_argument("--out", default="", help="folder for the tables (profile.txt)")
    args = p.parse_args(argv)

    batch = samples(args.samples, lengths=tuple(args.lengths))
    tokens = sum(len(s["token_ids"]) for s in batch)

    def make_worker(bf16_autocast: bool) -> ActorWorker:
        optim = OptimConfig(learning_rate=2e-5, micro_batch_tokens=args.micro_batch_tokens, tf32=args.tf32,
                            bf16_autocast=bf16_autocast)
        worker = ActorWorker(model_path(args.model), optim, AlgorithmConfig(mini_batches=args.mini_batches),
                             temperature=0.7, dtype=args.dtype)
        if args.attn:
            for model in (worker.module, worker.reference):
                model.set_attn_implementation(args.attn)
        return worker

    def prepare(out):
        for key, values in out.items():
            for s, v in zip(batch, split_per_sample(batch, values)):
                s[key] = v

    def timed(worker):
        """(π_old/π_ref seconds, update seconds, π_old) after a warm-up of both (allocator, kernels' tuning)."""
        prepare(synced(lambda: worker.compute_logprobs(batch, True, True))[0])
        synced(lambda: worker.train_step(batch))
        lp, logprob_s = synced(lambda: worker.compute_logprobs(batch, True, True))
        prepare(lp)
        return logprob_s, synced(lambda: worker.train_step(batch))[1], lp["old_logprobs"]

    peer = None
    if args.autocast:  # the same weights without autocast, first, in this process
        peer_worker = make_worker(False)
        peer = timed(peer_worker)
        del peer_worker
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    worker = make_worker(args.autocast)
    logprob_s, update_s, old = timed(worker)
    lines = [f"{args.model} {args.dtype}{' tf32' if args.tf32 else ''}{' bf16-autocast' if args.autocast else ''} "
             f"{args.attn or 'sdpa'} attention on {worker.device}: {args.samples} samples, "
             f"{tokens} tokens, micro-batches of {args.micro_batch_tokens}",
             f"π_old + π_ref pass: {logprob_s:.2f} s ({2 * tokens / logprob_s:,.0f} forward tokens/s)",
             f"update (forward + backward + step): {update_s:.2f} s ({tokens / update_s:,.0f} tokens/s, "
             f"{update_s / (logprob_s / 2):.2f}x one forward pass)"]
    if peer is not None:
        mask = torch.cat([torch.as_tensor(s["loss_mask"]) for s in batch]) > 0
        diff = (old.float() - peer[2].float()).abs()[mask]
        lines.append(f"against {args.dtype} without autocast (the peer): π_old + π_ref pass {peer[0]:.2f} s "
                     f"({peer[0] / logprob_s:.2f}x), update {peer[1]:.2f} s ({peer[1] / update_s:.2f}x); "
                     f"π_old |Δ| per action token: mean {diff.mean():.4f}, max {diff.max():.4f}")
    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        prepare(worker.compute_logprobs(batch, True, True))
        worker.train_step(batch)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    table = prof.key_averages()
    device_key = "self_cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
    lines += ["", f"by {device_key}:", table.table(sort_by=device_key, row_limit=args.rows, max_name_column_width=60),
              "", "by cpu_time_total:", table.table(sort_by="cpu_time_total", row_limit=args.rows,
                                                     max_name_column_width=60)]
    text = "\n".join(lines)
    print(text)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "profile.txt").write_text(text)
    result = {"tokens": tokens, "logprob_s": logprob_s, "update_s": update_s}
    if peer is not None:
        result.update(peer_logprob_s=peer[0], peer_update_s=peer[1], logprob_abs_diff_max=float(diff.max()))
    return result


if __name__ == "__main__":
    main()
