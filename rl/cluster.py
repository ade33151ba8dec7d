"""The Ray side of a run: start Ray, place the workers, dispatch episodes (weights move in rl/weight_sync.py).

Layout (docs/DESIGN.md §5): N rollout workers (each an engine replica running many episodes concurrently), the
actor's and the critic's trainer groups (rl/group.py: each a DeepSpeed world of trainer.*_ranks Ray actors). On the embedded default everything is a
process on this machine; every placement comes from the config.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import ray
from tqdm import tqdm

from critic.worker import CriticWorker
from environments import Task
from models.deepspeed_worker import OptimConfig
from rl.actor import ActorWorker
from rl.config import AlgorithmConfig, Config
from rl.group import TrainerGroup
from rl.weight_sync import WeightSync, make_weight_sync
from rollout.sglang.fleet import SGLangFleet
from rollout.types import Trajectory
from rollout.worker import RolloutWorker

log = logging.getLogger(__name__)


@dataclass
class Workers:
    actor: TrainerGroup
    critic: TrainerGroup | None
    rollout: list[ray.actor.ActorHandle]
    fleet: SGLangFleet | None = None  # engine.type=sglang: the servers the rollout workers talk to
    sync: WeightSync | None = None  # the actor's weights to the engines (rl/weight_sync.py)
    weight_version: int = 0  # what the engines serve

    def stop(self) -> None:
        """At the run's end: the engines stop (first: their health monitor must not push weights to trainer ranks
        that are leaving), then the trainer ranks leave their process groups together."""
        try:
            if self.fleet is not None:
                self.fleet.stop()
        finally:
            for group in (self.actor, self.critic):
                if group is not None:
                    group.shutdown()


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


def _optim(t) -> dict:
    """The optimiser and parallelism settings the actor and the critic share (trainer.*)."""
    return dict(weight_decay=t.weight_decay, grad_clip=t.grad_clip, zero_stage=t.zero_stage,
                micro_batch_tokens=t.micro_batch_tokens, gradient_checkpointing=t.gradient_checkpointing,
                pack_micro_batches=t.pack_micro_batches, offload_optimizer=t.offload_optimizer,
                offload_params=t.offload_params, sequence_parallel=t.sequence_parallel, tf32=t.tf32,
                bf16_autocast=t.bf16_autocast)


def actor_group(cfg: Config, policy: str, learning_rate: float | None = None,
                algorithm: AlgorithmConfig | None = None, reference: str | None = None) -> TrainerGroup:
    """The policy's trainer group (trainer.actor_ranks DeepSpeed ranks on a placement group); rl.sft makes one
    with its own learning rate and no reference. `reference`: where π_ref loads from (default: `policy`)."""
    t = cfg.trainer
    optim = OptimConfig(learning_rate=t.learning_rate if learning_rate is None else learning_rate,
                        expert_parallel=t.expert_parallel, **_optim(t))
    return TrainerGroup(ActorWorker, t.actor_ranks, t.actor_gpus, "actor", policy, optim,
                        cfg.algorithm if algorithm is None else algorithm, temperature=cfg.engine.temperature,
                        dtype=cfg.model.dtype, seed=cfg.seed, torch_threads=t.torch_threads or 0,
                        sequence_parallel=t.sequence_parallel, model_overrides=dict(cfg.model.trainer_overrides),
                        reference_path=reference)


def start_workers(cfg: Config, policy: str, critic: str | None, run_dir: str = "",
                  reference: str | None = None) -> Workers:
    t = cfg.trainer
    fleet = None
    if cfg.engine.type == "sglang":  # first: the servers take minutes to load, and their GPUs come first
        fleet = SGLangFleet(cfg.engine.server_config(), policy, log_dir=f"{run_dir}/sglang" if run_dir else None)
        fleet.start()
    actor = actor_group(cfg, policy, reference=reference)
    critic_worker = None
    if critic is not None:  # pure on-policy distillation trains no critic
        critic_worker = TrainerGroup(CriticWorker, t.critic_ranks, t.critic_gpus, "critic",
                                     critic, OptimConfig(learning_rate=t.critic_learning_rate,
                                                         head_learning_rate=t.critic_head_learning_rate,
                                                         expert_parallel=t.critic_expert_parallel, **_optim(t)),
                                     cfg.algorithm.value_clip or None, dtype=cfg.model.dtype, seed=cfg.seed + 1,
                                     torch_threads=t.torch_threads or 0, sequence_parallel=t.sequence_parallel)
    rollout = [ray.remote(num_cpus=0, num_gpus=cfg.engine.gpus_per_worker,
                          max_concurrency=cfg.engine.worker_max_calls,
                          max_restarts=cfg.engine.max_worker_restarts, max_task_retries=0)(RolloutWorker).remote(
        policy, cfg.engine, **rollout_worker_kwargs(cfg), worker_index=i,
        sglang_endpoint=fleet.endpoint() if fleet else None,
        episode_log=f"{run_dir}/episodes/worker{i}.jsonl" if run_dir else "",
        episode_log_every=cfg.logging.episode_log_every)
        for i in range(cfg.engine.num_workers)]
    ray.get([h.__ray_ready__.remote() for h in rollout])
    for group in (actor, critic_worker):
        if group is not None:
            for p in group.placement_info():
                log.info("%s rank %d/%d on %s, GPUs %s (%s)", group.role, p["rank"], p["world_size"], p["node"],
                         p["gpus"] or "none", p["device"])
    workers = Workers(actor, critic_worker, rollout, fleet)
    workers.sync = make_weight_sync(cfg, workers, run_dir)
    return workers


def rollout_worker_kwargs(cfg: Config) -> dict:
    """What every RolloutWorker of a run shares besides its model and engine config: the agent, the guard, the
    chat and tool formats, the sandbox and the grading."""
    return {"agent": cfg.agent, "guard": cfg.guard, "chat_format": cfg.model.chat_format,
            "tool_format": cfg.model.tool_format, "sandbox_backend": cfg.env.sandbox,
            "sandbox_limits": dict(vars(cfg.env.limits)), "reward": cfg.env.reward,
            "grade_timeout_s": cfg.env.grade_timeout_s}


def run_episodes(workers: Workers, tasks: list[Task], mode: str, seed: int, desc: str,
                 per_worker: int = 0) -> list[Trajectory]:
    """Every task once, spread round-robin over the rollout workers; results in task order. `per_worker` > 0:
    at most that many in flight on a worker at a time, so that an evaluation beside the asynchronous loop leaves
    the worker's other call slots to the loop's episodes and to the weight sync (calls beyond a Ray actor's
    max_concurrency wait in line, control calls included)."""
    n = len(workers.rollout)
    results: list[Trajectory | None] = [None] * len(tasks)
    index, load, pending, next_task = {}, [0] * n, [], 0
    with tqdm(total=len(tasks), desc=desc, unit="ep", leave=False) as bar:
        while next_task < len(tasks) or pending:
            while next_task < len(tasks) and not (per_worker and load[next_task % n] >= per_worker):
                worker = next_task % n
                ref = workers.rollout[worker].run_episode.remote(tasks[next_task], mode, seed * 1_000_003 + next_task)
                index[ref], load[worker] = (next_task, worker), load[worker] + 1
                pending.append(ref)
                next_task += 1
            done, pending = ray.wait(pending, num_returns=1)
            i, worker = index.pop(done[0])
            try:
                results[i] = ray.get(done[0])
            except Exception as exc:  # a worker that died (or came back without weights): counted, not fatal
                log.error("%s: episode %d on rollout worker %d failed: %s", desc, i, worker, exc)
                results[i] = Trajectory(f"{desc}-{i}", tasks[i].id, [], finish_reason="error", domain=tasks[i].domain,
                                        grade_details={"error": f"rollout worker {worker}: {exc}"})
            load[worker] -= 1
            bar.update(1)
    return results  # type: ignore[return-value]


def answers(rollout: list, method: str) -> list:
    """`method` on every rollout worker; the answers of those that are up (one restarting is left out)."""
    refs = [getattr(w, method).remote() for w in rollout]
    out = []
    for i, ref in enumerate(refs):
        try:
            out.append(ray.get(ref))
        except ray.exceptions.RayActorError as exc:
            log.warning("rollout worker %d did not answer %s: %s", i, method, exc)
    return out


def engine_metrics(workers: Workers) -> dict:
    """Request, retry and prefix-cache counters of the SGLang engines, or the LocalEngines' speculative decoding
    counters (summed over rollout workers)."""
    per_worker = answers(workers.rollout, "engine_metrics")
    out: dict = {}
    for m in per_worker:
        for k, v in m.items():
            out[k] = max(out.get(k, 0.0), v) if k.endswith("_s") else out.get(k, 0) + v
    for key in ("engine/prefix_cache_hit", "engine/busy_frac"):  # means over the workers
        if per_worker and key in out:
            out[key] = sum(m[key] for m in per_worker) / len(per_worker)
    if out.get("engine/speculative_rounds"):  # tokens a row gets per verify forward: its kept drafts + one
        out["engine/accept_length"] = 1 + out["engine/speculative_accepted"] / out["engine/speculative_rounds"]
    if workers.fleet is not None:
        out["rollout/server_restarts"] = workers.fleet.restarts
    return out


def guard_metrics(workers: Workers) -> dict:
    """Rates weighted by each worker's calls; latency percentiles as the worst worker's (an upper bound)."""
    per_worker = answers(workers.rollout, "guard_metrics")
    if not per_worker:
        return {}
    calls = sum(m["guard/calls"] for m in per_worker) or 1
    out = {"guard/calls": sum(m["guard/calls"] for m in per_worker),
           "guard/judge_failures": sum(m["guard/judge_failures"] for m in per_worker)}
    for key in ("guard/flag_rate", "guard/block_rate", "guard/judge_rate"):
        out[key] = sum(m[key] * m["guard/calls"] for m in per_worker) / calls
    for key in per_worker[0]:
        if key.endswith("_ms"):
            out[key] = max(m[key] for m in per_worker)
    return out
