"""HTTP client of one SGLang server (or of an sglang-router in front of several), pinned to SGLang 0.5.17.

Request and response shapes follow `sglang/srt/managers/io_struct.py` and `tokenizer_manager.py` of 0.5.17:
`/generate` takes `input_ids`, `sampling_params`, `return_logprob`, `rid` and answers `{"text", "output_ids",
"meta_info": {"id", "finish_reason": {"type": "stop"|"length"|"abort", ...}, "prompt_tokens",
"completion_tokens", "weight_version" (a string), "output_token_logprobs": [[logprob, token_id, text|null]],
"routed_experts" / "indexer_topk" (base64 int32)}}`. The weight-update endpoints answer `{"success", "message"}`.

Errors are split in two: `ServerUnavailable` (connection refused or reset, no answer in time, 502/503/504: the
request may be retried on another server) and `SGLangError` (the server answered and refused: retrying will not
help).

The transport is aiohttp, not httpx. A rollout worker keeps 100+ episodes waiting on requests at once, and at that
concurrency httpx's connection pool spends CPU on every request in proportion to the requests in flight
(encode/httpx#3215). bench/http_client.py: at 136 requests in flight, httpx 17 ms of client CPU a request (59 a
second on one core), aiohttp 0.9 ms (docs/BENCHMARKS.md, with the GPU figures that point to it).
"""

from __future__ import annotations

import base64
import json as jsonlib
import logging
from typing import Any

import aiohttp
import numpy as np

from rollout.types import GenerateResult, SamplingParams

SGLANG_VERSION = "0.5.17"
log = logging.getLogger(__name__)


class SGLangError(RuntimeError):
    def __init__(self, message: str, status: int | None = None, body: Any = None):
        super().__init__(message)
        self.status = status
        self.body = body


class ServerUnavailable(SGLangError):
    """The server did not answer (dead, restarting, overloaded): the request can go elsewhere."""


ROUTING_KEY_HEADER = "X-SMG-Routing-Key"  # sglang-router (smg 1.9): consistent hashing on this key
ABORTED_STATUS = 499  # a request aborted while it waited behind /pause_generation
MAX_CONNECTIONS = 1024  # per client: more than the requests a rollout worker or a sync has open at once
CONNECT_TIMEOUT_S = 10.0


def sampling_payload(sampling: SamplingParams) -> dict:
    """Our SamplingParams → SGLang's `sampling_params` (sglang/srt/sampling/sampling_params.py)."""
    params: dict[str, Any] = {"max_new_tokens": sampling.max_new_tokens, "temperature": sampling.temperature,
                              "top_p": sampling.top_p, "skip_special_tokens": False, "no_stop_trim": True}
    if sampling.top_k > 0:
        params["top_k"] = sampling.top_k
    if sampling.stop_token_ids:
        params["stop_token_ids"] = list(sampling.stop_token_ids)
    if sampling.stop_strings:
        params["stop"] = list(sampling.stop_strings)
    if sampling.seed is not None:
        params["sampling_seed"] = int(sampling.seed) % (2**63)
    if sampling.ignore_eos:
        params["ignore_eos"] = True
    return params


def generate_payload(input_ids: list[int], sampling: SamplingParams, request_id: str | None = None,
                     return_routed_experts: bool = False,
                     return_indexer_topk: bool = False) -> dict:
    payload: dict[str, Any] = {"input_ids": list(input_ids), "sampling_params": sampling_payload(sampling),
                               "return_logprob": True}
    if request_id is not None:
        payload["rid"] = request_id
    if return_routed_experts:
        payload["return_routed_experts"] = True
    if return_indexer_topk:
        payload["return_indexer_topk"] = True
    return payload


def decode_replay(b64: str, n_positions: int, top_k: int) -> np.ndarray:
    """SGLang's base64 int32 capture → [positions, layers, top_k] (the layer count is what remains)."""
    flat = np.frombuffer(base64.b64decode(b64), dtype=np.int32)
    if n_positions <= 0 or flat.size % (n_positions * top_k):
        raise SGLangError(f"replay data of {flat.size} int32 does not split into {n_positions} positions x "
                          f"layers x top-k {top_k}")
    return flat.reshape(n_positions, -1, top_k)


