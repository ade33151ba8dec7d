"""A small HTTP server that speaks SGLang 0.5.17's request and response shapes, for CPU tests.

Not a mock of the answers: generation is real (our LocalEngine on a real small model, so logprobs, stops and
seeds behave), weights really change on `/update_weights_from_disk`, `_from_tensor` and `_from_distributed`
(the latter joins a real torch.distributed group with gloo, as SGLang does with NCCL), and the prefix cache is
counted (`cached_tokens` = the longest prefix shared with an earlier prompt). The shapes are those of
`sglang/srt/managers/io_struct.py` and `tokenizer_manager.py` at 0.5.17; tests/rollout/test_sglang_client.py pins
them. Run as `python tests/fakes/sglang_server.py --model-path M --host H --port P [any SGLang flag ...]`;
unknown flags are accepted and ignored, like a server that does not implement them.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import os
import io
import pickle
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import torch

from rollout.local_engine import LocalEngine
from rollout.sglang.weights import join_update_group, unflatten_bucket
from rollout.types import SamplingParams


class SafeUnpickler(pickle.Unpickler):
    """SGLang's allow-list (sglang/srt/utils/common.py): builtin and torch types load, anything else is refused."""

    ALLOWED = ("builtins.", "collections.", "copyreg.", "functools.", "itertools.", "operator.", "types.",
               "weakref.", "torch.", "multiprocessing.resource_sharer.", "multiprocessing.reduction.",
               "pickletools.")

    def find_class(self, module, name):
        if not f"{module}.{name}".startswith(self.ALLOWED):
            raise RuntimeError(f"Blocked unsafe class loading ({module}.{name})")
        return super().find_class(module, name)


class AbortedWhilePaused(Exception):
    pass


ABORTED_QUEUED_MAX = 1024  # aborted request ids remembered for requests queued behind a pause; oldest dropped


