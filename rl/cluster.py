"""The Ray side of a run: start Ray, place the workers, dispatch episodes, move weights.

Layout (docs/DESIGN.md §5): N rollout workers (each an engine replica running many episodes concurrently), the
actor's and the critic's trainer groups (rl/group.py: each a DeepSpeed world of trainer.*_ranks Ray actors). On the embedded default everything is a
process on this machine; every placement comes from the config.
"""

from __future__ import annotations

import logging
import math
import os
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import ray
from tqdm import tqdm

from critic.worker import CriticWorker
from environments import Task
from models.training import OptimConfig
from rl.actor import ActorWorker
from rl.config import Config
from rl.group import TrainerGroup
from rollout.sglang.fleet import SGLangFleet
from rollout.types import Trajectory
from rollout.worker import RolloutWorker

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)


@dataclass
class Workers:
    actor: TrainerGroup
    critic: TrainerGroup | None
    rollout: list[ray.actor.ActorHandle]
    fleet: SGLangFleet | None = None  # engine.type=sglang: the servers the rollout workers talk to
    weight_sync_dir: str = ""
    weight_version: int = 0  # what the engines serve
    served_dtype: torch.dtype | None = None  # the fleet's weight dtype (sglang_served_dtype), for verify_weight_sync


def start_ray(cfg: Config) -> None:
    if ray.is_initialized():
        return
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    if cfg.trainer.ray_address:
        ray.init(address=cfg.trainer.ray_address, log_to_driver=True)
    else:
        import torch

        env_vars = {}
        if cfg.engine.type == "sglang" and cfg.engine.sglang.weight_sync == "distributed":
            env_vars["NCCL_CUMEM_ENABLE"] = "0"  # before any NCCL communicator of the trainer (weights.py says why)
        ray.init(num_cpus=os.cpu_count(), num_gpus=torch.cuda.device_count(), include_dashboard=False,
                 log_to_driver=True, configure_logging=False, runtime_env={"env_vars": env_vars} if env_vars else None)


def spawn(cfg: Config, policy: str, critic: str | None, run_dir: str = "") -> Workers:
    t = cfg.trainer
    fleet = None
    if cfg.engine.type == "sglang":  # first: the servers take minutes to load, and their GPUs come first
        fleet = SGLangFleet(cfg.engine.sglang, policy, log_dir=f"{run_dir}/sglang" if run_dir else None)
        fleet.start()
    threads = t.torch_threads or 0
    common = dict(weight_decay=t.weight_decay, grad_clip=t.grad_clip, zero_stage=t.zero_stage,
                  micro_batch_tokens=t.micro_batch_tokens, gradient_checkpointing=t.gradient_checkpointing,
                  pack_micro_batches=t.pack_micro_batches, offload_optimizer=t.offload_optimizer,
                  offload_params=t.offload_params)
    actor = TrainerGroup(ActorWorker, t.actor_ranks, t.actor_gpus, "actor",
                         policy, OptimConfig(learning_rate=t.learning_rate, **common), cfg.algorithm,
                         temperature=cfg.engine.temperature, dtype=cfg.model.dtype, seed=cfg.seed, torch_threads=threads)
    critic_worker = None
    if critic is not None:  # pure on-policy distillation trains no critic
        critic_worker = TrainerGroup(CriticWorker, t.critic_ranks, t.critic_gpus, "critic",
                                     critic, OptimConfig(learning_rate=t.critic_learning_rate, **common),
                                     cfg.algorithm.value_clip or None, dtype=cfg.model.dtype, seed=cfg.seed + 1,
                                     torch_threads=threads)
    rollout = [ray.remote(num_cpus=0, num_gpus=cfg.engine.gpus_per_worker,
                          max_concurrency=cfg.engine.max_concurrent_episodes + 8)(RolloutWorker).remote(
        policy, cfg.engine, **rollout_worker_kwargs(cfg), worker_index=i,
        sglang_endpoint=fleet.endpoint() if fleet else None)
        for i in range(cfg.engine.num_workers)]
    ray.get([h.__ray_ready__.remote() for h in rollout])
    for group in (actor, critic_worker):
        if group is not None:
            for p in group.placement_info():
                log.info("%s rank %d/%d on %s, GPUs %s (%s)", group.role, p["rank"], p["world_size"], p["node"],
                         p["gpus"] or "none", p["device"])
    sync_dir = cfg.engine.sglang.weight_sync_dir or (f"{run_dir}/weights" if run_dir else "/tmp/agentic-rl-weights")
    return Workers(actor, critic_worker, rollout, fleet, sync_dir,
                   served_dtype=sglang_served_dtype(fleet) if fleet else None)