def parse_version(value: Any) -> int:
    """SGLang keeps the weight version as a string ("default" before any update); ours are integers."""
    try:
        return int(value)
    except (TypeError, ValueError):
        return 0


def parse_generate(body: dict, replay_top_k: dict[str, int] | None = None) -> GenerateResult:
    """One `/generate` response → GenerateResult. Logprobs are log softmax(logits / T) of the sampled tokens
    (SGLang's default; equal to the sampling distribution when top_p = 1 and top_k is off)."""
    if not isinstance(body, dict) or "meta_info" not in body or "output_ids" not in body:
        raise SGLangError(f"malformed /generate response: {str(body)[:300]}", body=body)
    meta_in = body["meta_info"]
    output_ids = [int(t) for t in body["output_ids"]]
    token_logprobs = meta_in.get("output_token_logprobs") or []
    if len(token_logprobs) != len(output_ids):
        raise SGLangError(f"/generate returned {len(output_ids)} tokens but {len(token_logprobs)} logprobs "
                          "(was return_logprob sent?)", body=meta_in)
    logprobs = []
    for (logprob, token, *_), expected in zip(token_logprobs, output_ids):
        if token is not None and int(token) != expected:
            raise SGLangError(f"logprob entry for token {token} where output_ids has {expected}")
        logprobs.append(float(logprob) if logprob is not None else 0.0)
    reason = meta_in.get("finish_reason") or {}
    kind = reason.get("type") if isinstance(reason, dict) else str(reason)
    finish = {"stop": "stop", "length": "length", "abort": "abort"}.get(kind or "", "length")
    # scalars pass through (e2e_latency, num_retractions, spec_accept_length with MTP, ...); lists do not
    meta: dict[str, Any] = {k: v for k, v in meta_in.items() if isinstance(v, (int, float, str)) and k != "id"}
    meta.update(weight_version=parse_version(meta_in.get("weight_version")), request_id=meta_in.get("id"),
                prompt_tokens=meta_in.get("prompt_tokens"), cached_tokens=meta_in.get("cached_tokens", 0))
    if finish == "abort":
        meta["abort_message"] = reason.get("message") if isinstance(reason, dict) else None
    if isinstance(reason, dict) and "matched" in reason:
        meta["matched_stop"] = reason["matched"]
    # Replay data covers positions [0, prompt + output - 1): every position the model was run on.
    positions = int(meta_in.get("prompt_tokens") or 0) + len(output_ids) - 1
    for key, top_k in (replay_top_k or {}).items():
        if meta_in.get(key):
            try:
                meta[key] = decode_replay(meta_in[key], positions, top_k)
            except SGLangError as exc:  # the tokens are good: train them on the model's own choices there
                log.warning("request %s: %s; not replayed", meta_in.get("id"), exc)
    return GenerateResult(output_ids, logprobs, finish, meta)


