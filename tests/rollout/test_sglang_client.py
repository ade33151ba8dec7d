"""The SGLang client's request and response shapes, pinned to SGLang 0.5.17.

The expected shapes are SGLang's own: `GenerateReqInput` and the weight-update inputs in
sglang/srt/managers/io_struct.py, `SamplingParams` in sglang/srt/sampling/sampling_params.py, the meta_info built
in tokenizer_manager.py, the finish reasons of schedule_batch.py (`FINISH_MATCHED_TOKEN` etc.), all at 0.5.17.
"""

from __future__ import annotations

import base64
import os

import numpy as np
import pytest

from rollout.sglang.client import (SGLangError, decode_replay, generate_payload, parse_generate, parse_version,
                                   sampling_payload)
from rollout.sglang.engine import rendezvous
from rollout.sglang.server import ManagedProcess, server_args
from rollout.types import SamplingParams

# Fields of GenerateReqInput and SamplingParams at 0.5.17 that we send (a renamed field fails here, not on a GPU)
GENERATE_FIELDS = {"input_ids", "sampling_params", "return_logprob", "rid", "return_routed_experts",
                   "return_indexer_topk"}
SAMPLING_FIELDS = {"max_new_tokens", "temperature", "top_p", "top_k", "stop", "stop_token_ids", "sampling_seed",
                   "skip_special_tokens", "no_stop_trim", "ignore_eos"}


def test_payload_uses_only_sglang_fields():
    sp = SamplingParams(temperature=0.7, top_p=0.9, top_k=20, max_new_tokens=64, stop_token_ids=(2, 5),
                        stop_strings=("</tool>",), seed=123, ignore_eos=True)
    payload = generate_payload([1, 2, 3], sp, "ep-0", return_routed_experts=True, return_indexer_topk=True)
    assert set(payload) <= GENERATE_FIELDS
    assert set(payload["sampling_params"]) <= SAMPLING_FIELDS
    assert payload["input_ids"] == [1, 2, 3] and payload["rid"] == "ep-0" and payload["return_logprob"] is True
    params = payload["sampling_params"]
    assert params["stop_token_ids"] == [2, 5] and params["stop"] == ["</tool>"] and params["sampling_seed"] == 123
    assert params["top_k"] == 20 and params["temperature"] == 0.7


def test_sampling_defaults_leave_top_k_off():
    params = sampling_payload(SamplingParams())
    assert "top_k" not in params and "stop" not in params and "sampling_seed" not in params


def _response(output_ids, finish, version="3", **meta):
    return {"text": "", "output_ids": output_ids,
            "meta_info": {"id": "r1", "finish_reason": finish, "prompt_tokens": 5, "weight_version": version,
                          "num_retractions": 0, "completion_tokens": len(output_ids), "cached_tokens": 2,
                          "output_token_logprobs": [[-0.5 * (i + 1), t, None] for i, t in enumerate(output_ids)],
                          **meta}}


@pytest.mark.parametrize("finish, expected", [
    ({"type": "stop", "matched": 2}, "stop"),  # FINISH_MATCHED_TOKEN
    ({"type": "stop", "matched": "</tool>"}, "stop"),  # FINISH_MATCHED_STR
    ({"type": "length", "length": 3}, "length"),  # FINISH_LENGTH
    ({"type": "abort", "message": "Aborted", "status_code": None, "err_type": None}, "abort"),  # FINISH_ABORT
])
def test_parse_generate_finish_reasons(finish, expected):
    result = parse_generate(_response([7, 8, 2], finish))
    assert result.finish_reason == expected
    assert result.output_ids == [7, 8, 2] and result.output_logprobs == [-0.5, -1.0, -1.5]
    assert result.meta["weight_version"] == 3 and result.meta["cached_tokens"] == 2


def test_parse_generate_rejects_mismatched_logprobs():
    body = _response([7, 8], {"type": "length", "length": 2})
    body["meta_info"]["output_token_logprobs"] = body["meta_info"]["output_token_logprobs"][:1]
    with pytest.raises(SGLangError, match="2 tokens but 1 logprobs"):
        parse_generate(body)
    body = _response([7, 8], {"type": "length", "length": 2})
    body["meta_info"]["output_token_logprobs"][1][1] = 99
    with pytest.raises(SGLangError, match="token 99"):
        parse_generate(body)
    with pytest.raises(SGLangError, match="malformed"):
        parse_generate({"error": {"message": "boom"}})


