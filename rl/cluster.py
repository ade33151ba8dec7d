"""The Ray side of a run: start Ray, place the workers, dispatch episodes, move weights.

Layout (DESIGN.md §5): N rollout workers (each an engine replica running many episodes concurrently), one
actor worker and one critic worker (each its own DeepSpeed world). On the embedded default everything is a
process on this machine; every placement comes from the config.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

import ray
from tqdm import tqdm

from critic.worker import CriticWorker
from environments import Task
from models.training import OptimConfig
from rl.actor import ActorWorker
from rl.config import Config
from rollout.types import Trajectory
from rollout.worker import RolloutWorker


@dataclass
class Workers:
    actor: ray.actor.ActorHandle
    critic: ray.actor.ActorHandle
    rollout: list[ray.actor.ActorHandle]


def start_ray(cfg: Config) -> None:
    if ray.is_initialized():
        return
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    if cfg.trainer.ray_address:
        ray.init(address=cfg.trainer.ray_address, log_to_driver=True)
    else:
        import torch

        ray.init(num_cpus=os.cpu_count(), num_gpus=torch.cuda.device_count(), include_dashboard=False,
                 log_to_driver=True, configure_logging=False)


def spawn(cfg: Config, policy: str, critic: str) -> Workers:
    t = cfg.trainer
    threads = t.torch_threads or 0
    common = dict(weight_decay=t.weight_decay, grad_clip=t.grad_clip, zero_stage=t.zero_stage,
                  micro_batch_tokens=t.micro_batch_tokens, gradient_checkpointing=t.gradient_checkpointing)
    actor = ray.remote(num_cpus=0, num_gpus=t.actor_gpus)(ActorWorker).remote(
        policy, OptimConfig(learning_rate=t.learning_rate, **common), cfg.algorithm,
        temperature=cfg.engine.temperature, dtype=cfg.model.dtype, seed=cfg.seed, torch_threads=threads)
    critic_worker = ray.remote(num_cpus=0, num_gpus=t.critic_gpus)(CriticWorker).remote(
        critic, OptimConfig(learning_rate=t.critic_learning_rate, **common), cfg.algorithm.value_clip or None,
        dtype=cfg.model.dtype, seed=cfg.seed + 1, torch_threads=threads)
    limits = dict(vars(cfg.env.limits))
    rollout = [ray.remote(num_cpus=0, num_gpus=cfg.engine.gpus_per_worker,
                          max_concurrency=cfg.engine.max_concurrent_episodes + 8)(RolloutWorker).remote(
        policy, cfg.engine, cfg.agent, cfg.guard, chat_format=cfg.model.chat_format, tool_format=cfg.model.tool_format,
        sandbox_backend=cfg.env.sandbox, sandbox_limits=limits, reward=cfg.env.reward,
        grade_timeout_s=cfg.env.grade_timeout_s, worker_index=i) for i in range(cfg.engine.num_workers)]
    ray.get([actor.__ray_ready__.remote(), critic_worker.__ray_ready__.remote()]
            + [w.__ray_ready__.remote() for w in rollout])
    return Workers(actor, critic_worker, rollout)


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
    """Actor → every engine, bucket by bucket through Ray's object store; applied atomically per engine."""
    started = time.perf_counter()
    refs = ray.get(workers.actor.weight_bucket_refs.remote(bucket_mb))
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
