"""The actor's weights to the engines: one object per transport, one interface.

    sync = make_weight_sync(cfg, workers, run_dir)   # chosen by engine.type and engine.sglang.weight_sync
    metrics = sync.push(version)                     # afterwards every engine serves `version`

- `ObjectStoreSync`: LocalEngine rollout workers. Each actor rank puts its share of the buckets into Ray's object
  store once; every rollout worker pulls them all and applies them at once (pause → update → resume).
- `SGLangDiskSync`, `SGLangTensorSync`, `SGLangGroupSync`: an SGLang fleet, through an HF folder the servers reload,
  CUDA IPC handles of the actor's own GPU copies (servers on its GPU), or a broadcast over a process group with the
  servers (NCCL). The servers pause (`engine.sglang.pause_mode`), load, resume; the rollout workers then take
  samples only from servers at the new version.
- `FallbackSync`: a transport that fails cleanly (a server that refuses or errors) hands over, for the rest of the
  run, to `engine.sglang.weight_sync_fallback`: a run is not lost to a transport problem.

`verify=True` reads the weights back from every engine and reports the largest difference from the trainer's; for
SGLang also the servers' logprobs on a fixed probe against the trainer's (which holds for every architecture).
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

import ray

if TYPE_CHECKING:
    import torch

    from rl.cluster import Workers
    from rl.config import Config
    from rollout.sglang.fleet import SGLangFleet

log = logging.getLogger(__name__)


class WeightSync:
    """The interface: `push(version)` → metrics (`perf/weight_sync_*`, `rollout/weight_version`)."""

    name = ""

    def __init__(self, workers: "Workers", bucket_mb: int, verify: bool):
        self.workers, self.bucket_mb, self.verify = workers, bucket_mb, verify
        self.lock = threading.RLock()  # a push and a restarted worker's refresh never interleave

    def push(self, version: int) -> dict:
        raise NotImplementedError

    def refresh(self, worker: int) -> None:
        """Bring rollout worker `worker`, just restarted, to the version the others serve."""
        raise NotImplementedError


class ObjectStoreSync(WeightSync):
    name = "object_store"

    def push(self, version: int) -> dict:
        w = self.workers
        started = time.perf_counter()
        with self.lock:
            refs = w.actor.weight_bucket_refs(self.bucket_mb)
            sent = self._apply(range(len(w.rollout)), refs, version)
            reached = [i for i, size in sent.items() if size is not None]
            w.weight_version = version
        if not reached:  # every worker restarting: each gets the weights once back (rl/rollout_manager.py)
            log.error("weight sync to version %d reached no rollout worker", version)
        out = {"perf/weight_sync_s": time.perf_counter() - started,
               "perf/weight_sync_mb": sum(sent[i] for i in reached) / max(len(reached), 1) / 2**20,
               "perf/weight_sync_buckets": len(refs), "rollout/weight_version": version}
        if self.verify and reached:
            trainer = {k: v for ref in refs for k, v in ray.get(ref).items()}
            diffs = [max(float((engine[k] - t).abs().max()) for k, t in trainer.items())
                     for engine in ray.get([w.rollout[i].engine_weights.remote() for i in reached])]
            out["perf/weight_sync_max_abs_diff"] = max(diffs)
        return out

    def refresh(self, worker: int) -> None:
        with self.lock:
            refs = self.workers.actor.weight_bucket_refs(self.bucket_mb)
            if self._apply([worker], refs, self.workers.weight_version)[worker] is None:
                raise RuntimeError(f"rollout worker {worker} died again while it received the weights")

    def _apply(self, indices, refs: list, version: int) -> dict[int, int | None]:
        """The buckets to the rollout workers `indices` (all at once), each applying them at once; per worker the
        bytes it took, or None when it is down (once Ray has restarted it, `refresh` gives it the current weights:
        rl/rollout_manager.py)."""
        rollout = self.workers.rollout
        received = {i: [rollout[i].receive_bucket.remote(ref) for ref in refs] for i in indices}
        sizes = {i: _answer(i, lambda got=got: sum(ray.get(got))) for i, got in received.items()}
        commits = {i: rollout[i].commit_weights.remote(version) for i, size in sizes.items() if size is not None}
        for i, ref in commits.items():
            if _answer(i, lambda ref=ref: ray.get(ref)) is None:
                sizes[i] = None
        return sizes




class SGLangSync(WeightSync):
    """What the SGLang transports share: the fleet's lock, the version stamp on the rollout workers, metrics and
    the read-back check. Subclasses say how the bytes travel (`send`)."""

    def __init__(self, workers: "Workers", bucket_mb: int, verify: bool, fleet: "SGLangFleet", folder: str):
        super().__init__(workers, bucket_mb, verify)
        self.fleet, self.folder = fleet, folder
        args = fleet.cfg.args
        self.tp = int(args.get("tp", args.get("tp-size", args.get("tp_size", 1))) or 1)
        self.served_dtype = served_dtype(fleet) if verify else None  # only the read-back check needs it
        self.probe_temperature = 1.0  # the actor's logprob temperature (make_weight_sync sets the rollout's)

    def send(self, urls: list[str], version: int, fresh: bool) -> dict:
        raise NotImplementedError

    def refresh(self, worker: int) -> None:
        """A restarted rollout worker holds no weights (the servers do): it learns the version they serve."""
        with self.fleet.sync_lock:
            ray.get(self.workers.rollout[worker].set_weight_version.remote(self.workers.weight_version))

    def push(self, version: int, urls: list[str] | None = None, fresh: bool = False) -> dict:
        """To every server (or `urls`, e.g. the restarted ones; `fresh`: a new process group if there is one)."""
        urls = list(self.fleet.urls if urls is None else urls)
        with self.fleet.sync_lock:  # the version stamp too: a restart's re-sync must not see a half-done push
            return self._stamped(version, self.send(urls, version, fresh))

    def _stamped(self, version: int, stats: dict) -> dict:
        w = self.workers
        for i, ref in enumerate([r.set_weight_version.remote(version) for r in w.rollout]):
            _answer(i, lambda ref=ref: ray.get(ref))  # one restarting learns it from refresh
        w.weight_version = version
        out = {"perf/weight_sync_s": stats["seconds"], "perf/weight_sync_mb": stats.get("bytes", 0) / 2**20,
               "perf/weight_sync_buckets": stats.get("buckets", 0), "rollout/weight_version": version,
               "rollout/server_restarts": self.fleet.restarts, "perf/weight_sync_fallbacks": self.fleet.sync_fallbacks}
        if self.verify:
            out["perf/weight_sync_max_abs_diff"] = verify_sglang_weights(w.actor, self.fleet.urls, self.served_dtype)
            out["perf/weight_sync_probe_abs_diff"] = verify_sglang_logprobs(w.actor, self.fleet.urls,
                                                                            self.probe_temperature)
        return out


class SGLangDiskSync(SGLangSync):
    name = "disk"

    def send(self, urls, version, fresh):
        return self.workers.actor.on_every_rank("push_sglang_disk", urls, version, self.folder,
                                                self.fleet.cfg.pause_mode)


class SGLangTensorSync(SGLangSync):
    name = "tensor"

    def send(self, urls, version, fresh):
        return self.workers.actor.on_every_rank("push_sglang_tensors", urls, version, self.bucket_mb,
                                                [self.tp] * len(urls), self.fleet.cfg.pause_mode)


class SGLangGroupSync(SGLangSync):
    name = "distributed"

    def send(self, urls, version, fresh):
        return self.workers.actor.on_every_rank("push_sglang_group", urls, version, self.bucket_mb,
                                                [self.tp] * len(urls), self.fleet.cfg.pause_mode, fresh)


class FallbackSync(SGLangSync):
    """`primary` until it fails, then `fallback` (with a fresh connection) for the rest of the run."""

    def __init__(self, primary: SGLangSync, fallback: SGLangSync):
        self.__dict__.update(primary.__dict__)
        self.current, self.fallback = primary, fallback

    @property
    def name(self) -> str:  # type: ignore[override]
        return self.current.name

    def send(self, urls, version, fresh):
        started = time.perf_counter()
        try:
            return self.current.send(urls, version, fresh)
        except Exception as e:
            # Helps when the transport fails cleanly; a broadcast stuck inside a server would hold that server's
            # update lock, and the fleet's health monitor has to act.
            if self.fallback is None:
                raise
            log.error("weight sync (%s) failed; %s from now on. The error: %s", self.current.name,
                      self.fallback.name, e)
            self.current, self.fallback = self.fallback, None
            self.fleet.sync_fallbacks += 1
            stats = self.current.send(urls, version, True)
            stats["seconds"] = time.perf_counter() - started  # the failed attempt counts too
            return stats


def _answer(i: int, get):
    """A rollout worker's answer, or None when it is down (once Ray has restarted it, `refresh` catches it up)."""
    try:
        return get()
    except ray.exceptions.RayActorError as exc:
        log.error("weight sync: rollout worker %d is down (%s); it gets the weights when it is back", i, exc)
        return None


