"""`LocalEngine`: the embedded, in-process torch inference engine (the default on machines without a GPU).

Requests from many concurrent episodes are gathered into batches: a background thread takes whatever is
queued (up to `max_batch_size`, after a short gathering window), left-pads the prompts, prefills once and
decodes with a KV cache until every row has stopped. Each row keeps its own sampling parameters and seed.
Weight updates (pause → update → resume, docs/DESIGN.md §3.7) do not wait for the running batch: it parks
between two decode steps, the weights change, and it continues on the new ones with its KV cache kept (SGLang's
`in_place` pause). That is a partial rollout: each output token records the weight version that sampled it.

With `return_routed_experts` (a MoE policy: GLM-5.2), each result also carries the experts every position was
routed to (`meta["routed_experts"]`, int16 [prompt + output − 1, layers, k], SGLang's layout: every position the
model ran, the last sampled token excepted; −1 in the dense layers), for the trainer to replay. With
`indexer_replay_margin` τ > 0 (GLM-5.2), it carries the indexer's selection of every query whose top-k margin was
under τ (`meta["indexer_replay"]`, rollout/indexer_replay.py), on the sequence's own positions (the batch keeps
each cache slot's position: left padding and, under speculative decoding, rejected drafts' holes are not ones).
"""

from __future__ import annotations

import asyncio
import inspect
import itertools
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping

import torch

from rollout import indexer_replay
from rollout.sampling import processed_logprobs, sample, verify_drafts
from rollout.types import GenerateResult, SamplingParams

_STOP_WINDOW = 16  # tokens decoded to look for stop strings
SERVE_RESTARTS = 5  # failures of the serving loop in a row before the engine gives up
log = logging.getLogger(__name__)


@dataclass
class _Request:
    request_id: str
    input_ids: list[int]
    sampling: SamplingParams
    future: asyncio.Future
    loop: asyncio.AbstractEventLoop
    queued_at: float = field(default_factory=time.perf_counter)


@dataclass
class _Batch:
    """One batch's tensors, sampling settings and outputs (left-padded prompts)."""
    requests: list[_Request]
    ids: torch.Tensor
    mask: torch.Tensor
    positions: torch.Tensor
    temperature: torch.Tensor
    top_p: torch.Tensor
    top_k: torch.Tensor
    greedy: torch.Tensor
    generators: list[torch.Generator]
    max_new: list[int]
    stop_ids: list[set[int]]
    out_ids: list[list[int]]
    out_lp: list[list[float]]
    out_ver: list[list[int]]  # the weight version that sampled each output token
    finish: list[str | None]
    routing: list[list[torch.Tensor]] = field(default_factory=list)  # per row: [positions, layers, k] chunks
    indexer: list[list[dict]] = field(default_factory=list)  # per row: its fragile indexer rows, per forward
    # indexer replay: the sequence position of each cache slot [n, capacity] (−1: left padding, a rejected draft),
    # the first slots_used filled; grown by doubling, so that a long generation does not copy it at every step
    slot_positions: torch.Tensor | None = None
    slots_used: int = 0

    @property
    def done(self) -> bool:
        return all(f is not None for f in self.finish)

    @property
    def prompt_tokens(self) -> int:
        return sum(len(r.input_ids) for r in self.requests)