def test_replay_data_decodes_to_positions_layers_topk():
    # 5 prompt + 3 output tokens → the model ran on 7 positions; 4 layers; top-k 2 (base64 int32, as SGLang sends)
    routing = np.arange(7 * 4 * 2, dtype=np.int32)
    body = _response([7, 8, 2], {"type": "length", "length": 3},
                     routed_experts=base64.b64encode(routing.tobytes()).decode())
    result = parse_generate(body, {"routed_experts": 2})
    assert result.meta["routed_experts"].shape == (7, 4, 2)
    assert (result.meta["routed_experts"].reshape(-1) == routing).all()
    with pytest.raises(SGLangError, match="does not split"):
        decode_replay(base64.b64encode(routing[:-1].tobytes()).decode(), 7, 2)


def test_weight_versions_are_sglang_strings():
    assert parse_version("default") == 0 and parse_version("12") == 12 and parse_version(None) == 0


def test_server_args_pass_through_unchanged():
    args = {"tp": 2, "mem_fraction_static": 0.3, "enable-return-routed-experts": True, "disable-radix": False,
            "cuda-graph-bs": [1, 2, 4], "log-level": None}
    assert server_args(args) == ["--tp", "2", "--mem-fraction-static", "0.3", "--enable-return-routed-experts",
                                 "--cuda-graph-bs", "1", "2", "4"]


def test_launcher_refuses_managed_flags(tmp_path):
    from rollout.sglang.server import SGLangServer

    server = SGLangServer("/m", {"port": 1}, log_dir=str(tmp_path))
    with pytest.raises(ValueError, match="set by the launcher"):
        server.command_line()


def test_rendezvous_is_stable_and_moves_only_the_lost_servers_keys():
    urls = [f"http://h{i}:30000" for i in range(4)]
    keys = [f"episode-{i}" for i in range(400)]
    before = {k: rendezvous(k, urls) for k in keys}
    assert {k: rendezvous(k, urls) for k in keys} == before  # deterministic
    counts = {u: sum(v == u for v in before.values()) for u in urls}
    assert min(counts.values()) > 60  # spread (expected 100 each)
    after = {k: rendezvous(k, urls[:3]) for k in keys}
    moved = [k for k in keys if after[k] != before[k]]
    assert all(before[k] == urls[3] for k in moved) and len(moved) == counts[urls[3]]


def test_flattened_bucket_roundtrip():
    import torch

    from rollout.sglang.weights import flatten_bucket, unflatten_bucket

    named = {"a": torch.randn(3, 4), "b": torch.arange(5, dtype=torch.int64), "c": torch.randn(2, dtype=torch.bfloat16)}
    bucket = flatten_bucket(named)
    assert bucket["flattened_tensor"].dtype == torch.uint8
    assert bucket["flattened_tensor"].numel() == 3 * 4 * 4 + 5 * 8 + 2 * 2
    meta = bucket["metadata"]
    assert [m.name for m in meta] == ["a", "b", "c"] and meta[1].start_idx == 48 and meta[1].end_idx == 88
    assert type(meta[0]).__module__ == "types"  # SGLang's SafeUnpickler admits builtin types only
    back = unflatten_bucket(bucket)
    for k in named:
        assert back[k].dtype == named[k].dtype and torch.equal(back[k], named[k])


class _Sleeper(ManagedProcess):
    """A managed process group: a shell that starts a child sleeper and then sleeps itself (or, `lone`, just a
    sleeper)."""

    lone = False

    def command_line(self, **_) -> list[str]:
        return ["sleep", "60"] if self.lone else ["sh", "-c", "sleep 60 & exec sleep 60"]


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


def test_stop_signals_only_its_own_process_group(tmp_path):
    """A server whose leader is gone is stopped without signalling whoever holds its pid now (pids are reused;
    killpg on a stale id once hit another job's Ray), while the rest of its own group is still killed."""
    import signal
    import subprocess
    import time

    server = _Sleeper("sleeper", log_dir=str(tmp_path))
    server.start(wait=False)
    group = server.proc.pid
    children, deadline = [], time.monotonic() + 10
    while not children and time.monotonic() < deadline:  # until the leader has forked
        time.sleep(0.05)
        children = [int(p) for p in subprocess.run(["pgrep", "-g", str(group)], capture_output=True,
                                                   text=True).stdout.split() if int(p) != group]
    assert children
    os.kill(group, signal.SIGKILL)  # the leader dies; its child lives on in the group
    server.proc.wait()
    server.stop()
    deadline = time.monotonic() + 10
    while any(_alive(c) for c in children) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(_alive(c) for c in children)  # the group's survivors were killed

    # a stranger that now holds the old leader's pid, leading a group of its own
    stranger = subprocess.Popen(["sleep", "60"], start_new_session=True)
    server.lone = True
    server.start(wait=False)
    server.proc.kill()
    server.proc.wait()
    server.proc.pid = stranger.pid  # as if the kernel had reused the pid (Popen keeps `pid` as set)
    try:
        server.stop()
        server.proc = None
        time.sleep(0.2)
        assert stranger.poll() is None, "stop() signalled a process group that was not the server's"
    finally:
        stranger.kill()
        stranger.wait()


