"""`python -m opd.distill +experiment=opd_merge`: merge expert checkpoints into one student by parallel
on-policy distillation (docs/ALGORITHMS.md §3).

One step: the student runs agent episodes on the task mixture; each finished trajectory goes at once to the
teacher that owns its domain, which scores the student's tokens (prefill only) while other episodes still run
→ d̂ = log μ − log π_T per action token → the advantage −λ·clip(d̂) (added to critic-PPO advantages in
`opd.mode=ppo_opd`) → one PPO-clip update of the student → its weights to the engines. Per-domain reverse KL,
per-domain pass rates of the student (and, once, of each teacher), checkpoints and `resume=true` as in rl.train;
the merged student is saved in HF format at the end (`<run>/student`).

The episodes run on rl.train's rollout manager (rl/rollout_manager.py): `trainer.max_staleness = K > 0` keeps
them running while the student trains, and a trajectory is sent to its teacher the moment it finishes, so
scoring never waits for the step; K = 0 is the synchronous loop (same tasks, seeds and placement as before).
"""

from __future__ import annotations

import json
import logging
import time

import hydra
import ray
from omegaconf import DictConfig, OmegaConf

from environments import load_tasks
from models import resolve_model_path
from opd.advantages import opd_advantages
from opd.config import DistillConfig, register_opd_configs, validate_opd
from opd.teacher import TeacherWorker, check_same_tokenizer
from rl.actor import needs_logprob_pass, needs_old_logprobs, reference_due
from rl.batch import add_advantages, mark_staleness, to_samples, trainable
from rl.checkpoint import Checkpointer
from rl.cluster import Workers, guard_metrics, rollout_worker_kwargs, run_episodes, start_ray, start_workers
from rl.config import validate
from rl.data import TaskSampler
from rl.rollout_manager import RolloutManager
from rl.run_log import MetricsLogger, plot_curves
from rl.trajectory_metrics import trajectory_metrics
from rl.loop import (TimeLimit, Timer, check_sandbox, checkpoint_state, driver_threads, prepare_run_dir,
                     write_audit)
from rollout.config import chooses_cuda_graphs

log = logging.getLogger("opd.distill")


def sglang_settings(sglang) -> dict:
    """What an `sglang` teacher's server needs of the run's engine.sglang (plain types, for Ray). A teacher only
    scores (prefill-only requests, `max_new_tokens` 0), which never decode, so its server captures no decode CUDA
    graph (SGLang 0.5.17 would capture 36; capture is most of a start-up: docs/SGLANG.md), unless the args choose
    the graphs. (Not `--cuda-graph-max-bs 1`: where SGLang aligns batch sizes to more than 1, that leaves no size.)"""
    args = dict(sglang.args)
    if not chooses_cuda_graphs(args):
        args["disable-decode-cuda-graph"] = True
    return {"launch_command": list(sglang.launch_command), "args": args, "env": dict(sglang.env),
            "host": sglang.host, "startup_timeout_s": sglang.startup_timeout_s,
            "request_timeout_s": sglang.request_timeout_s, "memory_retries": sglang.memory_retries}


def spawn_teachers(cfg: DistillConfig, log_dir: str | None = None) -> dict[str, ray.actor.ActorHandle]:
    """One Ray worker per teacher, all loading at once."""
    handles = {}
    for t in cfg.opd.teachers:
        handles[t.name] = ray.remote(num_cpus=0, num_gpus=t.gpus, max_restarts=cfg.opd.teacher_restarts,
                                     max_task_retries=0)(TeacherWorker).remote(
            t.name, t.path, t.engine, temperature=cfg.engine.temperature, dtype=cfg.model.dtype,
            micro_batch_tokens=cfg.trainer.micro_batch_tokens, torch_threads=cfg.trainer.torch_threads,
            sglang=sglang_settings(cfg.engine.sglang), log_dir=log_dir)
    ray.get([h.__ray_ready__.remote() for h in handles.values()])
    return handles


def score_when_ready(teachers: dict, owner: dict):
    """The rollout manager's `on_ready` for OPD: a finished trajectory's trainable samples go to the teacher of
    its domain at once, on the manager's thread, so scoring overlaps the episodes still running (and, with
    trainer.max_staleness > 0, the trainer's step). Returns (teacher, samples, the score's ref), or None."""
    def submit(traj):
        kept, _ = trainable([traj])
        if not kept:
            return None
        samples = to_samples(kept)
        for s in samples:
            s["domain"] = traj.domain
        name = owner[traj.domain].name
        return name, samples, teachers[name].score.remote(samples)
    return submit