class FakeSGLang:
    def __init__(self, model_path: str, port: int = 0, routed_experts: bool = False):
        self.model_path = model_path
        self.port = port
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()
        self.engine: LocalEngine | None = None
        self.weight_version = "default"
        self.paused = threading.Event()
        self.resumed = threading.Condition()
        self.inflight: set[str] = set()
        self.prompts: list[tuple[int, ...]] = []
        self.groups: dict[str, tuple] = {}
        self.aborted_queued: dict[str, None] = {}  # an insertion-ordered set, at most ABORTED_QUEUED_MAX ids
        self.lock = threading.Lock()
        self.started = time.time()
        self.decode_s_per_token = float(os.environ.get("FAKE_SGLANG_DECODE_S_PER_TOKEN", "0"))
        self.routed_experts = routed_experts  # --enable-return-routed-experts

    def load(self) -> None:
        self.engine = LocalEngine.from_pretrained(self.model_path, max_batch_size=16,
                                                  return_routed_experts=self.routed_experts)

    def run(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    # ---- /generate ---------------------------------------------------------------------------------
    def generate(self, body: dict):
        ids = body.get("input_ids")
        if ids is None:
            raise ValueError("input_ids is required (text prompts are not served by this fake)")
        batch = bool(ids) and isinstance(ids[0], list)
        prompts = ids if batch else [ids]
        sps = body.get("sampling_params") or {}
        rids = body.get("rid")
        outs = []
        for i, prompt in enumerate(prompts):
            sp = sps[i] if isinstance(sps, list) else sps
            rid = (rids[i] if isinstance(rids, list) else (f"{rids}_{i}" if batch and rids else rids)) or os.urandom(8).hex()
            start = body.get("logprob_start_len")
            start = start[i] if isinstance(start, list) else start
            if body.get("return_routed_experts") and not self.routed_experts:
                raise ValueError("return_routed_experts needs the server started with --enable-return-routed-experts")
            outs.append(self.generate_one(prompt, sp, rid, bool(body.get("return_logprob")),
                                          -1 if start is None else int(start), bool(body.get("return_routed_experts"))))
        return outs if batch else outs[0]

    def generate_one(self, prompt: list[int], sp: dict, rid: str, return_logprob: bool,
                     logprob_start_len: int = -1, return_routed_experts: bool = False) -> dict:
        with self.resumed:
            while self.paused.is_set():
                self.resumed.wait()
                if rid in self.aborted_queued:  # SGLang answers 499 for a request aborted behind a pause
                    del self.aborted_queued[rid]
                    raise AbortedWhilePaused(rid)
            self.inflight.add(rid)
        tok = self.engine.tokenizer
        stop_ids = tuple(sp.get("stop_token_ids") or ())
        if not sp.get("ignore_eos") and tok.eos_token_id is not None:
            stop_ids += (tok.eos_token_id,)
        stop = sp.get("stop") or ()
        sampling = SamplingParams(temperature=float(sp.get("temperature", 1.0)), top_p=float(sp.get("top_p", 1.0)),
                                  top_k=int(sp.get("top_k", 0)) if int(sp.get("top_k", 0)) < 1 << 30 else 0,
                                  max_new_tokens=int(sp.get("max_new_tokens", 128)), stop_token_ids=stop_ids,
                                  stop_strings=tuple([stop] if isinstance(stop, str) else stop),
                                  seed=sp.get("sampling_seed"), ignore_eos=bool(sp.get("ignore_eos")))
        cached = self.cached_prefix(prompt)
        try:
            result = self.run(self.engine.generate(prompt, sampling, request_id=rid))
            # simulated decode time (FAKE_SGLANG_DECODE_S_PER_TOKEN): a request stays in flight long enough
            # for a fault-injection test to kill its server mid-request, whatever the speed of the machine
            time.sleep(self.decode_s_per_token * len(result.output_ids))
        finally:
            with self.resumed:
                self.inflight.discard(rid)
        if result.finish_reason == "abort":
            reason = {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None}
        elif result.finish_reason == "stop":
            last = result.output_ids[-1] if result.output_ids else None
            reason = {"type": "stop", "matched": last if last in stop_ids else tok.decode(result.output_ids[-4:])}
        else:
            reason = {"type": "length", "length": len(result.output_ids)}
        meta = {"id": rid, "finish_reason": reason, "prompt_tokens": len(prompt), "weight_version": self.weight_version,
                "num_retractions": 0, "completion_tokens": len(result.output_ids), "cached_tokens": cached,
                "e2e_latency": 0.0, "fake_served_by": self.port}  # the one key real SGLang lacks (tests)
        if return_logprob:
            meta["input_token_logprobs"] = (self.prompt_logprobs(prompt, sampling.temperature)[logprob_start_len:]
                                            if logprob_start_len >= 0 else [])
            meta["output_token_logprobs"] = [[lp, t, None] for lp, t in zip(result.output_logprobs, result.output_ids)]
            meta["output_token_logprobs_length"] = len(result.output_ids)
        if return_routed_experts and "routed_experts" in result.meta:  # SGLang's encoding: base64 of int32 [prompt + output - 1, layers, top_k]
            meta["routed_experts"] = base64.b64encode(
                result.meta["routed_experts"].astype(np.int32).tobytes()).decode()
        return {"text": tok.decode(result.output_ids), "output_ids": result.output_ids, "meta_info": meta}

    def prompt_logprobs(self, prompt: list[int], temperature: float) -> list[list]:
        """SGLang's `input_token_logprobs` of the whole prompt: [logprob, token_id, None] per token, entry t being
        log p(x_t | x_<t) (None for the first token), computed by a forward of the served model at the request's
        temperature (1 when it is 0)."""
        from models import policy_logprobs

        ids = torch.tensor([prompt])
        with torch.no_grad():
            lps = policy_logprobs(self.engine.model, ids, torch.ones_like(ids), temperature or 1.0)[0][0].tolist()
        return [[None if t == 0 else lp, tok, None] for t, (lp, tok) in enumerate(zip(lps, prompt))]

    def cached_prefix(self, prompt: list[int]) -> int:
        with self.lock:
            best = 0
            for old in self.prompts:
                n = 0
                for a, b in zip(old, prompt):
                    if a != b:
                        break
                    n += 1
                best = max(best, n)
            self.prompts = (self.prompts + [tuple(prompt)])[-256:]
            return best

    # ---- control -----------------------------------------------------------------------------------
    def remember_aborted(self, rids: list[str]) -> None:
        """Note aborted request ids (the caller holds `self.resumed`); only the newest ABORTED_QUEUED_MAX are
        kept, since an id aborted while in flight (or never seen here) is never consumed by a queued request."""
        for rid in rids:
            self.aborted_queued.pop(rid, None)  # a repeated id counts as the newest
            self.aborted_queued[rid] = None
        while len(self.aborted_queued) > ABORTED_QUEUED_MAX:
            del self.aborted_queued[next(iter(self.aborted_queued))]

    def pause(self, mode: str) -> None:
        self.paused.set()
        if mode == "abort":
            self.run(self.engine.abort(list(self.inflight)))

    def resume(self) -> None:
        with self.resumed:
            self.paused.clear()
            self.resumed.notify_all()

    def load_named(self, named: dict, version) -> None:
        self.run(self.engine.update_weights(named))
        if version is not None:
            self.weight_version = str(version)
        with self.lock:
            self.prompts = []  # flush_cache


class Handler(BaseHTTPRequestHandler):
    server_version = "FakeSGLang/0.5.17"
    app: FakeSGLang

    def log_message(self, fmt, *args):
        sys.stderr.write(f"[fake-sglang] {self.command} {self.path} {fmt % args}\n")

    def reply(self, status: int, body, text: bool = False) -> None:
        data = (body if isinstance(body, str) else json.dumps(body)).encode()
        self.send_response(status)
        self.send_header("Content-Type", "text/plain" if text else "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def body(self) -> dict:
        n = int(self.headers.get("Content-Length") or 0)
        return json.loads(self.rfile.read(n) or b"{}") if n else {}

    def do_GET(self):
        app = self.app
        if self.path in ("/health", "/health_generate"):
            return self.reply(200 if app.engine else 503, "" if app.engine else "loading", text=True)
        if app.engine is None:
            return self.reply(503, {"error": "loading"})
        if self.path in ("/get_weight_version", "/weight_version"):  # 0.5.17 answers 404 here
            return self.reply(404, {"detail": "Endpoint '/get_weight_version' or '/weight_version' is deprecated. "
                                              "Please use '/model_info' instead."})
        if self.path in ("/model_info", "/get_model_info"):
            return self.reply(200, {"model_path": app.model_path, "tokenizer_path": app.model_path,
                                    "is_generation": True, "weight_version": app.weight_version})
        if self.path in ("/server_info", "/get_server_info"):
            # (the decode steps its engine ran: tests wait on them instead of sleeping; not in SGLang's answer)
            return self.reply(200, {"version": "0.5.17", "model_path": app.model_path, "fake": True,
                                    "fake_decode_steps": app.engine.stats["decode_steps"]})
        self.reply(404, {"error": f"no route {self.path}"})

    def do_POST(self):
        app = self.app
        if app.engine is None:
            return self.reply(503, {"error": "loading"})
        try:
            body = self.body()
            route = self.path
            if route == "/generate":
                try:
                    return self.reply(200, app.generate(body))
                except AbortedWhilePaused as exc:
                    return self.reply(499, {"error": {"message": f"Abort request {exc}"}})
            if route == "/abort_request":
                rids = list(app.inflight) if body.get("abort_all") else [body.get("rid", "")]
                with app.resumed:
                    app.remember_aborted(rids)
                    app.resumed.notify_all()
                app.run(app.engine.abort(rids))
                return self.reply(200, "", text=True)
            if route == "/pause_generation":
                app.pause(body.get("mode", "abort"))
                return self.reply(200, {"message": "Generation paused successfully."})
            if route == "/continue_generation":
                app.resume()
                return self.reply(200, {"message": "Generation continued successfully."})
            if route == "/flush_cache":
                with app.lock:
                    app.prompts = []
                return self.reply(200, "Cache flushed.\nPlease check backend logs for more details. "
                                       "(When there are running or waiting requests, the operation will not be performed.)\n", text=True)
            if route == "/update_weights_from_disk":
                app.load_named(body["model_path"], body.get("weight_version"))
                return self.reply(200, {"success": True, "message": "Succeeded to update model weights.",
                                        "num_paused_requests": 0})
            if route == "/update_weights_from_tensor":
                payload = SafeUnpickler(io.BytesIO(base64.b64decode(body["serialized_named_tensors"][0], validate=True))).load()
                if body.get("load_format") == "flattened_bucket":
                    named = {k: v.clone() for k, v in unflatten_bucket(payload).items()}
                else:
                    named = {name: tensor.clone() for name, tensor in payload}
                app.load_named(named, body.get("weight_version"))
                return self.reply(200, {"success": True, "message": "Succeeded to update model weights."})
            if route == "/init_weights_update_group":
                app.groups[body.get("group_name", "weight_update_group")] = join_update_group(
                    body["master_address"], int(body["master_port"]), int(body["rank_offset"]),
                    int(body["world_size"]), body.get("group_name", "weight_update_group"), body.get("backend", "gloo"))
                return self.reply(200, {"success": True, "message": "Succeeded to initialize custom process group."})
            if route == "/update_weights_from_distributed":
                group = app.groups[body.get("group_name", "weight_update_group")]
                named = {}
                for name, dtype, shape in zip(body["names"], body["dtypes"], body["shapes"]):
                    tensor = torch.empty(shape, dtype=getattr(torch, dtype.replace("torch.", "")))
                    group.broadcast(tensor, src=0)
                    named[name] = tensor
                app.load_named(named, body.get("weight_version"))
                return self.reply(200, {"success": True, "message": "Succeeded to update parameter online."})
            if route == "/destroy_weights_update_group":
                group = app.groups.pop(body.get("group_name", "weight_update_group"), None)
                if group is not None:
                    group.close()
                return self.reply(200, {"success": True, "message": "Succeeded to destroy custom process group."})
            if route == "/get_weights_by_name":
                param = app.engine.model.state_dict()[body["name"]]
                flat = param.float().flatten()[: int(body.get("truncate_size", 100))]
                return self.reply(200, flat.tolist())
            return self.reply(404, {"error": f"no route {route}"})
        except Exception as exc:  # the server answers, as SGLang does, with the reason
            return self.reply(400, {"error": {"message": f"{type(exc).__name__}: {exc}"}})


def main(argv=None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model-path", required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=30000)
    parser.add_argument("--enable-return-routed-experts", action="store_true")
    args, ignored = parser.parse_known_args(argv)
    torch.set_num_threads(int(os.environ.get("FAKE_SGLANG_THREADS", "1")))
    app = FakeSGLang(args.model_path, args.port, args.enable_return_routed_experts)
    Handler.app = app
    httpd = ThreadingHTTPServer((args.host, args.port), Handler)
    httpd.daemon_threads = True
    print(f"fake SGLang 0.5.17 on {args.host}:{args.port}, ignoring {ignored}", flush=True)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    time.sleep(float(os.environ.get("FAKE_SGLANG_STARTUP_DELAY_S", "0")))
    app.load()
    print("The server is fired up and ready to roll!", flush=True)
    threading.Event().wait()


if __name__ == "__main__":
    main()
