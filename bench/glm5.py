"""Training throughput of our GLM-5.2 model against transformers' GlmMoeDsa: same config, same run, one GPU.

    python bench/glm5.py                                          # GPU: 4K-32K, ours vs transformers, MFU
    python bench/glm5.py --seqs 16384 32768 65536 --index-share   # + IndexShare's saving (freq 4 vs 1)
    python bench/glm5.py --layers 16 --experts 32 --seqs 32768 --only ours     # ≥ 1B parameters at 32K
    python bench/glm5.py --device cpu --config tiny --seqs 64 128 --steps 1    # a smoke run (the CPU test's)
    python bench/glm5.py --seqs 4096 --profile                                  # where a step's time goes
    python bench/glm5.py --seqs 8192 --only ours --sparse-kernel torch          # without the fused Triton kernel
    python bench/glm5.py --seqs 8192 16384 --only ours --set masked_attn_max_keys=0   # never the masked path

Per sequence length (batch 1): forward + backward of the next-token loss on random tokens (no optimiser step),
`--steps` timed after one warm-up, training tokens/s and peak memory; a run that does not fit reports OOM. Each
side computes the loss its own way: ours in checkpointed row chunks of the LM head (never the full [S, V]
logits), transformers from its full logits. Gradient checkpointing is off unless a length needs it
(`--checkpointing auto`: retried with it after an OOM; the row says which).

MFU: model FLOPs per training token (3 × forward: 2 × the activated parameters without the embedding, the
absorbed-form sparse attention 2·k'·H·(2·d_c + d_r) with k' = min(top-k, keys), and the indexer 2·H_I·d_I·keys
per full layer, keys = the causal average (S + 1) / 2; docs/GLM52.md §10) over the bf16 peak measured in the same run
(a large matmul). The config defaults to docs/GLM52.md §9B's dimensions (models.glm5.tiny.KERNEL_CONFIG: hidden 1024,
16 heads, kv_lora 512, rope 64, v 256, indexer 32 × 128) with GLM-5.2's real top-k of 2048.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from models.glm5.config import Glm5Config  # noqa: E402
from models.glm5.tiny import KERNEL_CONFIG, TINY_CONFIG, build_random  # noqa: E402

_NO_SPECIAL = dict(pad_token_id=None, bos_token_id=None, eos_token_id=None)  # random tokens; no padding
CONFIGS = {"kernel": dict(KERNEL_CONFIG, index_topk=2048, **_NO_SPECIAL),
           "tiny": dict(TINY_CONFIG, vocab_size=512, **_NO_SPECIAL)}


def model_config(args, **changes) -> Glm5Config:
    fields = dict(CONFIGS[args.config])
    if args.layers:
        fields["num_hidden_layers"] = args.layers
    if args.experts:
        fields["n_routed_experts"] = args.experts
    fields["max_position_embeddings"] = max(fields.get("max_position_embeddings", 0), max(args.seqs))
    fields["dtype"] = "bfloat16" if args.device == "cuda" else "float32"
    fields["sparse_attn_kernel"] = args.sparse_kernel
    for item in args.set:  # e.g. masked_attn_max_keys=0
        key, _, value = item.partition("=")
        if key not in Glm5Config.__dataclass_fields__:
            raise SystemExit(f"--set: Glm5Config has no field {key!r}")
        try:
            fields[key] = json.loads(value)  # numbers, true/false/null, lists
        except ValueError:
            fields[key] = value  # a plain string, e.g. sparse_attn_kernel=torch
    fields.update(changes)
    return Glm5Config(**fields)


def activated_params(cfg: Glm5Config) -> float:
    """Parameters a token passes through, without the input embedding: attention, indexer where present,
    dense MLP or (shared + top-k routed experts + router), norms ignored, LM head."""
    d, h = cfg.hidden_size, cfg.num_attention_heads
    attn = (d * cfg.q_lora_rank + cfg.q_lora_rank * h * (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim)
            + d * (cfg.kv_lora_rank + cfg.qk_rope_head_dim)
            + cfg.kv_lora_rank * h * (cfg.qk_nope_head_dim + cfg.v_head_dim) + h * cfg.v_head_dim * d)
    indexer = cfg.q_lora_rank * cfg.index_n_heads * cfg.index_head_dim + d * cfg.index_head_dim + d * cfg.index_n_heads
    total = 0.0
    for kind, mlp in zip(cfg.indexer_types, cfg.mlp_layer_types):
        total += attn + (indexer if kind == "full" else 0)
        if mlp == "dense":
            total += 3 * d * cfg.intermediate_size
        else:
            expert = 3 * d * cfg.moe_intermediate_size
            total += expert * (cfg.n_shared_experts + cfg.num_experts_per_tok) + d * cfg.n_routed_experts
    return total + d * cfg.vocab_size


def train_flops_per_token(cfg: Glm5Config, seq: int) -> float:
    keys = (seq + 1) / 2
    k = min(cfg.index_topk, keys)
    attention = 2 * k * cfg.num_attention_heads * (2 * cfg.kv_lora_rank + cfg.qk_rope_head_dim)
    indexer = 2 * cfg.index_n_heads * cfg.index_head_dim * keys
    full = sum(kind == "full" for kind in cfg.indexer_types)
    forward = 2 * activated_params(cfg) + cfg.num_hidden_layers * attention + full * indexer
    return 3 * forward


def measured_peak_tflops(device: str) -> float:
    if device != "cuda":
        return float("nan")
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    n, t0 = 20, time.perf_counter()
    for _ in range(n):
        a @ b
    torch.cuda.synchronize()
    return 2 * 8192 ** 3 * n / (time.perf_counter() - t0) / 1e12


def build(side: str, cfg: Glm5Config, device: str, hf_attn: str = "sdpa"):
    """The model, created on `device` (initialised there: a 1B model's CPU init would take longer than the run)."""
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    with torch.device(device):
        if side == "ours":
            model = build_random(cfg, seed=0, randomise=False)
        else:
            from transformers import GlmMoeDsaConfig, GlmMoeDsaForCausalLM

            torch.manual_seed(0)
            hf_cfg = GlmMoeDsaConfig(**{k: v for k, v in cfg.to_hf().items() if k != "architectures"})
            hf_cfg._attn_implementation = hf_attn
            model = GlmMoeDsaForCausalLM(hf_cfg)
    return model.to(dtype=dtype).train()


def step(side: str, model, ids: torch.Tensor) -> None:
    if side == "ours":
        loss = model(input_ids=ids, labels=ids, logits_to_keep=None).loss
    else:
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    model.zero_grad(set_to_none=True)


def measure(side: str, model, seq: int, args) -> dict:
    """tokens/s and peak GiB of `--steps` fwd+bwd steps after one warm-up; {'oom': True} when it does not fit
    (with `--checkpointing auto`, after a second try with gradient checkpointing)."""
    modes = {"off": [False], "on": [True], "auto": [False, True]}[args.checkpointing]
    vocab = model.config.vocab_size
    for ckpt in modes:
        (model.gradient_checkpointing_enable if ckpt else model.gradient_checkpointing_disable)()
        try:
            ids = torch.randint(0, vocab, (1, seq), device=args.device,
                                generator=torch.Generator(args.device).manual_seed(seq))
            if args.device == "cuda":
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
            step(side, model, ids)  # warm-up (kernel selection, allocator)
            times = []
            for _ in range(args.steps):
                if args.device == "cuda":
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
                step(side, model, ids)
                if args.device == "cuda":
                    torch.cuda.synchronize()
                times.append(time.perf_counter() - t0)
            peak = torch.cuda.max_memory_allocated() / 2 ** 30 if args.device == "cuda" else float("nan")
            return {"tokens_per_s": seq / statistics.median(times), "peak_gib": peak, "checkpointing": ckpt}
        except torch.OutOfMemoryError:
            model.zero_grad(set_to_none=True)
            if args.device == "cuda":
                torch.cuda.empty_cache()
    return {"oom": True, "checkpointing": modes[-1]}


def profile(side: str, model, seq: int, args) -> None:
    """The 25 costliest operators of one more step, by device time (on a GPU) and by host CPU time."""
    from torch.profiler import ProfilerActivity, profile as torch_profile

    ids = torch.randint(0, model.config.vocab_size, (1, seq), device=args.device)
    cuda = args.device == "cuda"
    with torch_profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        step(side, model, ids)
        if cuda:
            torch.cuda.synchronize()
    table = prof.key_averages()
    for key in (["self_device_time_total"] if cuda else []) + ["self_cpu_time_total"]:  # host stalls show in CPU time
        print(f"profile of one {side} step at {seq} tokens, by {key}:\n" + table.table(sort_by=key, row_limit=25),
              flush=True)


def run_side(side: str, cfg: Glm5Config, args) -> list[dict]:
    """Every length on one model (one model on the GPU at a time, so each side's peak memory is its own)."""
    model = build(side, cfg, args.device, args.hf_attn)
    try:
        results = []
        for seq in args.seqs:  # each figure printed as it comes: a long run cut short still reports
            results.append(measure(side, model, seq, args))
            print(f"  {side} at {seq}: {json.dumps(results[-1])}", flush=True)
            if args.profile and seq == args.seqs[0] and not results[-1].get("oom"):
                profile(side, model, seq, args)
        return results
    finally:
        del model
        if args.device == "cuda":
            torch.cuda.empty_cache()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--config", default="kernel", choices=list(CONFIGS))
    p.add_argument("--layers", type=int, default=0)
    p.add_argument("--experts", type=int, default=0)
    p.add_argument("--seqs", type=int, nargs="+", default=[4096, 8192, 16384, 32768])
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--only", choices=["ours", "transformers"], default=None)
    p.add_argument("--checkpointing", choices=["off", "on", "auto"], default="auto")
    p.add_argument("--sparse-kernel", choices=["auto", "torch"], default="auto",
                   help="ours' sparse attention: the fused Triton kernel where usable (auto) or the chunked torch path")
    p.add_argument("--set", nargs="*", default=[], metavar="FIELD=VALUE",
                   help="override Glm5Config fields of both models, e.g. masked_attn_max_keys=0 (never the masked "
                        "path) or indexer_query_chunk=1024")
    p.add_argument("--hf-attn", default="sdpa", choices=["sdpa", "eager"],
                   help="transformers' attention (sdpa, its default, is its fastest here; both mask densely by the top-k)")
    p.add_argument("--index-share", action="store_true", help="also time ours with an indexer in every layer")
    p.add_argument("--out", default=None, help="write the figures as JSON here")
    p.add_argument("--profile", action="store_true", help="print each side's costliest operators at the first length")
    args = p.parse_args()

    cfg = model_config(args)
    with torch.device("meta"):
        n_params = sum(p.numel() for p in build_random(cfg, randomise=False).parameters())
    peak = measured_peak_tflops(args.device)
    sides = [args.only] if args.only else ["ours", "transformers"]
    print(f"config {args.config}: {n_params / 1e6:.0f}M parameters, {cfg.num_hidden_layers} layers "
          f"({sum(k == 'full' for k in cfg.indexer_types)} with an indexer), {cfg.n_routed_experts} experts "
          f"top-{cfg.num_experts_per_tok}, top-k {cfg.index_topk}; {args.device}, measured bf16 peak {peak:.0f} TFLOP/s")
    runs = {side: run_side(side, cfg, args) for side in sides}
    if args.index_share:
        every = model_config(args, index_topk_freq=1, index_skip_topk_offset=0, indexer_types=None)
        runs["ours_indexer_every_layer"] = run_side("ours", every, args)
    rows = []
    for i, seq in enumerate(args.seqs):
        row = {"seq": seq, "flops_per_token": train_flops_per_token(cfg, seq)}
        for name, results in runs.items():
            row[name] = results[i]
            if "tokens_per_s" in row[name] and name in sides:
                row[name]["mfu"] = row[name]["tokens_per_s"] * row["flops_per_token"] / (peak * 1e12)
        rows.append(row)
        print(line(row, sides))
    if args.out:
        Path(args.out).write_text(json.dumps({"args": vars(args), "parameters": n_params, "peak_tflops": peak,
                                              "rows": rows}, indent=1))


def line(row: dict, sides: list[str]) -> str:
    parts = [f"seq {row['seq']:>6}"]
    for side in sides:
        r = row[side]
        if r.get("oom"):
            parts.append(f"{side}: OOM")
        else:
            parts.append(f"{side}: {r['tokens_per_s']:9.0f} tok/s {r['peak_gib']:6.1f} GiB MFU {r['mfu']:.1%}"
                         + (" (ckpt)" if r["checkpointing"] else ""))
    if len(sides) == 2 and all("tokens_per_s" in row[s] for s in sides):
        parts.append(f"ours/transformers {row['ours']['tokens_per_s'] / row['transformers']['tokens_per_s']:.2f}x")
    if "ours_indexer_every_layer" in row and "tokens_per_s" in row.get("ours", {}) \
            and "tokens_per_s" in row["ours_indexer_every_layer"]:
        every = row["ours_indexer_every_layer"]["tokens_per_s"]
        parts.append(f"IndexShare: {row['ours']['tokens_per_s'] / every:.2f}x the tokens/s of an indexer per layer")
    return " | ".join(parts)


if __name__ == "__main__":
    main()