def take_scores(teachers: dict, jobs: list) -> tuple[list, float, dict]:
    """The batch's teacher scores (`jobs`: what score_when_ready returned for each trajectory, in batch order):
    (scored [(trajectory index, samples with teacher_logprobs)], seconds waited for them, fault counters)."""
    waiting = time.perf_counter()
    pending = [(i, *job) for i, job in enumerate(jobs) if job is not None]
    scores, rescored = collect_scores(teachers, pending)
    scored = []
    for i, _name, samples, _ref in pending:
        if i in scores:  # lost: left out, counted
            for s, lps in zip(samples, scores[i]):
                s["teacher_logprobs"] = lps
            scored.append((i, samples))
    return scored, time.perf_counter() - waiting, {"opd/teacher_rescored": rescored,
                                                    "opd/unscored_dropped": len(pending) - len(scored)}


def collect_scores(teachers: dict, jobs: list[tuple[int, str, list[dict], ray.ObjectRef]],
                   attempts: int = 10, first_wait_s: float = 0.5) -> tuple[dict[int, list], int]:
    """Each job's teacher scores (job key → one tensor per sample). A teacher worker that died takes its queued
    and running calls with it; Ray restarts it (`opd.teacher_restarts`) and the lost calls are asked again of the
    restarted worker, waiting for it with exponential back-off (0.5 s doubling, ~8.5 min over 10 attempts: an
    SGLang teacher restarts its server). A result that came back is never asked for again (none twice). A job
    still without one after its attempts is left out of the batch (logged, counted), and so is every later job
    of that teacher, without waiting again. Returns (scores, how many jobs were scored by a re-request)."""
    lost = (ray.exceptions.RayActorError, getattr(ray.exceptions, "ActorUnavailableError", ray.exceptions.RayActorError))
    out, rescored, gone = {}, 0, set()
    for key, name, samples, ref in jobs:
        asked_again = False
        for attempt in range(attempts if name not in gone else 0):
            try:
                out[key] = ray.get(ref)
                rescored += asked_again
                break
            except lost as exc:
                if attempt == attempts - 1:
                    log.error("teacher %s: trajectory %s left unscored after %d attempts (%s); the teacher's later "
                              "trajectories are left out too", name, key, attempts, type(exc).__name__)
                    gone.add(name)
                    break
                log.warning("teacher %s is down (%s); asking it again for trajectory %s", name,
                            type(exc).__name__, key)
                time.sleep(first_wait_s * 2 ** attempt)
                ref, asked_again = teachers[name].score.remote(samples), True
    return out, rescored


def per_domain(trajs, prefix: str) -> dict:
    out = {}
    for d in sorted({t.domain for t in trajs}):
        out.update(trajectory_metrics([t for t in trajs if t.domain == d], f"{prefix}/{d}"))
    return out


def distill_step(cfg: DistillConfig, workers: Workers, teachers: dict, rollouts: RolloutManager, step: int,
                 audit) -> dict:
    timer = Timer()
    trajs, async_metrics = rollouts.next_batch()
    scored, waited, faults = take_scores(teachers, rollouts.take_attached(trajs))
    stats = ray.get([t.stats.remote() for t in teachers.values()])  # (a restarted teacher counts from its restart)
    busy = sum(s["busy_s"] for s in stats)
    scored_tokens = sum(s["tokens"] for s in stats)
    metrics = {**trajectory_metrics(trajs, "rollout"), **per_domain(trajs, "rollout"), **guard_metrics(workers),
               "perf/rollout_s": timer.lap(), "perf/teacher_scoring_s": busy, "perf/teacher_wait_s": waited,
               "perf/teacher_tokens_per_s": scored_tokens / busy if busy > 0 else 0.0,
               # the share of teacher scoring hidden behind the rollout (goal ≥ 0.8)
               "perf/teacher_overlap": 1.0 - min(waited / busy, 1.0) if busy > 0 else 1.0,
               **faults, **async_metrics}
    write_audit(audit, step + 1, trajs)
    if not scored:
        log.warning("step %d: no trainable trajectory; no update", step + 1)
        return metrics
    kept = [trajs[i] for i, _ in scored]
    samples = []
    for k, (_, traj_samples) in enumerate(scored):
        for s in traj_samples:
            s["traj"] = k
            samples.append(s)
    mark_staleness(samples, workers.weight_version)
    a = cfg.algorithm
    if needs_logprob_pass(a, step):  # π_old (several optimiser steps, a KL in the reward) and π_ref, as in rl.train
        for key, values in workers.actor.compute_logprobs(samples, needs_old_logprobs(a),
                                                          reference_due(a, step)).result().items():
            for s, v in zip(samples, values):
                s[key] = v
    critic_update = None
    if cfg.opd.mode == "ppo_opd":
        for s, v in zip(samples, workers.critic.compute_values(samples).result()):
            s["values"] = v
        metrics.update(add_advantages(samples, kept, a))
        critic_update = workers.critic.train_step(samples, a.mini_batches, a.ppo_epochs, cfg.seed + step)
    metrics.update(opd_advantages(samples, cfg.opd.kl_coef, cfg.opd.kl_clip, add_to_existing=cfg.opd.mode == "ppo_opd"))
    metrics["perf/opd_s"] = timer.lap()
    metrics.update(workers.actor.train_step(samples, cfg.seed + step).result())
    metrics.update(workers.sync.push(step + 1))
    rollouts.set_version(workers.weight_version)  # episodes starting from now on are on the new weights
    if critic_update is not None:
        metrics.update(critic_update.result())
    metrics["perf/train_s"] = timer.lap()
    return metrics


