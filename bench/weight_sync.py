"""Weight sync from a trainer group, per path: seconds and GB/s, each sync verified.

    python bench/weight_sync.py [--ranks 1] [--zero 0] [--bucket-mb 64] [--repeats 3] [--paths object tensor disk]

The policy is a random GLM-5.2-architecture checkpoint (models/glm5/tiny.py's KERNEL_CONFIG shape, bf16) that
our code writes; the actor is a real `TrainerGroup` of `ActorWorker`s (rl/group.py) on this host's device.
Paths:
- `object`: the LocalEngine path: every rank puts its share of the buckets into Ray's object store, and a
  consumer pulls them all (here a Ray task standing in for the rollout workers, so the bytes really move);
  verified by comparing what arrived with the trainer's gathered weights.
- `tensor`, `distributed`, `disk`: to a real SGLang server (GPU only; SGLang importable or RL_SGLANG_PYTHONPATH
  set): CUDA IPC handles of our bucket copies (colocated), an NCCL broadcast (needs the server on another GPU
  than the trainer: skipped on one GPU, where NCCL refuses two processes), or an HF folder the server reloads.
  Before each sync the actor takes a PPO step (lr 1e-3, random advantages), so every sync delivers new
  weights; it is verified by the server's input logprobs on three prompts against the trainer's own: the mean
  |difference| before the sync (stale weights) and after (bf16 noise).
The figure per path is the best of `--repeats` syncs (the first one also pays for warm-up: IPC handles, the
NCCL group); all are printed.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import ray
import torch


@ray.remote(num_cpus=0)
def pull(refs: list) -> int:
    """What a rollout worker does with the buckets: fetch every one (the bytes cross the object store)."""
    return sum(t.numel() * t.element_size() for b in ray.get(refs) for t in b.values())


def write_policy(folder: Path) -> None:
    from models.glm5.config import Glm5Config
    from models.glm5.tiny import KERNEL_CONFIG, build_random

    config = {**KERNEL_CONFIG, "vocab_size": 4096, "index_topk": 2048, "bos_token_id": 0, "eos_token_id": 1,
              "pad_token_id": 1}
    build_random(Glm5Config(**config), 0).to(torch.bfloat16).save_pretrained(folder)


def start_server(folder: Path, log_dir: Path):
    from rollout.sglang.server import SGLangServer

    site = os.environ.get("RL_SGLANG_PYTHONPATH", "")
    env = {"SGLANG_DSA_PREFILL_DENSE_ATTN_KV_LEN_THRESHOLD": "0", "HF_HUB_OFFLINE": "1", "NCCL_CUMEM_ENABLE": "0",
           "PYTHONUNBUFFERED": "1", **({"PYTHONPATH": site} if site else {})}
    args = {"tp": 1, "kv-cache-dtype": "bfloat16", "dsa-prefill-backend": "flashmla_sparse",
            "dsa-decode-backend": "flashmla_sparse", "sampling-backend": "pytorch", "mem-fraction-static": 0.3,
            "context-length": 4096, "disable-cuda-graph": True, "skip-tokenizer-init": True,
            "max-total-tokens": 16384}
    server = SGLangServer(str(folder), args, env=env, name="sglang-sync-bench", log_dir=str(log_dir),
                          startup_timeout_s=540)
    server.start()
    return server


def prompts(n: int = 3, seed: int = 0) -> list[dict]:
    """Token sequences scored by both sides (every position after the first is compared)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for length in (64, 300, 1000)[:n]:
        ids = torch.randint(2, 4096, (length,), generator=g)
        out.append({"token_ids": ids, "loss_mask": torch.ones(length).index_fill_(0, torch.tensor([0]), 0.0)})
    return out


def parity(url: str, actor, samples: list[dict]) -> float:
    """Mean |log p_server − log p_trainer| over every scored token: the server's input logprobs (bf16, its own
    kernels) against the trainer's own (its current weights). After a sync this is numerical noise (~0.01);
    against stale weights it is the size of the update."""
    import asyncio

    from rollout.sglang.client import SGLangClient

    async def served() -> list[torch.Tensor]:
        client = SGLangClient(url)
        try:
            bodies = await asyncio.gather(*(client.post("/generate", {
                "input_ids": s["token_ids"].tolist(), "return_logprob": True, "logprob_start_len": 0,
                "sampling_params": {"max_new_tokens": 1, "temperature": 0.0}}) for s in samples))
        finally:
            await client.close()
        return [torch.tensor([lp for lp, *_ in b["meta_info"]["input_token_logprobs"][1:]]) for b in bodies]

    ours = actor.compute_logprobs(samples).result()["old_logprobs"]
    theirs = asyncio.run(served())
    return float(torch.cat([(o[1:] - t).abs() for o, t in zip(ours, theirs)]).mean())


