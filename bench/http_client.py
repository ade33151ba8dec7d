"""The SGLang client's HTTP transport at a rollout worker's concurrency: our aiohttp client against httpx.

    python bench/http_client.py [--concurrency 16 64 136 256] [--seconds 6] [--delay-ms 50] [--prompt-tokens 8000]
    python bench/http_client.py --sglang-model DIR [--concurrency 64 136] [--prompt-tokens 3500]   # GPU

A rollout worker keeps one request open per running episode (128 + 8 in the long-horizon recipes), each a
`/generate` with the whole context as `input_ids` and per-token logprobs in the answer. This bench runs N such
requests in flight, over and over, for `--seconds`, against a stand-in server in another process that answers
each after `--delay-ms` (the time a real server would spend generating) with an SGLang-shaped body. Both clients
send the same payload and parse the answer with the same `parse_generate`:
- `aiohttp`: `rollout.sglang.client.SGLangClient`, what the rollout workers use;
- `httpx`: an `httpx.AsyncClient` set up as our client was before (1,024 connections, 256 kept alive): the peer.
Printed per N: requests a second and the client process's CPU milliseconds a request (its own process time, the
server's excluded), and the ratios aiohttp / httpx. The server is the same for both and is never the limit at
the delay used unless the table says so (requests a second then flatten for both).

With `--sglang-model DIR` the server is a real SGLang (launched by `rollout.sglang.server.SGLangServer`, its site
tree from `RL_SGLANG_PYTHONPATH` as on our GPU machine) serving DIR; a DIR without config.json first gets a
random-weight model of the default policy's shape (SmolLM2-135M), so no checkpoint has to travel. Each request
slot then has its own random prompt, answered with `--output-tokens` sampled tokens (EOS ignored), and one pass
over every slot's prompt before the first timing puts all prompts in the radix cache for both clients alike; the
table adds generated tokens a second. There the server's batching, not a fixed delay, sets each answer's time,
and what the client costs shows as requests the server never got to batch.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from models.tiny import SMOLLM2_SHAPE  # noqa: E402
from rollout.sglang.client import SGLangClient, parse_generate  # noqa: E402
from rollout.sglang.server import free_port  # noqa: E402


def answer_body(output_tokens: int) -> bytes:
    return json.dumps({"text": "x" * (4 * output_tokens), "output_ids": list(range(output_tokens)),
                       "meta_info": {"id": "r", "finish_reason": {"type": "stop"}, "prompt_tokens": 8000,
                                     "completion_tokens": output_tokens, "cached_tokens": 7900, "weight_version": "0",
                                     "output_token_logprobs": [[-0.5, i, None] for i in range(output_tokens)]}}).encode()


def serve(port: int, delay_s: float, output_tokens: int, ready) -> None:
    """HTTP/1.1 with keep-alive: read a request (headers + Content-Length body), wait, answer."""
    body = answer_body(output_tokens)
    head = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body)

    async def handle(reader, writer):
        try:
            while True:
                header = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in header.split(b"\r\n"):
                    if line[:15].lower() == b"content-length:":
                        length = int(line[15:])
                if length:
                    await reader.readexactly(length)
                await asyncio.sleep(delay_s)
                writer.write(head + body)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()

    async def main():
        server = await asyncio.start_server(handle, "127.0.0.1", port, backlog=4096)
        ready.set()
        await server.serve_forever()

    asyncio.run(main())


def write_random_policy(folder: Path) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**SMOLLM2_SHAPE)).to(torch.bfloat16).save_pretrained(folder)


def start_sglang(model: Path, max_in_flight: int, context: int):
    """A real SGLang server on `model`, token ids in and out, decode CUDA graphs up to `max_in_flight`."""
    from rollout.sglang.server import SGLangServer

    if not (model / "config.json").exists():
        write_random_policy(model)
    args = {"skip-tokenizer-init": True, "attention-backend": "triton", "sampling-backend": "pytorch",
            "context-length": context, "max-running-requests": max(256, max_in_flight),
            "cuda-graph-max-bs-decode": max_in_flight, "disable-prefill-cuda-graph": True,
            "mem-fraction-static": 0.6, "random-seed": 0}
    env = {"PYTHONPATH": os.environ["RL_SGLANG_PYTHONPATH"]} if os.environ.get("RL_SGLANG_PYTHONPATH") else {}
    server = SGLangServer(str(model), args, env=env, name="sglang-http-bench", log_dir=str(model.parent))
    started = time.perf_counter()
    server.start()
    print(f"SGLang up in {time.perf_counter() - started:.0f} s (log {server.log_path})", flush=True)
    return server


async def drive(post, in_flight: int, seconds: float, payloads: list[dict]) -> tuple[float, float, float]:
    """Requests a second, client CPU ms a request and generated tokens a second, with `in_flight` requests always
    open (slot i sends payloads[i % len(payloads)] over and over)."""
    done = tokens = 0
    stop = time.perf_counter() + seconds

    async def episode(payload):
        nonlocal done, tokens
        while time.perf_counter() < stop:
            answer = parse_generate(await post(payload))  # awaited before `tokens +=` reads the shared count
            tokens += len(answer.output_ids)
            done += 1

    wall, cpu = time.perf_counter(), time.process_time()
    await asyncio.gather(*(episode(payloads[i % len(payloads)]) for i in range(in_flight)))
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    return done / wall, 1000 * cpu / max(done, 1), tokens / wall


async def with_aiohttp(url: str, n: int, seconds: float, payloads: list[dict]) -> tuple[float, float, float]:
    client = SGLangClient(url)
    try:
        return await drive(lambda p: client.post("/generate", p), n, seconds, payloads)
    finally:
        await client.close()


async def prime(url: str, payloads: list[dict]) -> None:
    """Each payload once with a one-token answer: its prompt enters the server's radix cache."""
    client = SGLangClient(url)
    try:
        await asyncio.gather(*(client.post("/generate", {**p, "sampling_params": {**p["sampling_params"],
                                                                                   "max_new_tokens": 1}})
                               for p in payloads))
    finally:
        await client.close()