def eval_episodes(cfg: DistillConfig, tasks) -> list:
    """Each held-out task `trainer.eval_samples` times (sampled at engine.eval_temperature when more than once):
    pass@1 is the mean over them."""
    return [t for t in tasks for _ in range(cfg.trainer.eval_samples)]


def evaluate_student(cfg: DistillConfig, workers: Workers, tasks, step: int) -> dict:
    started = time.perf_counter()
    trajs = run_episodes(workers, eval_episodes(cfg, tasks), "eval", 10_000 + step, "eval")
    return {**trajectory_metrics(trajs, "eval"), **per_domain(trajs, "eval"),
            "perf/eval_s": time.perf_counter() - started}


def evaluate_teachers(cfg: DistillConfig, tasks) -> dict:
    """Each teacher as the policy of a rollout worker, on the held-out tasks of every domain (its own domains
    are the target the student should approach)."""
    from rollout.worker import RolloutWorker

    out = {}
    for t in cfg.opd.teachers:
        worker = ray.remote(num_cpus=0, num_gpus=t.gpus, max_concurrency=cfg.engine.worker_max_calls)(
            RolloutWorker).remote(str(resolve_model_path(t.path)), cfg.engine.__class__(**{
                **vars(cfg.engine), "type": "local", "speculative_steps": 0}), **rollout_worker_kwargs(cfg))
        trajs = ray.get([worker.run_episode.remote(task, "eval", 10_000 + i)
                         for i, task in enumerate(eval_episodes(cfg, tasks))])
        for key, value in per_domain(trajs, f"teacher/{t.name}/eval").items():
            out[key] = value
        ray.get(worker.shutdown.remote())
        ray.kill(worker)
    return out