def sglang_served_dtype(fleet: SGLangFleet) -> torch.dtype:
    """The dtype the servers keep their weights in: the `dtype` server argument, or under `auto` (SGLang's default)
    the checkpoint's `torch_dtype`. Resolved once when the fleet starts, not on every verified sync: neither the
    servers' arguments nor the checkpoint's config.json change during a run."""
    import json
    from pathlib import Path

    import torch

    dtypes = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16, "half": torch.float16}
    served = str(fleet.cfg.args.get("dtype", "auto"))
    if served == "auto":  # SGLang serves the checkpoint's dtype
        config = Path(fleet.model_path) / "config.json"
        served = json.loads(config.read_text()).get("torch_dtype", "float32") if config.exists() else "float32"
    return dtypes.get(str(served), torch.float32)


def rollout_worker_kwargs(cfg: Config) -> dict:
    """What every RolloutWorker of a run shares besides its model and engine config: the agent, the guard, the
    chat and tool formats, the sandbox and the grading."""
    return {"agent": cfg.agent, "guard": cfg.guard, "chat_format": cfg.model.chat_format,
            "tool_format": cfg.model.tool_format, "sandbox_backend": cfg.env.sandbox,
            "sandbox_limits": dict(vars(cfg.env.limits)), "reward": cfg.env.reward,
            "grade_timeout_s": cfg.env.grade_timeout_s}


def run_episodes(workers: Workers, tasks: list[Task], mode: str, seed: int, desc: str) -> list[Trajectory]:
    """Every task once, spread round-robin over the rollout workers; results in task order."""
    refs = [workers.rollout[i % len(workers.rollout)].run_episode.remote(task, mode, seed * 1_000_003 + i)
            for i, task in enumerate(tasks)]
    index = {ref: i for i, ref in enumerate(refs)}
    results: list[Trajectory | None] = [None] * len(refs)
    pending = list(refs)
    with tqdm(total=len(refs), desc=desc, unit="ep", leave=False) as bar:
        while pending:
            done, pending = ray.wait(pending, num_returns=1)
            results[index[done[0]]] = ray.get(done[0])
            bar.update(1)
    return results  # type: ignore[return-value]


def push_weights(workers: Workers, version: int, bucket_mb: int, verify: bool = False) -> dict:
    """Actor → every engine, bucket by bucket through Ray's object store; applied atomically per engine.
    With an SGLang fleet the actor sends straight to the servers (tensor, NCCL or disk)."""
    if workers.fleet is not None:
        return push_weights_sglang(workers, version, bucket_mb, verify)
    started = time.perf_counter()
    refs = workers.actor.weight_bucket_refs(bucket_mb)
    sizes = ray.get([w.receive_bucket.remote(r) for w in workers.rollout for r in refs])
    versions = ray.get([w.commit_weights.remote(version) for w in workers.rollout])
    elapsed = time.perf_counter() - started
    nbytes = sum(sizes) / max(len(workers.rollout), 1)
    out = {"perf/weight_sync_s": elapsed, "perf/weight_sync_mb": nbytes / 2**20,
           "perf/weight_sync_buckets": len(refs), "rollout/weight_version": min(v["weight_version"] for v in versions)}
    if verify:
        trainer = {k: v for r in refs for k, v in ray.get(r).items()}
        diffs = [max(float((engine[k] - t).abs().max()) for k, t in trainer.items())
                 for engine in ray.get([w.engine_weights.remote() for w in workers.rollout])]
        out["perf/weight_sync_max_abs_diff"] = max(diffs)
    return out