SGLANG_TRANSPORTS = {"disk": SGLangDiskSync, "tensor": SGLangTensorSync, "distributed": SGLangGroupSync}


def make_weight_sync(cfg: "Config", workers: "Workers", run_dir: str = "") -> WeightSync:
    t = cfg.trainer
    if workers.fleet is None:
        return ObjectStoreSync(workers, t.weight_sync_bucket_mb, t.verify_weight_sync)
    sg = cfg.engine.sglang
    folder = sg.weight_sync_dir or (f"{run_dir}/weights" if run_dir else "/tmp/agentic-rl-weights")
    made = {mode: SGLANG_TRANSPORTS[mode](workers, t.weight_sync_bucket_mb, t.verify_weight_sync, workers.fleet, folder)
            for mode in {sg.weight_sync, sg.weight_sync_fallback} if mode}
    for sync in made.values():  # the actor scores at the rollout temperature (greedy: 1)
        sync.probe_temperature = cfg.engine.temperature if cfg.engine.temperature > 0 else 1.0
    primary = made[sg.weight_sync]
    if sg.weight_sync_fallback and sg.weight_sync_fallback != sg.weight_sync:
        return FallbackSync(primary, made[sg.weight_sync_fallback])
    return primary


def served_dtype(fleet: "SGLangFleet") -> "torch.dtype":
    """The dtype the servers keep their weights in: the `dtype` server argument, or under `auto` (SGLang's default)
    the checkpoint's `torch_dtype`. Resolved once: neither changes during a run."""
    import torch

    dtypes = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16, "half": torch.float16}
    served = str(fleet.cfg.args.get("dtype", "auto"))
    if served == "auto":  # SGLang serves the checkpoint's dtype
        config = Path(fleet.model_path) / "config.json"
        served = json.loads(config.read_text()).get("torch_dtype", "float32") if config.exists() else "float32"
    return dtypes.get(str(served), torch.float32)