def distill(cfg: DistillConfig) -> dict:
    validate(cfg)
    task_set = load_tasks(cfg.env.tasks)
    train_tasks, eval_tasks = task_set.split(cfg.env.train_split), task_set.split(cfg.env.eval_split)
    if cfg.trainer.eval_max_tasks:  # every domain keeps held-out tasks: take them in turn
        eval_tasks = round_robin_by_domain(eval_tasks)[:cfg.trainer.eval_max_tasks]
    owner = validate_opd(cfg, {t.domain for t in train_tasks + eval_tasks})
    student = str(resolve_model_path(cfg.model.name))
    check_same_tokenizer(student, {t.name: str(resolve_model_path(t.path)) for t in cfg.opd.teachers})
    check_sandbox(cfg.env.sandbox)
    run_dir = prepare_run_dir(cfg)
    checkpoints = Checkpointer(run_dir, cfg.trainer.keep_checkpoints)
    resume_from = checkpoints.latest() if cfg.resume else None
    sampler = TaskSampler(train_tasks, cfg.seed)
    log.info("OPD %s: student %s, teachers %s, %d train / %d held-out tasks", run_dir, student,
             {t.name: t.domains for t in cfg.opd.teachers}, len(train_tasks), len(eval_tasks))

    started = time.perf_counter()
    start_ray(cfg)
    critic = str(resolve_model_path(cfg.model.critic or cfg.model.name)) if cfg.opd.mode == "ppo_opd" else None
    workers = start_workers(cfg, student, critic, str(run_dir))
    teachers = spawn_teachers(cfg, str(run_dir / "sglang"))
    start, state = 0, None
    if resume_from is not None:
        state = Checkpointer.load_state(resume_from)
        workers.actor.load(str(resume_from / "actor"))
        if workers.critic is not None:
            workers.critic.load(str(resume_from / "critic"))
        start = state["step"]
        workers.sync.push(state.get("weight_version", start))
        log.info("resumed from %s at step %d", resume_from, start)
    t = cfg.trainer
    rollouts = RolloutManager(workers.rollout, sampler, t.episodes_per_step, t.max_staleness,
                              cfg.engine.max_concurrent_episodes, cfg.seed, start_step=start,
                              version=workers.weight_version, on_restart=workers.sync.refresh,
                              on_ready=score_when_ready(teachers, owner))
    if state is not None:  # a checkpoint from before the manager holds only the sampler: nothing pending
        rollouts.load_state_dict(state.get("rollout", state), train_tasks)
    logger = MetricsLogger(run_dir, cfg.logging.wandb_mode, cfg.logging.project, cfg.run_name,
                           OmegaConf.to_container(OmegaConf.structured(cfg)), resume_step=start,
                           resume_record=(state or {}).get("metrics"))
    final: dict = {}
    clock = TimeLimit(cfg.trainer, started)
    with open(run_dir / "guard_audit.jsonl", "a") as audit:
        if start == 0 and eval_tasks:
            first = evaluate_student(cfg, workers, eval_tasks, 0)
            clock.saw_evaluation(first["perf/eval_s"])
            if cfg.opd.eval_teachers:
                first.update(evaluate_teachers(cfg, eval_tasks))
            logger.log(0, first)
            final.update(first)
            log.info("step 0 | %s", domain_line(first, cfg))
        rollouts.start()
        for step in range(start, cfg.trainer.steps):
            timer = Timer()
            last = clock.is_last(step)
            metrics = distill_step(cfg, workers, teachers, rollouts, step, audit)
            if eval_tasks and (last or (cfg.trainer.eval_every and (step + 1) % cfg.trainer.eval_every == 0)):
                if last:  # nothing else runs during the final evaluation
                    rollouts.stop()
                metrics.update(evaluate_student(cfg, workers, eval_tasks, step + 1))
                clock.saw_evaluation(metrics["perf/eval_s"])
            out_of_time = clock.stops_after(step, timer.total(), last)
            if last or out_of_time or (cfg.trainer.save_every and (step + 1) % cfg.trainer.save_every == 0):
                timer.lap()
                checkpoints.save(step + 1, workers.actor.save,
                                 workers.critic.save if workers.critic is not None else None,
                                 checkpoint_state(step + 1, cfg, workers, rollouts, metrics))
                metrics["perf/checkpoint_s"] = timer.lap()
            rollouts.step_done(workers.weight_version)
            metrics["perf/step_s"] = timer.total()
            logger.log(step + 1, metrics)
            final.update(metrics)
            log.info("step %d | reverse KL %.3f | %s | %.0fs", step + 1, metrics.get("opd/reverse_kl", 0.0),
                     domain_line(metrics, cfg), metrics["perf/step_s"])
            if clock.ended_early(step, last, out_of_time, final):
                break
    rollouts.stop()
    workers.actor.save_hf(str(run_dir / "student"), student)
    logger.close()
    if cfg.logging.plot:
        domains = sorted(owner)
        plot_curves(run_dir / "metrics.jsonl", run_dir / "curves.png", curves=[
            ("opd/reverse_kl", *[f"opd/reverse_kl/{d}" for d in domains]),
            tuple(f"eval/{d}/pass_rate" for d in domains), ("rollout/reward_mean", "eval/reward_mean"),
            ("actor/entropy",), ("opd/clipped_frac", "actor/clipfrac"), ("perf/teacher_overlap",),
            ("perf/step_s", "perf/rollout_s", "perf/train_s")])
    (run_dir / "summary.json").write_text(json.dumps(final, indent=1, default=str))
    ray.get([t.shutdown.remote() for t in teachers.values()])
    workers.stop()
    ray.shutdown()
    return final


def round_robin_by_domain(tasks):
    by_domain: dict[str, list] = {}
    for t in tasks:
        by_domain.setdefault(t.domain, []).append(t)
    out, queues = [], [list(v) for _, v in sorted(by_domain.items())]
    while any(queues):
        for q in queues:
            if q:
                out.append(q.pop(0))
    return out


def domain_line(m: dict, cfg: DistillConfig) -> str:
    parts = []
    for t in cfg.opd.teachers:
        for d in t.domains:
            bits = [f"{d}:"]
            if f"opd/reverse_kl/{d}" in m:
                bits.append(f"KL {m[f'opd/reverse_kl/{d}']:.3f}")
            if f"eval/{d}/pass_rate" in m:
                bits.append(f"student {m[f'eval/{d}/pass_rate']:.2f}")
            if f"teacher/{t.name}/eval/{d}/pass_rate" in m:
                bits.append(f"teacher {m[f'teacher/{t.name}/eval/{d}/pass_rate']:.2f}")
            parts.append(" ".join(bits))
    return " | ".join(parts)


register_opd_configs()


@hydra.main(config_path="../configs", config_name="opd", version_base=None)
def main(dcfg: DictConfig) -> None:
    cfg = OmegaConf.to_object(dcfg)
    with driver_threads(cfg.trainer.driver_torch_threads):
        distill(cfg)


if __name__ == "__main__":
    main()
