"""The SGLang client's HTTP transport at a rollout worker's concurrency: our aiohttp client against httpx.

    python bench/http_client.py [--concurrency 16 64 136 256] [--seconds 6] [--delay-ms 50] [--prompt-tokens 8000]

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
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

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


async def drive(post, in_flight: int, seconds: float, payload: dict) -> tuple[float, float]:
    """Requests a second and client CPU ms a request, with `in_flight` requests always open."""
    done = 0
    stop = time.perf_counter() + seconds

    async def episode():
        nonlocal done
        while time.perf_counter() < stop:
            parse_generate(await post(payload))
            done += 1

    wall, cpu = time.perf_counter(), time.process_time()
    await asyncio.gather(*(episode() for _ in range(in_flight)))
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    return done / wall, 1000 * cpu / max(done, 1)


async def with_aiohttp(url: str, n: int, seconds: float, payload: dict) -> tuple[float, float]:
    client = SGLangClient(url)
    try:
        return await drive(lambda p: client.post("/generate", p), n, seconds, payload)
    finally:
        await client.close()


async def with_httpx(url: str, n: int, seconds: float, payload: dict) -> tuple[float, float]:
    import httpx

    client = httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(900.0, connect=10.0),
                               limits=httpx.Limits(max_connections=1024, max_keepalive_connections=256))

    async def post(p):
        response = await client.post("/generate", json=p)
        return response.json()

    try:
        return await drive(post, n, seconds, payload)
    finally:
        await client.aclose()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--concurrency", type=int, nargs="+", default=[16, 64, 136, 256])
    ap.add_argument("--seconds", type=float, default=6.0)
    ap.add_argument("--delay-ms", type=float, default=50.0)
    ap.add_argument("--prompt-tokens", type=int, default=8000)
    ap.add_argument("--output-tokens", type=int, default=80)
    args = ap.parse_args()
    port = free_port()
    ready = mp.get_context("spawn").Event()
    server = mp.get_context("spawn").Process(target=serve, args=(port, args.delay_ms / 1000, args.output_tokens, ready),
                                             daemon=True)
    server.start()
    ready.wait(30)
    url = f"http://127.0.0.1:{port}"
    payload = {"input_ids": list(range(args.prompt_tokens)), "return_logprob": True, "rid": "r",
               "sampling_params": {"max_new_tokens": args.output_tokens, "temperature": 1.0}}
    ceiling = 1000 / args.delay_ms
    print(f"{args.prompt_tokens}-token prompts, {args.output_tokens}-token answers after {args.delay_ms:.0f} ms "
          f"(at most {ceiling:.0f} requests/s per request in flight)")
    print(f"{'in flight':>9} | {'aiohttp req/s':>13} {'cpu ms/req':>10} | {'httpx req/s':>11} {'cpu ms/req':>10} | "
          f"{'req/s ratio':>11} {'cpu ratio':>9}")
    rows = []
    for n in args.concurrency:
        fast = asyncio.run(with_aiohttp(url, n, args.seconds, payload))
        peer = asyncio.run(with_httpx(url, n, args.seconds, payload))
        rows.append({"in_flight": n, "aiohttp": fast, "httpx": peer})
        print(f"{n:>9} | {fast[0]:>13.0f} {fast[1]:>10.2f} | {peer[0]:>11.0f} {peer[1]:>10.2f} | "
              f"{fast[0] / peer[0]:>10.1f}x {peer[1] / fast[1]:>8.1f}x", flush=True)
    server.terminate()
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
