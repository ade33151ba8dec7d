"""`python -m rl.train +experiment=coding_ppo`: critic PPO on coding tasks, end to end.

One step: rollout (agent episodes on the engines) → π_old / π_ref logprobs → critic values → chained GAE →
critic update → actor update → weights to every engine. Metrics go to metrics.jsonl and wandb, checkpoints
every `trainer.save_every` steps, `resume=true` continues from the last one.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import hydra
import ray
from omegaconf import DictConfig, OmegaConf

from environments import load_tasks, make_sandbox
from models import resolve_model_path
from rl.actor import needs_logprob_pass
from rl.batch import add_advantages, boundary_value_drop, to_samples, trainable
from rl.checkpoint import Checkpointer
from rl.cluster import (Workers, engine_metrics, guard_metrics, push_weights, push_weights_sglang, run_episodes,
                        spawn, start_ray)
from rl.config import Config, register_configs, validate
from rl.data import TaskSampler
from rl.metrics import MetricsLogger, plot_curves
from rl.stats import trajectory_metrics

log = logging.getLogger("rl.train")


def train_step(cfg: Config, w: Workers, sampler: TaskSampler, step: int, audit) -> dict:
    timer = Timer()
    trajs = run_episodes(w, sampler.next(cfg.trainer.episodes_per_step), "train", cfg.seed + step, f"step {step + 1}")
    metrics = {**trajectory_metrics(trajs, "rollout"), **guard_metrics(w), **engine_metrics(w),
               "perf/rollout_s": timer.lap()}
    write_audit(audit, step + 1, trajs)
    kept, dropped = trainable(trajs)
    metrics.update({f"rollout/dropped_{k}": v for k, v in dropped.items()})
    if not kept:
        log.warning("step %d: no trainable trajectory (%s); no update", step + 1, dict(dropped))
        return metrics
    samples = to_samples(kept)
    metrics["perf/rollout_tokens_per_s"] = sum(t.num_action_tokens for t in trajs) / metrics["perf/rollout_s"]
    if needs_logprob_pass(cfg.algorithm):
        for key, values in w.actor.compute_logprobs(samples).items():
            for s, v in zip(samples, values):
                s[key] = v
    metrics["perf/logprobs_s"] = timer.lap()
    for s, v in zip(samples, w.critic.compute_values(samples)):
        s["values"] = v
    metrics["perf/values_s"] = timer.lap()
    metrics.update(add_advantages(samples, kept, cfg.algorithm))
    drop = boundary_value_drop(samples)
    if drop is not None:
        metrics["critic/boundary_value_drop"] = drop
    metrics["perf/gae_s"] = timer.lap()
    a = cfg.algorithm
    metrics.update(w.critic.train_step(samples, a.mini_batches, a.ppo_epochs, cfg.seed + step))
    if step >= cfg.algorithm.critic_warmup_steps:
        metrics.update(w.actor.train_step(samples, cfg.seed + step))
        metrics.update(push_weights(w, step + 1, cfg.trainer.weight_sync_bucket_mb, cfg.trainer.verify_weight_sync))
    metrics["perf/train_s"] = timer.lap()
    metrics["perf/train_tokens"] = sum(len(s["token_ids"]) for s in samples)
    return metrics


def evaluate(w: Workers, tasks, step: int, samples: int = 1, prefix: str = "eval") -> dict:
    """`samples` episodes per task at the evaluation temperature: pass@1 is their mean (one greedy episode per
    task when samples = 1)."""
    started = time.perf_counter()
    trajs = run_episodes(w, [t for t in tasks for _ in range(samples)], "eval", 10_000 + step, prefix)
    return {**trajectory_metrics(trajs, prefix), f"perf/{prefix}_s": time.perf_counter() - started}


def evaluate_all(cfg: Config, w: Workers, eval_tasks, extra_tasks, step: int, with_extra: bool) -> dict:
    """The held-out split (trainer.eval_samples a task) and, at the first and last step, env.extra_eval_tasks."""
    m = evaluate(w, eval_tasks, step, cfg.trainer.eval_samples) if eval_tasks else {}
    if with_extra and extra_tasks:
        m.update(evaluate(w, extra_tasks, step, 1, "eval_extra"))
    m["perf/eval_s"] = m.get("perf/eval_s", 0.0) + m.get("perf/eval_extra_s", 0.0)
    return m


def runs_out(limit: float, elapsed: float, step_s: float, eval_s: float, steps_ahead: int = 1) -> bool:
    """Whether `steps_ahead` more steps of `step_s` and then an evaluation of `eval_s` would end past `limit`
    seconds (0: no limit)."""
    return bool(limit) and elapsed + steps_ahead * step_s + eval_s > limit


class TimeLimit:
    """`trainer.time_limit_s` in a driver loop (rl.train, opd.distill), measured from `started`.

    time_limit_action=stop: after a step, checkpoint and stop when one more step like it (plus the final
    evaluation, if the next step is the last) would end past the limit: a job slot, a preemptible node;
    `resume=true` goes on. time_limit_action=finish: before a step, make it the last one (final evaluation
    included) when it and one more would not leave room for the final evaluation: the run ends complete.
    """

    def __init__(self, trainer, started: float):
        self.limit, self.steps, self.started = trainer.time_limit_s, trainer.steps, started
        self.finish = trainer.time_limit_action == "finish"
        self.step_s = 0.0  # the last step's duration: the estimate of the next one's
        self.eval_s = 0.0  # the longest evaluation so far (the first includes the extra set, as the final does)

    def elapsed(self) -> float:
        return time.perf_counter() - self.started

    def saw_evaluation(self, seconds: float) -> None:
        self.eval_s = max(self.eval_s, seconds)

    def is_last(self, step: int) -> bool:
        return step + 1 == self.steps or (
            self.finish and runs_out(self.limit, self.elapsed(), self.step_s, self.eval_s, steps_ahead=2))

    def stops_after(self, step: int, step_s: float, last: bool) -> bool:
        self.step_s = step_s
        return not last and not self.finish and runs_out(
            self.limit, self.elapsed(), step_s, self.eval_s if step + 2 == self.steps else 0.0)

    def ended_early(self, step: int, last: bool, out_of_time: bool, final: dict) -> bool:
        """Logs and records (in `final`) a run that ends before trainer.steps; whether the loop should end."""
        if last and step + 1 < self.steps:
            final["finished_early_at_step"] = step + 1
            log.warning("trainer.time_limit_s=%.0f: finished at step %d of %d (final evaluation done)",
                        self.limit, step + 1, self.steps)
        elif out_of_time:
            final["stopped_early_at_step"] = step + 1
            log.warning("trainer.time_limit_s=%.0f: stopped after step %d (checkpoint saved); continue with "
                        "resume=true", self.limit, step + 1)
        return last or out_of_time


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
    policy = str(resolve_model_path(cfg.model.name))
    critic = str(resolve_model_path(cfg.model.critic or cfg.model.name))
    log.info("run %s: %d train / %d held-out tasks, policy %s", run_dir, len(train_tasks), len(eval_tasks), policy)

    started = time.perf_counter()
    start_ray(cfg)
    w = spawn(cfg, policy, critic, str(run_dir))
    if w.fleet is not None:  # a dead server is restarted and gets the current weights again
        w.fleet.start_monitor(lambda urls: push_weights_sglang(w, w.weight_version, cfg.trainer.weight_sync_bucket_mb,
                                                               new_group=True, urls=urls))
    start = 0
    if resume_from is not None:
        state = Checkpointer.load_state(resume_from)
        w.actor.load(str(resume_from / "actor"))
        w.critic.load(str(resume_from / "critic"))
        sampler.load_state_dict(state["sampler"])
        start = state["step"]
        push_weights(w, start, cfg.trainer.weight_sync_bucket_mb, cfg.trainer.verify_weight_sync)
        log.info("resumed from %s at step %d", resume_from, start)
    logger = MetricsLogger(run_dir, cfg.logging.wandb_mode, cfg.logging.project, cfg.run_name,
                           OmegaConf.to_container(OmegaConf.structured(cfg)), resume_step=start)
    final: dict = {}
    clock = TimeLimit(cfg.trainer, started)
    with open(run_dir / "guard_audit.jsonl", "a") as audit:
        if cfg.trainer.eval_at_start and start == 0 and (eval_tasks or extra_tasks):
            final = evaluate_all(cfg, w, eval_tasks, extra_tasks, 0, with_extra=True)
            clock.saw_evaluation(final["perf/eval_s"])
            logger.log(0, final)
            log.info(step_line(0, final))
        for step in range(start, cfg.trainer.steps):
            timer = Timer()
            last = clock.is_last(step)
            metrics = train_step(cfg, w, sampler, step, audit)
            if (eval_tasks or extra_tasks) and (last or (cfg.trainer.eval_every and (step + 1) % cfg.trainer.eval_every == 0)):
                metrics.update(evaluate_all(cfg, w, eval_tasks, extra_tasks, step + 1, with_extra=last))
                clock.saw_evaluation(metrics["perf/eval_s"])
            out_of_time = clock.stops_after(step, timer.total(), last)
            if last or out_of_time or (cfg.trainer.save_every and (step + 1) % cfg.trainer.save_every == 0):
                timer.lap()
                checkpoints.save(step + 1, w.actor.save,
                                 w.critic.save,
                                 {"step": step + 1, "sampler": sampler.state_dict(), "seed": cfg.seed})
                metrics["perf/checkpoint_s"] = timer.lap()
            metrics["perf/step_s"] = timer.total()
            logger.log(step + 1, metrics)
            final.update(metrics)
            log.info(step_line(step + 1, metrics))
            if clock.ended_early(step, last, out_of_time, final):
                break
    logger.close()
    if w.fleet is not None:
        w.fleet.stop()
    if cfg.logging.plot:
        plot_curves(run_dir / "metrics.jsonl", run_dir / "curves.png")
    (run_dir / "summary.json").write_text(json.dumps(final, indent=1, default=str))
    ray.shutdown()
    return final


class Timer:
    def __init__(self):
        self.start = self.mark = time.perf_counter()

    def lap(self) -> float:
        now = time.perf_counter()
        lap, self.mark = now - self.mark, now
        return lap

    def total(self) -> float:
        return time.perf_counter() - self.start


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


def write_audit(audit, step: int, trajs) -> None:
    for t in trajs:
        for event in t.guard_events:
            audit.write(json.dumps({"step": step, "task": t.task_id, "rollout_id": t.rollout_id, **event}) + "\n")
    audit.flush()


def check_sandbox(backend: str) -> None:
    """A missing sandbox, or a sandbox Python without pytest, fails the run now, not every episode."""
    with make_sandbox(backend) as box:
        result = box.exec(["python", "-m", "pytest", "--version"], timeout=60)
    if result.exit_code != 0:
        raise RuntimeError(f"the {backend} sandbox cannot run the graders' pytest: {(result.stdout + result.stderr)[-500:]}")


def prepare_run_dir(cfg: Config) -> Path:
    run_dir = Path(cfg.output_dir) / cfg.run_name
    if run_dir.exists() and not cfg.resume:  # a fresh run never overwrites an old one: move it aside
        run_dir.rename(run_dir.with_name(f"{run_dir.name}-{time.strftime('%Y%m%d-%H%M%S')}"))
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(OmegaConf.to_yaml(OmegaConf.structured(cfg)))
    return run_dir


register_configs()


@hydra.main(config_path="../configs", config_name="config", version_base=None)
def main(dcfg: DictConfig) -> None:
    train(OmegaConf.to_object(dcfg))


if __name__ == "__main__":
    main()
