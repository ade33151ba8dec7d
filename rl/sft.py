"""`python -m rl.sft +experiment=long_horizon`: a supervised cold start on reference trajectories.

A small policy rarely follows a multi-turn tool protocol on its own, so RL on long-horizon tasks starts from a
policy taught it. The reference trajectory (the tool calls a careful agent makes) of each task of `env.sft_split`
(default: RL's `env.train_split`) is played through the real agent loop with
`rollout.scripted_engine.ScriptedEngine` standing in for the policy: the run's chat template and tool format, real
sandboxed observations, the guard, the context window and compaction (with a scripted handoff note when the loop
asks for one). What comes out is exactly what RL would train on: segments of token ids with the loss mask on the
policy's own tokens (replies and summaries). An episode that does not end submitted and solved (a reply over the
turn budget, a blocked call, a window too small) is skipped and reported.

The policy (trainer.actor_ranks DeepSpeed ranks, as in rl.train) then takes `sft.epochs` passes over those
episodes, `sft.episodes_per_step` episodes per optimiser step, minimising the token-mean negative log-likelihood
of the masked tokens (`ActorWorker.sft_step`). The result is an HF folder, `<run dir>/hf`, that rl.train takes as
`model.name` (the run directory is `<output_dir>/<run_name>_sft`). With `sft.eval=true` the held-out split is
evaluated before and after (rl.evaluate's episodes: `trainer.eval_samples` a task at `engine.eval_temperature`),
and `env.extra_eval_tasks` (the transfer check, e.g. HumanEval) once a record, under `eval_extra/`. Metrics go to
metrics.jsonl, curves to curves.png.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import time
from dataclasses import dataclass, field

import hydra
import ray
from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf
from tqdm import tqdm

from environments import TOOL_SPECS, Task, ToolCall, load_tasks
from models import load_tokenizer, resolve_model_path
from rl.batch import to_samples
from rl.cluster import actor_group, start_ray
from rl.config import AlgorithmConfig, Config, validate
from rl.loop import check_sandbox, prepare_run_dir
from rl.run_log import MetricsLogger, plot_curves
from rollout.agent import AgentEpisode, EpisodeRuntime
from rollout.chat import make_chat_format
from rollout.guard import build_guard
from rollout.scripted_engine import ScriptedEngine
from rollout.tool_parsers import make_tool_parser
from rollout.types import SamplingParams, Trajectory

log = logging.getLogger("rl.sft")


@dataclass
class SFTConfig:
    epochs: int = 3
    learning_rate: float = 1e-5
    episodes_per_step: int = 8  # reference episodes per optimiser step
    eval: bool = True  # held-out pass@1 before and after (env.eval_split)
    eval_before: bool = True  # false: after only (the base policy's figures are known: a rerun saves its time)
    concurrency: int = 4  # episodes rendered at a time (each runs its sandbox)


@dataclass
class SFTRunConfig(Config):
    sft: SFTConfig = field(default_factory=SFTConfig)
    run_name: str = "sft"


def register_sft_configs() -> None:
    ConfigStore.instance().store(name="sft_schema", node=SFTRunConfig)


def render_reference_episodes(cfg: Config, tasks: list[Task], tokenizer,
                              concurrency: int = 4) -> tuple[list[Trajectory], list[tuple[str, str]]]:
    """Each task's `reference_trajectory` played through the agent loop (module docstring). Returns the solved
    episodes, and (task id, reason) for every task left out."""
    chat = make_chat_format(cfg.model.chat_format)
    parser = make_tool_parser(cfg.model.tool_format, TOOL_SPECS)
    guard = build_guard(cfg.guard, with_judge=False)
    end_ids = chat.stop_token_ids(tokenizer)[:1]

    async def one(task: Task, gate: asyncio.Semaphore) -> tuple[str, Trajectory | None, str]:
        calls = [ToolCall(c["name"], c.get("arguments", {})) for c in task.metadata.get("reference_trajectory", [])]
        if not calls:
            return task.id, None, "no reference_trajectory"
        engine = ScriptedEngine(calls, tokenizer, parser, end_ids)
        rt = EpisodeRuntime(engine, tokenizer, chat, parser, guard, cfg.agent, sandbox_backend=cfg.env.sandbox,
                            sandbox_limits=dict(vars(cfg.env.limits)), reward=cfg.env.reward,
                            grade_timeout_s=cfg.env.grade_timeout_s)
        async with gate:
            traj = await AgentEpisode(rt, task, SamplingParams(temperature=0.0, seed=cfg.seed),
                                      rollout_id=f"sft-{task.id}").run()
        if traj.finish_reason != "submitted" or not traj.passed:
            reason = traj.grade_details.get("error") or f"finished {traj.finish_reason}, reward {traj.reward:.2f}"
            if traj.num_guard_blocks:
                reason += f", {traj.num_guard_blocks} call(s) blocked by the guard"
            return task.id, None, reason
        if engine.next < len(calls):
            return task.id, None, f"submitted after {engine.next} of {len(calls)} scripted calls"
        return task.id, traj, ""

    async def all_tasks():
        gate = asyncio.Semaphore(max(1, concurrency))
        pending = [one(t, gate) for t in tasks]
        return [await f for f in tqdm(asyncio.as_completed(pending), total=len(pending), desc="render", unit="ep")]

    results = {tid: (traj, reason) for tid, traj, reason in asyncio.run(all_tasks())}
    episodes = [results[t.id][0] for t in tasks if results[t.id][0] is not None]
    skipped = [(t.id, results[t.id][1]) for t in tasks if results[t.id][0] is None]
    return episodes, skipped


def evaluate_policy(cfg: Config, model: str, episode_log: str = "") -> dict:
    from rl.evaluate import evaluate

    # env.extra_eval_tasks (the transfer check, e.g. HumanEval): every record once, as rl.train does
    result = evaluate(model, cfg, cfg.env.tasks, cfg.env.eval_split, cfg.trainer.eval_max_tasks, cfg.seed,
                      cfg.trainer.eval_samples, episode_log, cfg.env.extra_eval_tasks)
    return {**result["metrics"], **result.get("extra_metrics", {})}


def sft(cfg: SFTRunConfig) -> dict:
    validate(cfg)
    check_sandbox(cfg.env.sandbox)
    if not cfg.run_name.endswith("sft"):  # an experiment's run name: its SFT run lives beside its RL runs
        cfg.run_name = f"{cfg.run_name}_sft"
    run_dir = prepare_run_dir(cfg)
    s = cfg.sft
    policy = str(resolve_model_path(cfg.model.name))
    tokenizer = load_tokenizer(policy)
    task_set = load_tasks(cfg.env.tasks)
    split = cfg.env.sft_split or cfg.env.train_split
    tasks = task_set.split(split)
    if not tasks:
        raise SystemExit(f"env.{'sft_split' if cfg.env.sft_split else 'train_split'}={split!r}: no such split in "
                         f"{cfg.env.tasks} (its splits: {sorted({t.split for t in task_set.tasks})})")
    started = time.perf_counter()
    episodes, skipped = render_reference_episodes(cfg, tasks, tokenizer, s.concurrency)
    for task_id, reason in skipped:
        log.warning("left out %s: %s", task_id, reason)
    if not episodes:
        raise SystemExit(f"no reference episode of the {len(tasks)} tasks could be rendered (see above)")
    samples_of = [to_samples([e]) for e in episodes]
    summary = {"sft/episodes": len(episodes), "sft/skipped": len(skipped),
               "sft/segments_per_episode": sum(len(e.segments) for e in episodes) / len(episodes),
               "sft/compactions_per_episode": sum(e.num_compactions for e in episodes) / len(episodes),
               "sft/action_tokens_per_episode": sum(e.num_action_tokens for e in episodes) / len(episodes),
               "perf/render_s": time.perf_counter() - started}
    log.info("rendered %d reference episodes (%d left out): %s", len(episodes), len(skipped), summary)
    logger = MetricsLogger(run_dir, cfg.logging.wandb_mode, cfg.logging.project, cfg.run_name,
                           OmegaConf.to_container(OmegaConf.structured(cfg)))
    final = dict(summary)
    if s.eval and s.eval_before:
        before = evaluate_policy(cfg, policy, str(run_dir / "episodes" / "before.jsonl"))
        final.update({f"before/{k}": v for k, v in before.items()})
        logger.log(0, {k: v for k, v in final.items() if k.startswith("before/")})
    start_ray(cfg)
    actor = actor_group(cfg, policy, s.learning_rate, AlgorithmConfig(use_reference=False, kl_coef=0.0,
                                                                      kl_loss_coef=0.0))
    rng, step = random.Random(cfg.seed), 0
    per_epoch = -(-len(episodes) // s.episodes_per_step)
    with tqdm(total=s.epochs * per_epoch, desc="sft", unit="step") as bar:
        for epoch in range(s.epochs):
            order = list(range(len(episodes)))
            rng.shuffle(order)
            for first in range(0, len(order), s.episodes_per_step):
                batch = [x for i in order[first:first + s.episodes_per_step] for x in samples_of[i]]
                metrics = actor.sft_step(batch, 1, cfg.seed + step).result()
                step += 1
                metrics["sft/epoch"] = epoch + 1
                logger.log(step, metrics if step > 1 else {**metrics, **summary})
                final.update(metrics)
                bar.set_postfix(loss=f"{metrics['sft/loss']:.3f}")
                bar.update()
    out = run_dir / "hf"
    actor.save_hf(str(out), tokenizer_from=policy)
    actor.shutdown()
    ray.shutdown()
    if s.eval:
        after = evaluate_policy(cfg, str(out), str(run_dir / "episodes" / "after.jsonl"))
        after = {f"after/{k}": v for k, v in after.items()}
        logger.log(step + 1, after)
        final.update(after)
    logger.close()
    if cfg.logging.plot:
        plot_curves(run_dir / "metrics.jsonl", run_dir / "curves.png")
    final["sft/output"] = str(out)
    final["sft/skipped_tasks"] = [f"{t}: {r}" for t, r in skipped]
    (run_dir / "summary.json").write_text(json.dumps(final, indent=1, default=str))
    log.info("SFT done: %s (loss %.3f after %d steps)", out, final.get("sft/loss", float("nan")), step)
    if s.eval:
        log.info("held-out pass@1 %s -> %.3f, reward %s -> %.3f", final.get("before/eval/pass_rate", "(not run)"),
                 final["after/eval/pass_rate"], final.get("before/eval/reward_mean", "(not run)"),
                 final["after/eval/reward_mean"])
    return final


register_sft_configs()


@hydra.main(config_path="../configs", config_name="sft", version_base=None)
def main(dcfg: DictConfig) -> None:
    sft(OmegaConf.to_object(dcfg))


if __name__ == "__main__":
    main()
