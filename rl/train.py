"""`python -m rl.train +experiment=coding_ppo`: critic PPO on coding tasks, end to end.

One step: a batch of finished episodes from the rollout manager → π_old / π_ref logprobs → critic values →
chained GAE → critic update → actor update → weights to every engine. With `trainer.max_staleness=0` nothing runs
while the trainer trains (the synchronous loop); with K > 0 the engines keep generating through the step, their
in-flight episodes continue on the new weights, and the batch's tokens lag the trained policy by ≤ K versions
(rl/rollout_manager.py). Metrics go to metrics.jsonl and wandb, checkpoints every `trainer.save_every` steps,
`resume=true` continues from the last one.
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
from rl.actor import needs_logprob_pass, needs_old_logprobs, reference_due
from rl.batch import add_advantages, boundary_value_drop, mark_staleness, replay_metrics, to_samples, trainable
from rl.checkpoint import Checkpointer
from rl.cluster import Workers, engine_metrics, guard_metrics, run_episodes, start_ray, start_workers
from rl.config import Config, overlaps_models, register_configs, validate
from rl.data import TaskSampler
from rl.group import TrainerRankDied
from rl.loop import (BackgroundEval, TimeLimit, Timer, check_sandbox, checkpoint_state, driver_threads,
                     prepare_run_dir, write_audit)
from rl.run_log import MetricsLogger, plot_curves
from rl.rollout_manager import RolloutManager
from rl.trajectory_metrics import trajectory_metrics

log = logging.getLogger("rl.train")
EVAL_SLOTS = 4  # a background evaluation's episodes at a time per rollout worker (cluster.start_workers leaves 8 spare)


def train_step(cfg: Config, workers: Workers, rollouts: RolloutManager, step: int, audit) -> dict:
    timer = Timer()
    trajs, metrics = rollouts.next_batch()
    metrics.update({**trajectory_metrics(trajs, "rollout"), **guard_metrics(workers), **engine_metrics(workers),
                    "perf/rollout_s": timer.lap()})
    metrics["async/engine_idle_frac"] = 1.0 - metrics.pop("engine/busy_frac", 1.0)
    write_audit(audit, step + 1, trajs)
    kept, dropped = trainable(trajs)
    metrics.update({f"rollout/dropped_{k}": v for k, v in dropped.items()})
    if not kept:
        log.warning("step %d: no trainable trajectory (%s); no update", step + 1, dict(dropped))
        return metrics
    samples = to_samples(kept)
    metrics.update(replay_metrics(samples))
    mark_staleness(samples, workers.weight_version)
    if cfg.trainer.max_staleness == 0:  # the rollout is the wait; asynchronously it overlaps the previous step
        metrics["perf/rollout_tokens_per_s"] = sum(t.num_action_tokens for t in trajs) / metrics["perf/rollout_s"]
    a = cfg.algorithm
    # The actor's and the critic's groups work at the same time (trainer.overlap_models), or one after the other
    start = (lambda pending: pending) if overlaps_models(cfg.trainer) else (lambda pending: pending.wait())
    logprobs = (start(workers.actor.compute_logprobs(samples, needs_old_logprobs(a), reference_due(a, step)))
                if needs_logprob_pass(a, step) else None)
    values = start(workers.critic.compute_values(samples))
    if logprobs is not None:
        for key, per_sample in logprobs.result().items():
            for s, v in zip(samples, per_sample):
                s[key] = v
    metrics["perf/logprobs_s"] = timer.lap()
    for s, v in zip(samples, values.result()):
        s["values"] = v
    metrics["perf/values_s"] = timer.lap()  # overlapped: what the value pass took beyond the logprob pass
    metrics.update(add_advantages(samples, kept, cfg.algorithm))
    drop = boundary_value_drop(samples)
    if drop is not None:
        metrics["critic/boundary_value_drop"] = drop
    metrics["perf/gae_s"] = timer.lap()
    critic_update = start(workers.critic.train_step(samples, a.mini_batches, a.ppo_epochs, cfg.seed + step))
    if step >= a.critic_warmup_steps:
        metrics.update(workers.actor.train_step(samples, cfg.seed + step).result())
        metrics.update(workers.sync.push(step + 1))
        rollouts.set_version(workers.weight_version)  # episodes starting from now on are on the new weights
    metrics.update(critic_update.result())
    metrics["perf/train_s"] = timer.lap()
    metrics["perf/train_tokens"] = sum(len(s["token_ids"]) for s in samples)
    return metrics


def evaluate(workers: Workers, tasks, step: int, samples: int = 1, prefix: str = "eval", per_worker: int = 0) -> dict:
    """`samples` episodes per task at the evaluation temperature: pass@1 is their mean (one greedy episode per
    task when samples = 1). `per_worker`: at most that many at a time on a worker (0: all at once)."""
    started = time.perf_counter()
    trajs = run_episodes(workers, [t for t in tasks for _ in range(samples)], "eval", 10_000 + step, prefix, per_worker)
    return {**trajectory_metrics(trajs, prefix), f"perf/{prefix}_s": time.perf_counter() - started}


def evaluate_all(cfg: Config, workers: Workers, eval_tasks, extra_tasks, step: int, with_extra: bool,
                 per_worker: int = 0) -> dict:
    """The held-out split (trainer.eval_samples a task) and, at the first and last step, env.extra_eval_tasks."""
    m = evaluate(workers, eval_tasks, step, cfg.trainer.eval_samples, per_worker=per_worker) if eval_tasks else {}
    if with_extra and extra_tasks:
        m.update(evaluate(workers, extra_tasks, step, 1, "eval_extra"))
    m["perf/eval_s"] = m.get("perf/eval_s", 0.0) + m.get("perf/eval_extra_s", 0.0)
    return m


def model_sources(cfg: Config, resume_from) -> tuple[str, str, str]:
    """The folders the policy, the critic and the reference load from: model.name (model.critic), or, resuming
    from a checkpoint without its optimizer state (trainer.resume_weights_only), that checkpoint's HF weights for
    the two trained models while the reference stays model.name."""
    policy = str(resolve_model_path(cfg.model.name))
    critic = str(resolve_model_path(cfg.model.critic or cfg.model.name))
    if resume_from is None or Checkpointer.has_optimizer_state(resume_from):
        return policy, critic, policy
    missing = [str(resume_from / m / "hf") for m in ("actor", "critic") if not (resume_from / m / "hf").is_dir()]
    if missing:
        raise ValueError(f"checkpoint {resume_from} has no optimizer state and no HF weights in {missing}: "
                         "nothing to resume from")
    if not cfg.trainer.resume_weights_only:
        raise ValueError(f"checkpoint {resume_from} has no optimizer state (actor/state): resuming from its HF "
                         "weights restarts Adam's moments, so the run would not continue exactly; pass "
                         "trainer.resume_weights_only=true to accept that")
    return str(resume_from / "actor" / "hf"), str(resume_from / "critic" / "hf"), policy


def train(cfg: Config) -> dict:
    validate(cfg)
    check_sandbox(cfg.env.sandbox)
    run_dir = prepare_run_dir(cfg)
    checkpoints = Checkpointer(run_dir, cfg.trainer.keep_checkpoints)
    resume_from = checkpoints.latest() if cfg.resume else None
    task_set = load_tasks(cfg.env.tasks)
    train_tasks, eval_tasks = task_set.split(cfg.env.train_split), task_set.split(cfg.env.eval_split)
    if cfg.trainer.eval_max_tasks:
        eval_tasks = eval_tasks[:cfg.trainer.eval_max_tasks]
    extra_tasks = load_tasks(cfg.env.extra_eval_tasks).tasks if cfg.env.extra_eval_tasks else []
    sampler = TaskSampler(train_tasks, cfg.seed)
    t = cfg.trainer
    policy, critic, reference = model_sources(cfg, resume_from)
    log.info("run %s: %d train / %d held-out tasks, policy %s", run_dir, len(train_tasks), len(eval_tasks), policy)

    started = time.perf_counter()
    start_ray(cfg)
    workers = start_workers(cfg, policy, critic, str(run_dir), reference=reference)
    if workers.fleet is not None:  # a dead server is restarted and gets the current weights again
        workers.fleet.start_monitor(lambda urls: workers.sync.push(workers.weight_version, urls=urls, fresh=True))
    start, state = 0, None
    if resume_from is not None:
        state = Checkpointer.load_state(resume_from)
        if Checkpointer.has_optimizer_state(resume_from):
            workers.actor.load(str(resume_from / "actor"))
            workers.critic.load(str(resume_from / "critic"))
        else:  # weights only: the workers loaded them (model_sources)
            log.warning("resuming from %s without its optimizer state: Adam's moments start at zero", resume_from)
        start = state["step"]
        workers.sync.push(state.get("weight_version", start))
        log.info("resumed from %s at step %d", resume_from, start)
    rollouts = RolloutManager(workers.rollout, sampler, t.episodes_per_step, t.max_staleness,
                              cfg.engine.max_concurrent_episodes, cfg.seed, start_step=start,
                              version=workers.weight_version,
                              on_restart=workers.sync.refresh)
    if state is not None:
        rollouts.load_state_dict(state.get("rollout", state), train_tasks)
    logger = MetricsLogger(run_dir, cfg.logging.wandb_mode, cfg.logging.project, cfg.run_name,
                           OmegaConf.to_container(OmegaConf.structured(cfg)), resume_step=start,
                           resume_record=(state or {}).get("metrics"))
    final: dict = {}
    clock = TimeLimit(cfg.trainer, started)
    background = BackgroundEval()
    with open(run_dir / "guard_audit.jsonl", "a") as audit:
        if t.eval_at_start and start == 0 and (eval_tasks or extra_tasks):
            final = evaluate_all(cfg, workers, eval_tasks, extra_tasks, 0, with_extra=True)
            clock.saw_evaluation(final["perf/eval_s"])
            logger.log(0, final)
            log.info(step_line(0, final))
        rollouts.start()
        for step in range(start, t.steps):
            timer = Timer()
            last = clock.is_last(step)
            metrics = train_step(cfg, workers, rollouts, step, audit)
            metrics.update(background.results())
            if (eval_tasks or extra_tasks) and (last or (t.eval_every and (step + 1) % t.eval_every == 0)):
                if last or t.max_staleness == 0:  # the synchronous loop (and the final evaluation) wait for it
                    if last:  # nothing else runs during the final evaluation (a background one is awaited)
                        rollouts.stop()
                        metrics.update(background.results(wait=True))
                    metrics.update(evaluate_all(cfg, workers, eval_tasks, extra_tasks, step + 1, with_extra=last))
                    clock.saw_evaluation(metrics["perf/eval_s"])
                else:  # beside training: logged with the step it finishes in, under the version it started on
                    background.start(lambda s=step: evaluate_all(cfg, workers, eval_tasks, extra_tasks, s + 1, False,
                                                                 per_worker=EVAL_SLOTS), workers.weight_version)
            out_of_time = clock.stops_after(step, timer.total(), last)
            if last or out_of_time or (t.save_every and (step + 1) % t.save_every == 0):
                timer.lap()
                checkpoints.save(step + 1, workers.actor.save, workers.critic.save,
                                 checkpoint_state(step + 1, cfg, workers, rollouts, metrics))
                metrics["perf/checkpoint_s"] = timer.lap()
            rollouts.step_done(workers.weight_version)
            metrics["perf/step_s"] = timer.total()
            logger.log(step + 1, metrics)
            final.update(metrics)
            log.info(step_line(step + 1, metrics))
            if clock.ended_early(step, last, out_of_time, final):
                break
    rollouts.stop()
    final.update(background.results(wait=True))  # an evaluation still running when the loop ended
    logger.close()
    workers.stop()
    if cfg.logging.plot:
        plot_curves(run_dir / "metrics.jsonl", run_dir / "curves.png")
    (run_dir / "summary.json").write_text(json.dumps(final, indent=1, default=str))
    ray.shutdown()
    return final


def step_line(step: int, m: dict) -> str:
    parts = [f"step {step}"]
    if "rollout/reward_mean" in m:
        parts += [f"reward {m['rollout/reward_mean']:.3f}", f"pass {m.get('rollout/pass_rate', 0):.2f}",
                  f"blocks {m.get('rollout/guard_blocks', 0)}", f"compactions {m.get('rollout/compactions', 0)}"]
    if "eval/pass_rate" in m:
        parts.append(f"held-out pass@1 {m['eval/pass_rate']:.3f} reward {m['eval/reward_mean']:.3f}")
    if "eval_extra/pass_rate" in m:
        parts.append(f"extra pass@1 {m['eval_extra/pass_rate']:.3f}")
    if "perf/step_s" in m:
        parts.append(f"{m['perf/step_s']:.0f}s")
    return " | ".join(parts)


register_configs()


@hydra.main(config_path="../configs", config_name="config", version_base=None)
def main(dcfg: DictConfig) -> None:
    cfg = OmegaConf.to_object(dcfg)
    try:
        with driver_threads(cfg.trainer.driver_torch_threads):
            train(cfg)
    except TrainerRankDied as exc:  # the message says how to go on; the traceback adds nothing
        log.error("%s", exc)
        raise SystemExit(1) from None


if __name__ == "__main__":
    main()