class SGLangClient:
    """Async calls to one base URL over one aiohttp session, opened by the first call: every call must come from
    the event loop of the first (a session is bound to its loop)."""

    def __init__(self, url: str, timeout_s: float = 900.0, headers: dict[str, str] | None = None):
        self.url = url.rstrip("/")
        self.headers = dict(headers or {})
        self._timeout = aiohttp.ClientTimeout(total=timeout_s, sock_connect=CONNECT_TIMEOUT_S)
        self._session: aiohttp.ClientSession | None = None

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(
                headers=self.headers, connector=aiohttp.TCPConnector(limit=MAX_CONNECTIONS))
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def request(self, method: str, path: str, json: Any = None, headers: dict | None = None,
                      timeout_s: float | None = None) -> Any:
        timeout = self._timeout if timeout_s is None else aiohttp.ClientTimeout(total=timeout_s,
                                                                               sock_connect=CONNECT_TIMEOUT_S)
        try:
            async with self._http().request(method, self.url + path, json=json, headers=headers,
                                            timeout=timeout) as response:
                status, raw = response.status, await response.read()
        except (aiohttp.ClientError, TimeoutError) as exc:  # refused, reset, cut short, or no answer in time
            raise ServerUnavailable(f"{self.url}{path}: {type(exc).__name__}: {exc}") from exc
        try:
            body = jsonlib.loads(raw)
        except ValueError:
            body = raw.decode(errors="replace")
        if status in (502, 503, 504):
            raise ServerUnavailable(f"{self.url}{path}: HTTP {status}: {str(body)[:300]}", status, body)
        if status >= 400:
            raise SGLangError(f"{self.url}{path}: HTTP {status}: {str(body)[:500]}", status, body)
        return body

    async def post(self, path: str, json: Any = None, **kwargs) -> Any:
        return await self.request("POST", path, json=json, **kwargs)

    async def get(self, path: str, **kwargs) -> Any:
        return await self.request("GET", path, **kwargs)

    # ---- generation ----------------------------------------------------------------------------------
    async def generate(self, payload: dict, replay_top_k: dict[str, int] | None = None,
                       routing_key: str | None = None) -> GenerateResult:
        """A request aborted while queued behind a pause (HTTP 499) comes back as finish reason "abort"."""
        headers = {ROUTING_KEY_HEADER: routing_key} if routing_key else None
        try:
            body = await self.post("/generate", payload, headers=headers)
        except SGLangError as exc:
            if exc.status == ABORTED_STATUS:
                return GenerateResult([], [], "abort", {"abort_message": str(exc.body)[:200]})
            raise
        return parse_generate(body, replay_top_k)

    async def abort(self, request_id: str | None = None, abort_all: bool = False) -> None:
        await self.post("/abort_request", {"rid": request_id or "", "abort_all": abort_all})

    async def pause(self, mode: str = "abort") -> None:
        """abort: in-flight requests end now (finish reason abort); in_place / retract: they wait for resume."""
        await self.post("/pause_generation", {"mode": mode})

    async def resume(self) -> None:
        await self.post("/continue_generation", {})

    async def flush_cache(self) -> None:
        await self.post("/flush_cache")

    # ---- state ---------------------------------------------------------------------------------------
    async def healthy(self) -> bool:
        try:
            await self.get("/health", timeout_s=10.0)
            return True
        except SGLangError:
            return False

    async def weight_version(self) -> int:
        """From /model_info (0.5.17 answers 404 on /get_weight_version)."""
        return parse_version((await self.model_info()).get("weight_version"))

    async def server_info(self) -> dict:
        return await self.get("/server_info")

    async def model_info(self) -> dict:
        return await self.get("/model_info")

    async def get_weights_by_name(self, name: str, truncate_size: int = 100) -> Any:
        return await self.post("/get_weights_by_name", {"name": name, "truncate_size": truncate_size})

    # ---- weights -------------------------------------------------------------------------------------
    async def _update(self, path: str, payload: dict) -> dict:
        body = await self.post(path, payload)
        if not (isinstance(body, dict) and body.get("success")):
            raise SGLangError(f"{self.url}{path} failed: {body}", body=body)
        return body

    async def update_weights_from_disk(self, model_path: str, version: int, flush_cache: bool = True) -> dict:
        return await self._update("/update_weights_from_disk", {
            "model_path": str(model_path), "weight_version": str(version), "flush_cache": flush_cache})

    async def update_weights_from_tensor(self, serialized_per_rank: list[str], version: int | None,
                                         load_format: str | None = None, flush_cache: bool = True) -> dict:
        payload: dict[str, Any] = {"serialized_named_tensors": serialized_per_rank, "flush_cache": flush_cache,
                                   "load_format": load_format}
        if version is not None:
            payload["weight_version"] = str(version)
        return await self._update("/update_weights_from_tensor", payload)

    async def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int,
                                        world_size: int, group_name: str, backend: str) -> dict:
        return await self._update("/init_weights_update_group", {
            "master_address": master_address, "master_port": master_port, "rank_offset": rank_offset,
            "world_size": world_size, "group_name": group_name, "backend": backend})

    async def update_weights_from_distributed(self, names: list[str], dtypes: list[str], shapes: list[list[int]],
                                              group_name: str, version: int | None,
                                              flush_cache: bool = True) -> dict:
        payload: dict[str, Any] = {"names": names, "dtypes": dtypes, "shapes": shapes, "group_name": group_name,
                                   "flush_cache": flush_cache}
        if version is not None:
            payload["weight_version"] = str(version)
        return await self._update("/update_weights_from_distributed", payload)

    async def destroy_weights_update_group(self, group_name: str) -> dict:
        return await self._update("/destroy_weights_update_group", {"group_name": group_name})
