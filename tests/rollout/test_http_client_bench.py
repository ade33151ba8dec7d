"""bench/http_client.py against its stand-in server: both clients complete requests, parse every answer, and
count every generated token (the count is shared by the in-flight coroutines; a `+=` that spans an await would
lose updates, which the first version did)."""

from __future__ import annotations

import asyncio
import threading

import pytest

from rollout.sglang.server import free_port
from tests.bench_scripts import load


@pytest.fixture(scope="module")
def stand_in():
    """The bench's server in a thread of this process (its own event loop; a spawned process could not import the
    bench, which is no package), left to die with the session."""
    bench = load("http_client")
    port, ready = free_port(), threading.Event()
    threading.Thread(target=bench.serve, args=(port, 0.02, 12, ready), daemon=True).start()
    assert ready.wait(60), "the stand-in server did not start"
    return bench, f"http://127.0.0.1:{port}"


@pytest.mark.parametrize("client", ["with_aiohttp", "with_httpx"])
def test_every_request_and_token_is_counted(stand_in, client):
    bench, url = stand_in
    payloads = [{"input_ids": list(range(50)), "return_logprob": True,
                 "sampling_params": {"max_new_tokens": 12, "temperature": 1.0}}]
    requests_per_s, cpu_ms, tokens_per_s = asyncio.run(getattr(bench, client)(url, 16, 1.0, payloads))
    assert requests_per_s > 50  # 16 in flight, answered after 20 ms: ~800/s unloaded
    assert cpu_ms > 0
    assert tokens_per_s == pytest.approx(12 * requests_per_s, rel=1e-9)


def test_prime_sends_each_prompt_once(stand_in):
    bench, url = stand_in
    payloads = [{"input_ids": [i] * 10, "return_logprob": True,
                 "sampling_params": {"max_new_tokens": 12, "temperature": 1.0}} for i in range(5)]
    asyncio.run(bench.prime(url, payloads))  # raises on any failed request
    assert all(p["sampling_params"]["max_new_tokens"] == 12 for p in payloads)  # the payloads are left as they were