# ---- the transport: what each way a server can fail becomes --------------------------------------------
async def _one_route_server(reply: bytes | None, close_early: bool = False):
    """A real socket server whose every request gets `reply` (raw HTTP), or nothing (None: it never answers), or
    half an answer and a closed connection."""
    import asyncio

    async def handle(reader, writer):
        try:
            header = await reader.readuntil(b"\r\n\r\n")
            length = [int(line.split(b":")[1]) for line in header.split(b"\r\n") if line.lower().startswith(b"content-length")]
            if length:
                await reader.readexactly(length[0])
            if reply is None:
                await asyncio.sleep(60)
            writer.write(reply[: len(reply) // 2] if close_early else reply)
            await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.CancelledError):
            pass
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"


def _http(status: str, body: bytes, content_type: str = "application/json") -> bytes:
    return (f"HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\nContent-Length: {len(body)}\r\n"
            f"Connection: close\r\n\r\n").encode() + body


@pytest.mark.parametrize("reply, close_early, expected", [
    (_http("503 Service Unavailable", b'{"error": "loading"}'), False, "unavailable"),
    (_http("502 Bad Gateway", b"upstream gone", "text/plain"), False, "unavailable"),
    (_http("400 Bad Request", b'{"error": {"message": "bad sampling_params"}}'), False, "refused"),
    (_http("499 Client Closed Request", b'{"error": {"message": "Abort request r1"}}'), False, "aborted"),
    (_http("200 OK", b"Cache flushed.\n", "text/plain"), False, "text"),
    (_http("200 OK", b""), False, "empty"),
    (_http("200 OK", b'{"success": true, "message": "' + b"x" * 4000 + b'"}'), True, "unavailable"),
    (None, False, "unavailable"),  # no answer within the call's timeout
])
def test_each_way_a_server_fails_is_sorted_into_retry_elsewhere_or_refused(reply, close_early, expected):
    """ServerUnavailable (retry on another server) for 502/503/504, a cut connection and no answer in time;
    SGLangError with the status and the parsed body when the server answered and refused; a 499 on /generate is
    the abort of a request queued behind a pause; a body that is not JSON comes back as text."""
    import asyncio

    from rollout.sglang.client import SGLangClient, ServerUnavailable

    async def main():
        server, url = await _one_route_server(reply, close_early)
        client = SGLangClient(url, timeout_s=0.5)
        try:
            if expected == "aborted":
                return await client.generate({"input_ids": [1, 2], "sampling_params": {}})
            return await client.post("/flush_cache")
        finally:
            await client.close()
            server.close()

    if expected == "unavailable":
        with pytest.raises(ServerUnavailable):
            asyncio.run(main())
    elif expected == "refused":
        with pytest.raises(SGLangError) as info:
            asyncio.run(main())
        assert not isinstance(info.value, ServerUnavailable)
        assert info.value.status == 400 and info.value.body == {"error": {"message": "bad sampling_params"}}
    elif expected == "aborted":
        result = asyncio.run(main())
        assert result.finish_reason == "abort" and result.output_ids == []
    else:
        assert asyncio.run(main()) == {"text": "Cache flushed.\n", "empty": ""}[expected]


def test_a_server_that_is_not_there_is_unavailable_and_the_client_recovers_when_it_comes():
    """Connection refused → ServerUnavailable; the same client works once a server listens on the port (the
    session survives the failure), and a closed client reopens on its next call."""
    import asyncio
    from rollout.sglang.client import SGLangClient, ServerUnavailable
    from rollout.sglang.server import free_port

    port = free_port()

    async def main():
        client = SGLangClient(f"http://127.0.0.1:{port}", timeout_s=5)
        with pytest.raises(ServerUnavailable):
            await client.get("/health")

        async def handle(reader, writer):
            await reader.readuntil(b"\r\n\r\n")
            writer.write(_http("200 OK", b'{"weight_version": "3"}'))
            await writer.drain()
            writer.close()

        server = await asyncio.start_server(handle, "127.0.0.1", port)
        try:
            assert await client.weight_version() == 3
            await client.close()
            assert await client.weight_version() == 3
        finally:
            await client.close()
            server.close()

    asyncio.run(main())