async def with_httpx(url: str, n: int, seconds: float, payloads: list[dict]) -> tuple[float, float, float]:
    import httpx

    client = httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(900.0, connect=10.0),
                               limits=httpx.Limits(max_connections=1024, max_keepalive_connections=256))

    async def post(p):
        response = await client.post("/generate", json=p)
        return response.json()

    try:
        return await drive(post, n, seconds, payloads)
    finally:
        await client.aclose()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--concurrency", type=int, nargs="+", default=[16, 64, 136, 256])
    ap.add_argument("--seconds", type=float, default=6.0)
    ap.add_argument("--delay-ms", type=float, default=50.0, help="the stand-in server's answer time")
    ap.add_argument("--prompt-tokens", type=int, default=8000)
    ap.add_argument("--output-tokens", type=int, default=80)
    ap.add_argument("--sglang-model", type=Path, default=None, help="serve this HF folder with a real SGLang "
                    "(a random-weight SmolLM2-135M is written there first if it has no config.json)")
    ap.add_argument("--json", type=Path, default=None, help="also write the rows here")
    args = ap.parse_args()
    sampling = {"max_new_tokens": args.output_tokens, "temperature": 1.0}
    if args.sglang_model is None:
        port = free_port()
        ready = mp.get_context("spawn").Event()
        server = mp.get_context("spawn").Process(target=serve, args=(port, args.delay_ms / 1000, args.output_tokens,
                                                                      ready), daemon=True)
        server.start()
        ready.wait(30)
        url, stop_server = f"http://127.0.0.1:{port}", server.terminate
        payloads = [{"input_ids": list(range(args.prompt_tokens)), "return_logprob": True,
                     "sampling_params": sampling}]
        print(f"{args.prompt_tokens}-token prompts, {args.output_tokens}-token answers after {args.delay_ms:.0f} ms "
              f"(at most {1000 / args.delay_ms:.0f} requests/s per request in flight)")
    else:
        server = start_sglang(args.sglang_model, max(args.concurrency), args.prompt_tokens + args.output_tokens + 64)
        url, stop_server = server.url, server.stop
        rng = random.Random(0)
        payloads = [{"input_ids": [rng.randrange(3, SMOLLM2_SHAPE["vocab_size"]) for _ in range(args.prompt_tokens)],
                     "return_logprob": True, "sampling_params": {**sampling, "ignore_eos": True}}
                    for _ in range(max(args.concurrency))]
        warm = time.perf_counter()
        asyncio.run(prime(url, payloads))
        print(f"real SGLang: {len(payloads)} random {args.prompt_tokens}-token prompts (cached in "
              f"{time.perf_counter() - warm:.0f} s), {args.output_tokens} sampled tokens each", flush=True)
    print(f"{'in flight':>9} | {'aiohttp req/s':>13} {'cpu ms/req':>10} {'tok/s':>7} | {'httpx req/s':>11} "
          f"{'cpu ms/req':>10} {'tok/s':>7} | {'req/s ratio':>11} {'cpu ratio':>9}")
    rows = []
    for n in args.concurrency:
        fast = asyncio.run(with_aiohttp(url, n, args.seconds, payloads))
        peer = asyncio.run(with_httpx(url, n, args.seconds, payloads))
        rows.append({"in_flight": n, "aiohttp": fast, "httpx": peer})
        print(f"{n:>9} | {fast[0]:>13.0f} {fast[1]:>10.2f} {fast[2]:>7.0f} | {peer[0]:>11.0f} {peer[1]:>10.2f} "
              f"{peer[2]:>7.0f} | {fast[0] / peer[0]:>10.1f}x {peer[1] / fast[1]:>8.1f}x", flush=True)
    stop_server()
    print(json.dumps(rows))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