def push_weights_sglang(workers: Workers, version: int, bucket_mb: int, verify: bool = False,
                        new_group: bool = False, urls: list[str] | None = None) -> dict:
    """The actor's weights to the fleet's servers (`urls`: a subset, e.g. the restarted ones; default all)."""
    fleet = workers.fleet
    cfg = fleet.cfg
    urls = list(fleet.urls if urls is None else urls)
    tp = int(cfg.args.get("tp", cfg.args.get("tp-size", cfg.args.get("tp_size", 1))) or 1)
    def sync(mode: str, fresh_group: bool) -> dict:
        return workers.actor.sync_sglang(urls, version, mode, bucket_mb, cfg.pause_mode, workers.weight_sync_dir,
                                         [tp] * len(urls), fresh_group)

    with fleet.sync_lock:
        started = time.perf_counter()
        try:
            stats = sync(cfg.weight_sync, new_group)
        except Exception as e:
            # Helps when the transport fails cleanly (a server that refuses or errors); a broadcast stuck
            # inside a server would hold that server's update lock, and the health monitor has to act.
            fallback = cfg.weight_sync_fallback
            if not fallback or fallback == cfg.weight_sync:
                raise
            log.error("weight sync (%s) failed; %s from now on. The error: %s", cfg.weight_sync, fallback, e)
            cfg.weight_sync = fallback
            fleet.sync_fallbacks += 1
            stats = sync(fallback, True)
            stats["seconds"] = time.perf_counter() - started  # the failed attempt counts too
    ray.get([w.set_weight_version.remote(version) for w in workers.rollout])
    workers.weight_version = version
    out = {"perf/weight_sync_s": stats["seconds"], "perf/weight_sync_mb": stats.get("bytes", 0) / 2**20,
           "perf/weight_sync_buckets": stats.get("buckets", 0), "rollout/weight_version": version,
           "rollout/server_restarts": fleet.restarts, "perf/weight_sync_fallbacks": fleet.sync_fallbacks}
    if verify:
        out["perf/weight_sync_max_abs_diff"] = verify_sglang_weights(workers)
    return out


def verify_sglang_weights(workers: Workers, names_per_server: int = 4, rows: int = 4) -> float:
    """The first rows of a few parameters, read back from every server (`/get_weights_by_name`) and compared
    with the trainer's. Servers fuse some parameters (q/k/v); names they do not answer for are skipped."""
    import asyncio

    import torch

    from rollout.sglang.client import SGLangClient, SGLangError

    shapes = workers.actor.parameter_shapes()
    served_dtype = workers.served_dtype
    names = [n for n, shape in shapes.items() if len(shape) <= 2]
    picks = [names[int(i * (len(names) - 1) / max(names_per_server - 1, 1))] for i in range(names_per_server)]
    state = workers.actor.gathered_state(picks)  # only the compared parameters are gathered

    async def read(url: str) -> float:
        client, worst, compared = SGLangClient(url), 0.0, 0
        try:
            for name in picks:
                try:
                    got = torch.tensor(await client.get_weights_by_name(name, rows), dtype=torch.float32)
                except SGLangError:
                    continue
                want = state[name][:rows].to(served_dtype).float()  # the server keeps its own dtype
                if got.shape == want.shape:
                    worst, compared = max(worst, float((got - want).abs().max())), compared + 1
        finally:
            await client.close()
        if not compared:  # nothing to compare is not a reason to lose the run: say so, report NaN
            log.error("verify_weight_sync: %s answered for none of %s", url, picks)
            return float("nan")
        return worst

    async def all_servers():
        return await asyncio.gather(*(read(u) for u in workers.fleet.urls))

    answered = [d for d in asyncio.run(all_servers()) if not math.isnan(d)]
    return max(answered) if answered else float("nan")


def engine_metrics(workers: Workers) -> dict:
    """Request, retry and prefix-cache counters of the SGLang engines, or the LocalEngines' speculative decoding
    counters (summed over rollout workers)."""
    per_worker = ray.get([w.engine_metrics.remote() for w in workers.rollout])
    out: dict = {}
    for m in per_worker:
        for k, v in m.items():
            out[k] = max(out.get(k, 0.0), v) if k.endswith("_s") else out.get(k, 0) + v
    if per_worker and "engine/prefix_cache_hit" in out:
        out["engine/prefix_cache_hit"] = sum(m["engine/prefix_cache_hit"] for m in per_worker) / len(per_worker)
    if out.get("engine/speculative_rounds"):  # tokens a row gets per verify forward: its kept drafts + one
        out["engine/accept_length"] = 1 + out["engine/speculative_accepted"] / out["engine/speculative_rounds"]
    if workers.fleet is not None:
        out["rollout/server_restarts"] = workers.fleet.restarts
    return out


def guard_metrics(workers: Workers) -> dict:
    """Rates weighted by each worker's calls; latency percentiles as the worst worker's (an upper bound)."""
    per_worker = ray.get([w.guard_metrics.remote() for w in workers.rollout])
    calls = sum(m["guard/calls"] for m in per_worker) or 1
    out = {"guard/calls": sum(m["guard/calls"] for m in per_worker),
           "guard/judge_failures": sum(m["guard/judge_failures"] for m in per_worker)}
    for key in ("guard/flag_rate", "guard/block_rate", "guard/judge_rate"):
        out[key] = sum(m[key] * m["guard/calls"] for m in per_worker) / calls
    for key in per_worker[0]:
        if key.endswith("_ms"):
            out[key] = max(m[key] for m in per_worker)
    return out