def move_weights(actor) -> None:
    """One PPO step with a large learning rate on random advantages: the weights the next sync must deliver."""
    g = torch.Generator().manual_seed(int(time.time()))
    batch = []
    for s in prompts():
        n = len(s["token_ids"])
        batch.append({**s, "rollout_logprobs": torch.full((n,), -8.0),
                      "advantages": torch.randn(n, generator=g) * s["loss_mask"]})
    actor.train_step(batch).result()


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser()
    p.add_argument("--ranks", type=int, default=1)
    p.add_argument("--zero", type=int, default=0)
    p.add_argument("--bucket-mb", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--paths", nargs="+", default=["object", "tensor", "distributed", "disk"])
    p.add_argument("--out", default="")
    args = p.parse_args(argv)
    from models.deepspeed_worker import OptimConfig
    from rl.actor import ActorWorker
    from rl.config import AlgorithmConfig
    from rl.group import TrainerGroup

    gpus = torch.cuda.device_count()
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault("NCCL_CUMEM_ENABLE", "0")
    ray.init(num_cpus=os.cpu_count(), num_gpus=gpus, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"NCCL_CUMEM_ENABLE": "0"}})
    root = Path(tempfile.mkdtemp(prefix="sync-bench-"))
    folder = root / "policy"
    write_policy(folder)
    sglang_paths = [x for x in args.paths if x != "object"]
    server = None
    if sglang_paths and gpus:
        try:
            server = start_server(folder, root)
        except Exception as e:  # a host without SGLang: the object-store path alone
            print(f"no SGLang server ({e}); measuring the object-store path only")
    share = 0.4 if gpus else 0.0
    actor = TrainerGroup(ActorWorker, args.ranks, share, "actor", str(folder),
                         OptimConfig(learning_rate=1e-3, zero_stage=args.zero),
                         AlgorithmConfig(use_reference=False, mask_low=0, mask_high=0, veto=0), dtype="bfloat16",
                         torch_threads=4)
    nbytes = sum(t.numel() * t.element_size() for t in actor.gathered_state().values())
    scored = prompts()
    results: dict = {"ranks": args.ranks, "zero": args.zero, "bucket_mb": args.bucket_mb, "gb": nbytes / 1e9,
                     "device": torch.cuda.get_device_name(0) if gpus else "cpu", "paths": {}}
    for path in args.paths:
        runs = []
        for version in range(1, args.repeats + 1):
            if path == "object":
                move_weights(actor)
                state = actor.gathered_state()
                started = time.perf_counter()
                refs = actor.weight_bucket_refs(args.bucket_mb)
                moved = ray.get(pull.remote(refs))
                seconds = time.perf_counter() - started
                got = {k: v for r in refs for k, v in ray.get(r).items()}
                diff = max(float((got[k].float() - state[k].float()).abs().max()) for k in state)
                runs.append({"seconds": seconds, "bytes": moved, "buckets": len(refs), "max_abs_diff": diff})
            elif server is None or (path == "distributed" and gpus < 2):
                why = "no SGLang server" if server is None else "one GPU: NCCL refuses two processes on it"
                results["paths"][path] = {"skipped": why}
                break
            else:
                move_weights(actor)
                stale = parity(server.url, actor, scored)
                urls = [server.url]
                call = {"disk": ("push_sglang_disk", urls, version, str(root / "sync"), "in_place"),
                        "tensor": ("push_sglang_tensors", urls, version, args.bucket_mb, [1], "in_place"),
                        "distributed": ("push_sglang_group", urls, version, args.bucket_mb, [1], "in_place",
                                        version == 1)}[path]
                stats = actor.on_every_rank(*call)
                runs.append({"seconds": stats["seconds"], "bytes": stats.get("bytes", nbytes),
                             "buckets": stats.get("buckets", 0), "logprob_diff_before": stale,
                             "logprob_diff_after": parity(server.url, actor, scored)})
        if runs:
            best = min(runs, key=lambda r: r["seconds"])
            results["paths"][path] = {**best, "gb_per_s": best["bytes"] / 1e9 / best["seconds"], "runs": runs}
    if server is not None:
        server.stop()
    actor.shutdown()
    ray.shutdown()
    print(f"weight sync of {results['gb']:.3f} GB ({args.ranks} rank(s), ZeRO-{args.zero}, buckets of "
          f"{args.bucket_mb} MB) on {results['device']}")
    base = results["paths"].get("object", {}).get("gb_per_s")
    for path, r in results["paths"].items():
        if "skipped" in r:
            print(f"  {path:11s} skipped: {r['skipped']}")
            continue
        ratio = f" ({r['gb_per_s'] / base:.2f}x the object store)" if base and path != "object" else ""
        runs = ", ".join(f"{x['seconds']:.3f}" for x in r["runs"])
        check = (f"weights equal to {r['max_abs_diff']:.1e}" if "max_abs_diff" in r else
                 f"mean |d logprob| server vs trainer {r['logprob_diff_before']:.3f} before, "
                 f"{r['logprob_diff_after']:.4f} after")
        print(f"  {path:11s} {r['seconds']:.3f} s, {r['gb_per_s']:.2f} GB/s{ratio}, {r['buckets']} buckets, "
              f"{check}; all runs {runs} s")
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))
    return results


if __name__ == "__main__":
    main()
