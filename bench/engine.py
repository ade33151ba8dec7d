"""LocalEngine throughput against transformers' `generate` on the same model, prompts and lengths.

    python bench/engine.py [--model smollm2-135m-instruct] [--batch 16] [--new-tokens 64] [--device auto]

Both sample at temperature 1 with a fixed number of new tokens (no early stop), from the same left-padded
prompts; we report generated tokens per second and the ratio. LocalEngine additionally returns the logprob of
every sampled token (HF `generate` is asked for its scores too, to make the work comparable).
"""

from __future__ import annotations

import argparse
import asyncio
import time

import torch

from models import load_model, load_tokenizer
from rollout.local_engine import LocalEngine
from rollout.types import SamplingParams

PROMPTS = ["Write a Python function that reverses a string.", "What is the capital of France?",
           "Explain recursion in one paragraph.", "Write a haiku about compilers.",
           "How do I sort a list of dicts by a key in Python?", "Give three uses of a hash map."]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--device", default="auto", help="auto (CUDA when there is one), cpu, cuda, cuda:N")
    p.add_argument("--dtype", default=None, help="default: bfloat16 on a GPU, float32 on the CPU")
    args = p.parse_args()
    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available()
                          else "cpu" if args.device == "auto" else args.device)
    dtype = args.dtype or ("bfloat16" if device.type == "cuda" else "float32")
    tok = load_tokenizer(args.model)
    model = load_model(args.model, dtype=dtype, device=device).eval()
    prompts = [tok.apply_chat_template([{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}],
                                       add_generation_prompt=True, tokenize=True, return_dict=False)
               for i in range(args.batch)]
    total = args.batch * args.new_tokens
    print(f"{args.model}: batch {args.batch}, {args.new_tokens} new tokens, {device} {dtype}, "
          f"torch threads {torch.get_num_threads()}")

    tok.padding_side = "left"
    enc = tok.pad({"input_ids": prompts}, return_tensors="pt").to(device)
    # Warm-up outside the timings (CUDA context, cuBLAS handles, allocator): a few tokens through each.
    with torch.inference_mode():
        model.generate(**enc, do_sample=True, max_new_tokens=4, pad_token_id=tok.pad_token_id)
    warm = LocalEngine(model, tok, max_batch_size=args.batch)
    asyncio.run(warm.generate(prompts[0], SamplingParams(temperature=1.0, max_new_tokens=4, seed=0)))
    warm.close()
    torch.manual_seed(0)
    _sync(device)
    start = time.perf_counter()
    with torch.inference_mode():
        model.generate(**enc, do_sample=True, temperature=1.0, top_p=None, top_k=None, max_new_tokens=args.new_tokens,
                       min_new_tokens=args.new_tokens, output_scores=True, return_dict_in_generate=True,
                       pad_token_id=tok.pad_token_id)
    _sync(device)
    hf_s = time.perf_counter() - start

    engine = LocalEngine(model, tok, max_batch_size=args.batch)

    async def run():
        return await asyncio.gather(*[engine.generate(p, SamplingParams(temperature=1.0, max_new_tokens=args.new_tokens,
                                                                        seed=i)) for i, p in enumerate(prompts)])
    start = time.perf_counter()
    results = asyncio.run(run())
    _sync(device)
    ours_s = time.perf_counter() - start
    engine.close()
    assert sum(len(r.output_ids) for r in results) == total
    print(f"HF generate:  {total / hf_s:7.1f} tokens/s ({hf_s:.1f} s)")
    print(f"LocalEngine:  {total / ours_s:7.1f} tokens/s ({ours_s:.1f} s)")
    print(f"ratio (LocalEngine / HF): {hf_s / ours_s:.2f}x")


if __name__ == "__main__":
    main()