class LocalEngine:
    def __init__(self, model: torch.nn.Module, tokenizer=None, max_batch_size: int = 16,
                 gather_window_s: float = 0.02, weight_version: int = 0, speculative_steps: int = 0,
                 return_routed_experts: bool = False, indexer_replay_margin: float = 0.0):
        self.model = model.eval()
        self.return_routed_experts = return_routed_experts
        if return_routed_experts and "return_routing" not in inspect.signature(model.forward).parameters:
            raise ValueError(f"engine.return_routed_experts: {type(model).__name__} reports no expert routing "
                             "(a MoE policy such as GLM-5.2 does)")
        self.indexer_replay_margin = indexer_replay_margin
        if indexer_replay_margin < 0:
            raise ValueError(f"engine.indexer_replay_margin must be >= 0 (0: off), got {indexer_replay_margin}")
        if indexer_replay_margin > 0:
            if "indexer_margins" not in inspect.signature(model.forward).parameters:
                raise ValueError(f"engine.indexer_replay_margin: {type(model).__name__} has no sparse-attention "
                                 "indexer (a GLM-5.2 policy has)")
        # the model's keyword for its routing, and the layer count of the routing it reports
        self._routing_kw = {"return_routing": "experts"} if return_routed_experts else {}
        if indexer_replay_margin > 0:
            self._routing_kw = {"return_routing": True, "indexer_margins": True}
        self._num_layers = getattr(getattr(model, "config", None), "num_hidden_layers", 0)
        # > 0: draft this many tokens per round with the model's MTP layer (GLM-5.2) and verify them at once
        self.speculative_steps = speculative_steps
        self._drafter = None
        self._spec_seen = (0, 0)  # counters already reported by speculative_metrics
        if speculative_steps:
            from models.glm5.speculative import MTPDrafter

            self._drafter = MTPDrafter(model)
        self.tokenizer = tokenizer
        self.device = next(model.parameters()).device
        self.max_batch_size = max_batch_size
        self.gather_window_s = gather_window_s
        self.weight_version = weight_version
        self.pad_id = (getattr(tokenizer, "pad_token_id", None) if tokenizer is not None else None) or 0
        self._queue: deque[_Request] = deque()
        self._cond = threading.Condition()
        self._model_lock = threading.Lock()
        self._paused = False
        self._closed = False
        self._aborted: set[str] = set()
        self._ids = itertools.count()
        self._seed_rng = torch.Generator().manual_seed(0)
        # transformers renamed `past_key_values` to `cache` (5.2x); use whichever this version takes.
        params = inspect.signature(model.forward).parameters
        self._cache_kwarg = "cache" if "cache" in params else "past_key_values"
        self.stats = {"requests": 0, "batches": 0, "generated_tokens": 0, "prompt_tokens": 0, "busy_s": 0.0,
                      "parked_batches": 0, "partial_rollouts": 0, "decode_steps": 0}
        self._usage_seen = (time.perf_counter(), 0.0, 0)  # (when, busy_s, partial_rollouts) at the last report
        self._parked_s = 0.0  # the running batch's time parked for weight updates (not busy)
        self.failed = False  # the serving loop failed SERVE_RESTARTS times in a row and the engine closed
        self._thread = threading.Thread(target=self._serve, name="local-engine", daemon=True)
        self._thread.start()

    @classmethod
    def from_pretrained(cls, name_or_path: str, dtype: str = "float32", device: str = "cpu", **kwargs):
        from models import load_model, load_tokenizer

        return cls(load_model(name_or_path, "policy", dtype=dtype, device=device), load_tokenizer(name_or_path),
                   **kwargs)

    # ---- the Engine contract -------------------------------------------------------------------------
    async def generate(self, input_ids: list[int], sampling: SamplingParams, request_id: str | None = None,
                       session_id: str | None = None) -> GenerateResult:  # one replica: no routing by session
        if not input_ids:
            raise ValueError("generate: empty input_ids")
        loop = asyncio.get_running_loop()
        request = _Request(request_id or f"req-{next(self._ids)}", list(input_ids), sampling,
                           loop.create_future(), loop)
        with self._cond:
            if self._closed:
                raise RuntimeError("engine is closed")
            self._queue.append(request)
            self._cond.notify()
        return await request.future

    async def update_weights(self, weights: Mapping[str, torch.Tensor] | str | Path,
                             version: int | None = None) -> None:
        await asyncio.to_thread(self.load_weights, weights, version)

    async def pause(self) -> None:
        """Returns once no forward runs: the running batch (if any) is parked between two decode steps."""
        with self._cond:
            self._paused = True
        await asyncio.to_thread(self._model_lock.acquire)
        self._model_lock.release()

    async def resume(self) -> None:
        with self._cond:
            self._paused = False
            self._cond.notify_all()

    async def abort(self, request_ids: list[str]) -> None:
        with self._cond:
            self._aborted.update(request_ids)
            for request in [r for r in self._queue if r.request_id in self._aborted]:
                self._queue.remove(request)
                self._finish(request, GenerateResult([], [], "abort", {"weight_version": self.weight_version}))

    async def health(self) -> dict:
        return {"ok": self._thread.is_alive(), "weight_version": self.weight_version, "queued": len(self._queue),
                **self.stats}

    def usage_metrics(self) -> dict:
        """Since the last call: the fraction of wall time the engine spent computing (`engine/busy_frac`), the
        generations that a weight update cut and that went on with the new weights, the speculative counters."""
        now, busy, partial = time.perf_counter(), self.stats["busy_s"], self.stats["partial_rollouts"]
        (then, busy_then, partial_then), self._usage_seen = self._usage_seen, (now, busy, partial)
        return {"engine/busy_frac": min(1.0, (busy - busy_then) / max(now - then, 1e-9)),
                "engine/partial_rollouts": partial - partial_then, **self.speculative_metrics()}

    def speculative_metrics(self) -> dict:
        """Speculative decoding counters since the last call: verify rounds summed over rows, and drafts emitted
        (rl.cluster.engine_metrics turns them into the acceptance length). Empty when it is off.

        Deltas against what was last reported, not reset on read like the guard's counters: `stats` stays
        cumulative because `health()` publishes it whole, and the serving thread adds to it while this runs on
        the caller's thread, so a read-then-zero would drop a batch that finished in between."""
        if not self.speculative_steps:
            return {}
        rounds = self.stats.get("speculative_rounds", 0) - self._spec_seen[0]
        accepted = self.stats.get("speculative_accepted", 0) - self._spec_seen[1]
        self._spec_seen = (rounds + self._spec_seen[0], accepted + self._spec_seen[1])
        return {"engine/speculative_rounds": rounds, "engine/speculative_accepted": accepted}

    # ---- weights -------------------------------------------------------------------------------------
    def load_weights(self, weights: Mapping[str, torch.Tensor] | str | Path, version: int | None = None) -> None:
        """Copy named tensors (or an HF-format folder's safetensors) into the model, between batches."""
        if isinstance(weights, (str, Path)):
            from safetensors.torch import load_file

            files = sorted(Path(weights).glob("*.safetensors"))
            if not files:
                raise FileNotFoundError(f"no *.safetensors in {weights}")
            named: dict[str, torch.Tensor] = {}
            for f in files:
                named.update(load_file(str(f)))
            weights = named
        with self._model_lock:
            own = self.model.state_dict(keep_vars=True)
            unknown = [k for k in weights if k not in own]
            if unknown:
                raise KeyError(f"update_weights: {len(unknown)} unknown tensor names, e.g. {unknown[:3]}")
            with torch.no_grad():
                for name, tensor in weights.items():
                    target = own[name]
                    if target.shape != tensor.shape:
                        raise ValueError(f"update_weights: {name} has shape {tuple(tensor.shape)}, "
                                         f"engine expects {tuple(target.shape)}")
                    target.copy_(tensor.to(device=target.device, dtype=target.dtype))
            if version is not None:
                self.weight_version = version

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout=10)

    # ---- the serving thread --------------------------------------------------------------------------
    def _serve(self) -> None:
        """The serving loop, restarted in place when it fails outside a batch (a batch's own failure already goes
        to its callers): the model and its weights are intact, and the requests queued are served by the new
        loop. After SERVE_RESTARTS failures in a row the engine closes, failing what is queued, rather than spin."""
        failures, served = 0, -1
        while True:
            try:
                self._serve_loop()
                return
            except Exception as exc:
                failures = 1 if self.stats["batches"] != served else failures + 1  # a batch since: not in a row
                served = self.stats["batches"]
                self.stats["restarts"] = self.stats.get("restarts", 0) + 1
                log.exception("LocalEngine: the serving loop failed (%d in a row); %s", failures,
                              "restarting it" if failures < SERVE_RESTARTS else "closing the engine")
                if failures >= SERVE_RESTARTS:
                    self.failed = True  # the rollout worker exits on its next episode, for Ray to restart it
                    with self._cond:
                        self._closed = True
                        pending = list(self._queue)
                        self._queue.clear()
                    for request in pending:
                        request.loop.call_soon_threadsafe(_set_exception, request.future, exc)
                    return

    def _serve_loop(self) -> None:
        while True:
            with self._cond:
                while not self._closed and (self._paused or not self._queue):
                    self._cond.wait()
                if self._closed:
                    pending = list(self._queue)
                    self._queue.clear()
                    break
            self._gather_pause()
            with self._cond:
                if self._paused:  # paused during the window: no forward until resume()
                    continue
                batch = [self._queue.popleft() for _ in range(min(self.max_batch_size, len(self._queue)))]
            if not batch:
                continue
            with self._model_lock:
                started, self._parked_s = time.perf_counter(), 0.0
                try:
                    results = self._run_batch(batch)
                except Exception as exc:  # a failing batch must not hang its callers
                    for request in batch:
                        request.loop.call_soon_threadsafe(_set_exception, request.future, exc)
                    continue
                busy = time.perf_counter() - started - self._parked_s
            self.stats["batches"] += 1
            self.stats["busy_s"] += busy
            for request, result in zip(batch, results):
                result.meta["batch_size"] = len(batch)
                result.meta["queue_s"] = started - request.queued_at
                result.meta["batch_s"] = busy
                self._finish(request, result)
        for request in pending:
            self._finish(request, GenerateResult([], [], "abort", {"weight_version": self.weight_version}))

    def _gather_pause(self) -> None:
        time.sleep(self.gather_window_s)  # let concurrent episodes join this batch

    def _park_while_paused(self, b: _Batch) -> None:
        """Between two decode steps: while a weight update is under way, give the model up and wait. The rows
        go on afterwards on the new weights (their tokens say so); closing the engine ends them as aborted."""
        self.stats["decode_steps"] += 1
        if not self._paused:  # read without the lock: a stale False only delays the park by one step
            return
        parked = time.perf_counter()
        self.stats["parked_batches"] += 1
        self.stats["partial_rollouts"] += sum(f is None for f in b.finish)  # rows that go on on new weights
        self._model_lock.release()
        try:
            with self._cond:
                while self._paused and not self._closed:
                    self._cond.wait()
        finally:
            self._model_lock.acquire()
            self._parked_s += time.perf_counter() - parked
        if self._closed:
            b.finish = [f or "abort" for f in b.finish]

    def _finish(self, request: _Request, result: GenerateResult) -> None:
        self._aborted.discard(request.request_id)
        try:
            request.loop.call_soon_threadsafe(_set_result, request.future, result)
        except RuntimeError:  # the caller's event loop is closed: nobody waits for this answer any more
            pass

    def _prepare(self, batch: list[_Request]) -> _Batch:
        n = len(batch)
        lengths = [len(r.input_ids) for r in batch]
        width = max(lengths)
        ids = torch.full((n, width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((n, width), dtype=torch.long)
        for i, r in enumerate(batch):  # left padding: every row's next token lands in the last column
            ids[i, width - lengths[i]:] = torch.tensor(r.input_ids)
            mask[i, width - lengths[i]:] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        sp = [r.sampling for r in batch]
        generators = []
        for s in sp:
            seed = s.seed if s.seed is not None else int(torch.randint(0, 2**62, (1,), generator=self._seed_rng))
            generators.append(torch.Generator(device=self.device).manual_seed(seed))
        temperature = torch.tensor([s.temperature for s in sp], dtype=torch.float32, device=self.device)
        max_new = [max(0, s.max_new_tokens) for s in sp]
        return _Batch(batch, ids, mask, (mask.cumsum(-1) - 1).clamp(min=0), temperature,
                      torch.tensor([s.top_p for s in sp], dtype=torch.float32, device=self.device),
                      torch.tensor([s.top_k for s in sp], dtype=torch.long, device=self.device), temperature <= 0,
                      generators, max_new, [set() if s.ignore_eos else set(s.stop_token_ids) for s in sp],
                      [[] for _ in batch], [[] for _ in batch], [[] for _ in batch],
                      ["length" if m == 0 else None for m in max_new], [[] for _ in batch],
                      [[] for _ in batch])

    def _emit(self, b: _Batch, i: int, token: int, logprob: float) -> bool:
        """Append one sampled token to row i unless the row has finished (then False); mark it finished when it
        should."""
        if b.finish[i] is not None:
            return False
        request, sp = b.requests[i], b.requests[i].sampling
        if request.request_id in self._aborted:
            b.finish[i] = "abort"
            return False
        b.out_ids[i].append(token)
        b.out_lp[i].append(logprob)
        b.out_ver[i].append(self.weight_version)
        if token in b.stop_ids[i] or (not sp.ignore_eos and self._hit_stop_string(b.out_ids[i], sp.stop_strings)):
            b.finish[i] = "stop"
        elif len(b.out_ids[i]) >= b.max_new[i]:
            b.finish[i] = "length"
        return True

    def _results(self, b: _Batch, **meta) -> list[GenerateResult]:
        self.stats["requests"] += len(b.requests)
        self.stats["prompt_tokens"] += b.prompt_tokens
        self.stats["generated_tokens"] += sum(len(o) for o in b.out_ids)
        results = [GenerateResult(b.out_ids[i], b.out_lp[i], b.finish[i] or "length",
                                  {"request_id": r.request_id, "weight_version": self.weight_version,
                                   "prompt_tokens": len(r.input_ids), "completion_tokens": len(b.out_ids[i]), **meta},
                                  b.out_ver[i])
                   for i, r in enumerate(b.requests)]
        if self.return_routed_experts:  # every position run, in order; a finished row's later steps cut off
            for i, (r, result) in enumerate(zip(b.requests, results)):
                ran = len(r.input_ids) + len(b.out_ids[i]) - 1
                result.meta["routed_experts"] = torch.cat(b.routing[i])[:ran].numpy()
        if self.indexer_replay_margin > 0:
            k = self.model.config.index_topk
            for i, (r, result) in enumerate(zip(b.requests, results)):
                ran = len(r.input_ids) + len(b.out_ids[i]) - 1
                result.meta["indexer_replay"] = indexer_replay.concat(b.indexer[i], k, below=ran)
        return results

    def _record_indexer(self, b: _Batch, out, new_positions: torch.Tensor, kept: torch.Tensor | None = None) -> None:
        """Keep each row's queries of this forward whose indexer margin is under τ (rollout/indexer_replay.py), on
        the rows' own positions. The forward appended cache slots holding `new_positions` [n, s]; under speculative
        decoding only the first kept[i] + 1 of them stay (the rest are holes, recorded as −1 and never shipped)."""
        if self.indexer_replay_margin <= 0:
            return
        if kept is not None:
            new_positions = torch.where(torch.arange(new_positions.shape[1], device=kept.device) <= kept[:, None],
                                        new_positions, -1)
        for i, rows in enumerate(indexer_replay.fragile_rows(out.indexer_topk, out.indexer_margins,
                                                             self.indexer_replay_margin, new_positions,
                                                             _append_slots(b, new_positions))):
            b.indexer[i].append(rows)

    def _record_routing(self, b: _Batch, out, columns) -> None:
        """Append each row's routing of this forward's positions `columns(i)` (a slice of the forward's) to the
        row's: one transfer to the host for the batch."""
        if not self.return_routed_experts:
            return
        experts = out.routed_experts
        first = next(iter(experts.values()))
        routing = torch.full((*first.shape[:2], self._num_layers, first.shape[-1]), -1, dtype=torch.int16,
                             device=first.device)
        for layer, ids in experts.items():
            routing[:, :, layer] = ids
        routing = routing.cpu()
        for i in range(len(b.requests)):
            b.routing[i].append(routing[i, columns(i)])

    def _process(self, b: _Batch, logits: torch.Tensor) -> torch.Tensor:
        """log μ [n, V] of rows' logits [n, V]; n = rows × p with each row's p positions consecutive."""
        rep = logits.shape[0] // len(b.requests)
        return processed_logprobs(logits, b.temperature.repeat_interleave(rep), b.top_k.repeat_interleave(rep),
                                  b.top_p.repeat_interleave(rep))

    def _sample_and_emit(self, b: _Batch, logits: torch.Tensor) -> torch.Tensor:
        """One token per row from its last-position logits [n, V], emitted; returns the tokens [n]."""
        tokens, token_lp = sample(self._process(b, logits), b.greedy, b.generators)
        for i, (tok, lp) in enumerate(zip(tokens.tolist(), token_lp.tolist())):  # one host sync per step
            self._emit(b, i, tok, lp)
        return tokens

    def _prefill(self, b: _Batch, cache):
        """The prompts into `cache` and each row's first token sampled and emitted, the opening that plain and
        speculative decoding share. Returns the model's output (the speculative path reads its hidden states) and
        the tokens [n]."""
        out = self.model(input_ids=b.ids, attention_mask=b.mask, position_ids=b.positions, use_cache=True,
                         logits_to_keep=1, **{self._cache_kwarg: cache}, **self._routing_kw)
        width = b.ids.shape[1]  # left padding: row i's prompt is its last len(input_ids) columns
        self._record_routing(b, out, lambda i: slice(width - len(b.requests[i].input_ids), width))
        self._record_indexer(b, out, torch.where(b.mask > 0, b.positions, -1))
        return out, self._sample_and_emit(b, out.logits[:, -1].float())

    @torch.inference_mode()
    def _run_batch(self, batch: list[_Request]) -> list[GenerateResult]:
        if self.speculative_steps:
            return self._run_batch_speculative(batch)
        from transformers import DynamicCache

        b = self._prepare(batch)
        cache = DynamicCache()
        _, tokens = self._prefill(b, cache)
        mask, next_pos = b.mask, b.positions[:, -1:] + 1
        while not b.done:
            self._park_while_paused(b)
            if b.done:
                break
            mask = torch.cat([mask, torch.ones((len(batch), 1), dtype=mask.dtype, device=mask.device)], dim=1)
            out = self.model(input_ids=tokens.unsqueeze(-1), attention_mask=mask, position_ids=next_pos,
                             use_cache=True, **{self._cache_kwarg: cache}, **self._routing_kw)
            self._record_routing(b, out, lambda i: slice(0, 1))
            self._record_indexer(b, out, next_pos)
            logits = out.logits[:, -1].float()
            next_pos = next_pos + 1
            tokens = self._sample_and_emit(b, logits)
        return self._results(b)

    @torch.inference_mode()
    def _run_batch_speculative(self, batch: list[_Request]) -> list[GenerateResult]:
        """Draft k tokens per row with the model's MTP layer, verify them in one forward (models/glm5/
        speculative.py has the round; rollout/sampling.verify_drafts the acceptance rule, exact in distribution)."""
        from models.glm5 import Glm5Cache

        k, drafter, b = self.speculative_steps, self._drafter, self._prepare(batch)
        n, rows = len(batch), torch.arange(len(batch), device=self.device)
        cache = Glm5Cache()
        mask = b.mask

        def draft_sample(logits):
            logq = self._process(b, logits)
            return sample(logq, b.greedy, b.generators)[0], logq

        out, token = self._prefill(b, cache)
        # MTP step 1 over the prompt: anchor i sees the token after it (the last one: the token just sampled)
        h1, selection = drafter.extend(cache, out.last_hidden_state, torch.cat([b.ids[:, 1:], token[:, None]], 1),
                                       b.positions, mask)
        width = b.ids.shape[1]
        offset, pos = torch.full((n,), width - 1, device=self.device), b.positions[:, -1]
        row_rounds, row_accepted = [0] * n, [0] * n  # verify rounds a row took part in; its drafts emitted
        while not b.done:
            self._park_while_paused(b)
            if b.done:
                break
            past = cache.get_seq_length()  # drafting reads the cache, never appends to it
            # h1 covers the cache's newest h1.shape[1] slots and `offset` is the row's last real anchor among them,
            # so its cache slot (the draft's causal bound) is past − h1.shape[1] + offset
            drafts, logq = drafter.draft(cache, h1[rows, offset].unsqueeze(1), selection, offset,
                                         past - h1.shape[1] + offset, pos, mask, k, draft_sample)
            verify_pos = (pos + 1).unsqueeze(1) + torch.arange(k + 1, device=self.device)
            mask = torch.cat([mask, torch.ones((n, k + 1), dtype=mask.dtype, device=mask.device)], dim=1)
            out = self.model(input_ids=torch.cat([token[:, None], drafts], 1), attention_mask=mask,
                             position_ids=verify_pos, cache=cache, use_cache=True, logits_to_keep=0,
                             **self._routing_kw)
            logp = self._process(b, out.logits.float().reshape(n * (k + 1), -1)).view(n, k + 1, -1)
            kept_t, token = verify_drafts(logp, logq, drafts, b.greedy, b.generators)
            draft_lp = logp[:, :k].gather(-1, drafts.unsqueeze(-1)).squeeze(-1).tolist()
            kept, following = kept_t.tolist(), token.tolist()
            # the positions this round ran that stay: the last token and the accepted drafts
            self._record_routing(b, out, lambda i: slice(0, kept[i] + 1))
            self._record_indexer(b, out, verify_pos, kept_t)
            following_lp, draft_ids = logp[rows, kept_t, token].tolist(), drafts.tolist()
            for i in range(n):
                if b.finish[i] is not None:
                    continue
                row_rounds[i] += 1
                for j in range(kept[i]):
                    row_accepted[i] += self._emit(b, i, draft_ids[i][j], draft_lp[i][j])
                self._emit(b, i, following[i], following_lp[i])
            if b.done:
                break
            slot = torch.arange(k + 1, device=self.device)
            mask[:, past:] = (slot[None, :] <= kept_t[:, None]).to(mask.dtype)  # rejected drafts become holes
            after = torch.cat([drafts, drafts[:, -1:]], 1)  # the token after each new slot: next draft or b
            after[rows, kept_t] = token
            h1, selection = drafter.extend(cache, out.last_hidden_state, after, verify_pos, mask)
            offset, pos = kept_t, pos + 1 + kept_t
        self.stats["speculative_rounds"] = self.stats.get("speculative_rounds", 0) + sum(row_rounds)
        self.stats["speculative_accepted"] = self.stats.get("speculative_accepted", 0) + sum(row_accepted)
        results = self._results(b)
        for r, rounds, accepted in zip(results, row_rounds, row_accepted):
            r.meta.update(speculative_rounds=rounds, speculative_accepted=accepted)
        return results

    def _hit_stop_string(self, ids: list[int], stop_strings: tuple[str, ...]) -> bool:
        if not stop_strings or self.tokenizer is None:
            return False
        tail = self.tokenizer.decode(ids[-_STOP_WINDOW:], skip_special_tokens=False)
        return any(s in tail for s in stop_strings)


def _set_result(future: asyncio.Future, result) -> None:
    if not future.done():
        future.set_result(result)


def _set_exception(future: asyncio.Future, exc: BaseException) -> None:
    if not future.done():
        future.set_exception(exc)


def _append_slots(b: _Batch, new_positions: torch.Tensor) -> torch.Tensor:
    """Append a forward's cache slots' positions [n, s] to the batch's; returns the filled part [n, slots_used]."""
    n, s = new_positions.shape
    used = b.slots_used
    if b.slot_positions is None or used + s > b.slot_positions.shape[1]:
        grown = torch.full((n, max(2 * (used + s), 64)), -1, dtype=new_positions.dtype, device=new_positions.device)
        if b.slot_positions is not None:
            grown[:, :used] = b.slot_positions[:, :used]
        b.slot_positions = grown
    b.slot_positions[:, used:used + s] = new_positions
    b.slots_used = used + s
    return b.slot_positions[:, :b.slots_used]
