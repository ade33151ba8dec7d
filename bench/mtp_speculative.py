"""MTP speculative decoding in the LocalEngine: acceptance length and decode speed against plain decoding.

    python bench/mtp_speculative.py [--model glm52-tiny] [--fit-steps 200] [--draft-steps 1 2 3]
    python bench/mtp_speculative.py --random-config kernel --device cuda     # docs/GLM52.md §9B dims on a GPU

A random checkpoint's MTP layer drafts noise (acceptance length 1.0), so the bench first fits it to the model's
own greedy continuations of random prompts (self-distillation: only the MTP layer trains, with the MTP loss of
models/glm5/mtp.py; the target model is unchanged, so its outputs are too). Then, on other prompts, the same
batch is decoded greedily with plain decoding (the peer) and with k = 1, 2, 3 drafts a round: generated
tokens/s, the acceptance length (tokens emitted per target forward) and whether the outputs are identical.
"""

from __future__ import annotations

import argparse
import asyncio
import time

import torch

from models import load_model, resolve_model_path
from rollout.local_engine import LocalEngine
from rollout.types import SamplingParams


def prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(10, vocab, (n, length), generator=g).tolist()


def decode(model, batch: list[list[int]], new_tokens: int, steps: int = 0):
    engine = LocalEngine(model, max_batch_size=len(batch), speculative_steps=steps)
    sampling = SamplingParams(temperature=0.0, max_new_tokens=new_tokens, ignore_eos=True)

    async def go():
        return await asyncio.gather(*(engine.generate(p, sampling) for p in batch))
    try:
        started = time.perf_counter()
        results = asyncio.run(go())
        return results, time.perf_counter() - started, engine.speculative_metrics()
    finally:
        engine.close()


def fit_mtp(model, sequences: torch.Tensor, steps: int, mtp_steps: int, lr: float, batch: int) -> list[float]:
    backbone = model.get_decoder()
    mtp_params = [p for p in backbone.layers[backbone.config.num_hidden_layers:].parameters()]
    for p in model.parameters():
        p.requires_grad_(False)
    for p in mtp_params:
        p.requires_grad_(True)
    opt = torch.optim.AdamW(mtp_params, lr=lr)
    model.train()
    losses = []
    g = torch.Generator().manual_seed(0)
    for step in range(steps):
        rows = sequences[torch.randint(0, len(sequences), (batch,), generator=g)].to(model.device)
        out = model(input_ids=rows, logits_to_keep=None, mtp_steps=mtp_steps)
        opt.zero_grad()
        out.mtp.loss.backward()
        opt.step()
        losses.append(float(out.mtp.loss.detach()))
        if step % 50 == 0 or step == steps - 1:
            print(f"  fit step {step + 1}: MTP loss {losses[-1]:.3f} (per step {[round(float(c), 3) for c in out.mtp.ce]})",
                  flush=True)
    model.eval()
    return losses


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="glm52-tiny")
    p.add_argument("--fit-steps", type=int, default=200)
    p.add_argument("--fit-prompts", type=int, default=64)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--new-tokens", type=int, default=96)
    p.add_argument("--draft-steps", type=int, nargs="+", default=[1, 2, 3])
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--random-config", choices=["kernel"], default=None,
                   help="instead of --model: a random GLM-5.2 model of docs/GLM52.md §9B's dimensions (8 layers, "
                        "hidden 1024, one MTP layer), built in-process (no tokenizer needed), fp32")
    args = p.parse_args(argv)
    torch.manual_seed(0)
    if args.random_config:
        from models.glm5.config import Glm5Config
        from models.glm5.tiny import KERNEL_CONFIG, build_random

        model = build_random(Glm5Config(**dict(KERNEL_CONFIG, dtype="float32"))).to(args.device).eval()
        name = f"random {args.random_config} config"
    else:
        model = load_model(str(resolve_model_path(args.model)), "policy", device=args.device)
        name = args.model
    vocab = model.config.vocab_size
    print(f"{name}: {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters on {args.device}, "
          f"torch threads {torch.get_num_threads()}")

    if args.fit_steps:
        train_prompts = prompts(args.fit_prompts, args.prompt_len, vocab, seed=1)
        outs, _, _ = decode(model, train_prompts, args.new_tokens)
        sequences = torch.tensor([pr + o.output_ids for pr, o in zip(train_prompts, outs)])
        print(f"fitting the MTP layer on {len(sequences)} greedy continuations ({args.fit_steps} steps)")
        fit_mtp(model, sequences, args.fit_steps, max(args.draft_steps), args.lr, batch=8)

    test_prompts = prompts(args.batch, args.prompt_len, vocab, seed=2)
    base, base_s, _ = decode(model, test_prompts, args.new_tokens)
    tokens = sum(len(r.output_ids) for r in base)
    print(f"\nbatch {args.batch}, {args.new_tokens} new tokens each, greedy")
    print(f"{'decoding':>12} {'tokens/s':>9} {'vs plain':>9} {'accept length':>14} {'same output':>12}")
    print(f"{'plain':>12} {tokens / base_s:>9.0f} {1.0:>9.2f} {'':>14} {'':>12}")
    rows = {"plain": {"tokens_per_s": tokens / base_s}}
    for k in args.draft_steps:
        res, secs, metrics = decode(model, test_prompts, args.new_tokens, steps=k)
        same = all(a.output_ids == b.output_ids for a, b in zip(base, res))
        accept = 1 + metrics["engine/speculative_accepted"] / max(metrics["engine/speculative_rounds"], 1)
        rows[f"k={k}"] = {"tokens_per_s": tokens / secs, "accept_length": accept, "same_output": same}
        print(f"{f'MTP k={k}':>12} {tokens / secs:>9.0f} {base_s / secs:>9.2f} {accept:>14.2f} {str(same):>12}")
    return rows


if __name__ == "__main__":
    main()