def verify_sglang_weights(actor, urls: list[str], dtype: "torch.dtype", names_per_server: int = 4,
                          rows: int = 4) -> float:
    """The first rows of a few parameters, read back from every server (`/get_weights_by_name`) and compared
    with the trainer's. Servers fuse some parameters (q/k/v); names they do not answer for are skipped."""
    import torch

    from rollout.sglang.client import SGLangClient, SGLangError

    shapes = actor.parameter_shapes()
    names = [n for n, shape in shapes.items() if len(shape) <= 2]
    picks = [names[int(i * (len(names) - 1) / max(names_per_server - 1, 1))] for i in range(names_per_server)]
    state = actor.gathered_state(picks)  # only the compared parameters are gathered

    async def read(url: str) -> float:
        client, worst, compared = SGLangClient(url), 0.0, 0
        try:
            for name in picks:
                try:
                    got = torch.tensor(await client.get_weights_by_name(name, rows), dtype=torch.float32)
                except SGLangError:
                    continue
                want = state[name][:rows].to(dtype).float()  # the server keeps its own dtype
                if got.shape == want.shape:
                    worst, compared = max(worst, float((got - want).abs().max())), compared + 1
        finally:
            await client.close()
        if not compared:  # e.g. SGLang's GLM-5.2 model has no get_weights_by_name: the logprob probe checks it
            log.warning("verify_weight_sync: %s read back none of %s; the logprob probe is the check", url, picks)
            return float("nan")
        return worst

    async def all_servers():
        return await asyncio.gather(*(read(u) for u in urls))

    answered = [d for d in asyncio.run(all_servers()) if not math.isnan(d)]
    return max(answered) if answered else float("nan")


PROBE_TOKENS = 128
PROBE_MEAN_TOLERANCE = 0.05  # mean |Δ logprob| (a bf16 server against the fp32 trainer: about 0.005)


def verify_sglang_logprobs(actor, urls: list[str], temperature: float = 1.0) -> float:
    """A check that reads no parameter by name, so it holds for every architecture and however a server fuses or
    renames its weights: a fixed probe of PROBE_TOKENS tokens is scored by every server (prefill only, input
    logprobs) and by the trainer, and the largest per-server mean |Δ logprob| is returned. Above
    PROBE_MEAN_TOLERANCE the weights the servers hold are not the trainer's: logged as an error."""
    import torch

    from rollout.sglang.client import SGLangClient

    embeddings = [shape[0] for name, shape in actor.parameter_shapes().items() if "embed" in name and len(shape) == 2]
    vocab = min([1000, *embeddings])  # ids every vocabulary has
    probe = torch.randint(0, vocab, (PROBE_TOKENS,), generator=torch.Generator().manual_seed(0)).tolist()
    ours = actor.compute_logprobs([{"token_ids": probe, "loss_mask": [0] + [1] * (PROBE_TOKENS - 1)}], True, False).result()
    ours = ours["old_logprobs"][0][1:]

    async def theirs(url: str) -> torch.Tensor:
        client = SGLangClient(url)
        try:
            body = await client.post("/generate", {
                "input_ids": probe, "return_logprob": True, "logprob_start_len": 0,
                "sampling_params": {"max_new_tokens": 0, "temperature": temperature}})
        finally:
            await client.close()
        return torch.tensor([float(lp) for lp, *_ in body["meta_info"]["input_token_logprobs"][1:]])

    async def all_servers():
        return await asyncio.gather(*(theirs(u) for u in urls))

    try:
        worst = max(float((got - ours).abs().mean()) for got in asyncio.run(all_servers()))
    except Exception as exc:  # a server down or restarting: the check is lost for this sync, not the run
        log.error("verify_weight_sync: the logprob probe failed: %s", exc)
        return float("nan")
    if worst > PROBE_MEAN_TOLERANCE:
        log.error("verify_weight_sync: a server's logprobs on the probe differ from the trainer's by %.4f on average "
                  "(tolerance %.2f): its weights are not the trainer's", worst, PROBE_MEAN_TOLERANCE)
    return worst
