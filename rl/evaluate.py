"""`python -m rl.evaluate`: pass@1, mean reward and episode length of a policy on a task dataset.

    python -m rl.evaluate --model smollm2-135m-instruct                       # the base policy, held-out split
    python -m rl.evaluate --model outputs/coding_ppo/checkpoints/step_000004  # a training checkpoint
    python -m rl.evaluate --model DIR --tasks humaneval.jsonl --split all --out results.json
    python -m rl.evaluate --model DIR --samples 8 -- engine.eval_temperature=0.7  # pass@1 over 8 samples a task

Episodes run exactly as in training (same agent loop, guard, sandbox and grading), with the experiment's
sampling settings (greedy by default, `engine.eval_temperature`). Extra Hydra overrides go after `--`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path

from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from environments import load_tasks
from models import resolve_model_path
from rl.config import Config, register_configs
from rl.trajectory_metrics import trajectory_metrics
from rollout.sglang.fleet import SGLangFleet
from rollout.worker import RolloutWorker

CONFIG_DIR = str(Path(__file__).resolve().parent.parent / "configs")


def resolve_checkpoint(model: str) -> str:
    """A training checkpoint folder (or its actor/) means its HF-format actor."""
    path = Path(model)
    for candidate in (path / "actor" / "hf", path / "hf"):
        if (candidate / "config.json").exists():
            return str(candidate)
    return str(resolve_model_path(model))


def load_config(experiment: str, overrides: list[str]) -> Config:
    register_configs()
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base=None):
        dcfg = compose(config_name="config", overrides=[f"+experiment={experiment}", *overrides])
    return OmegaConf.to_object(dcfg)


async def run(worker: RolloutWorker, tasks, seeds: list[int], concurrency: int):
    gate = asyncio.Semaphore(concurrency)

    async def one(task, seed):
        async with gate:
            return await worker.run_episode(task, "eval", seed)

    try:
        return await asyncio.gather(*[one(t, s) for t, s in zip(tasks, seeds)])
    finally:
        await worker.shutdown()


def evaluate(model: str, cfg: Config, tasks_source: str, split: str | None, max_tasks: int = 0,
             seed: int = 0, samples: int = 1, episode_log: str = "", extra_tasks: str = "") -> dict:
    """`samples` episodes per task (sampled at engine.eval_temperature, which must then be > 0): pass@1 is
    the mean over all of them, `eval/tasks_solved` the share of tasks solved at least once. `episode_log`: a
    JSONL file for every logging.episode_log_every-th episode, decoded (rollout.worker.RolloutWorker).
    `extra_tasks`: another task set (the transfer check, e.g. humaneval), every record once, on the same engine
    (one server start), its metrics under `extra_metrics` (`eval_extra/`)."""
    task_set = load_tasks(tasks_source)
    tasks = task_set.split(split)
    if max_tasks:
        tasks = tasks[:max_tasks]
    if not tasks:
        raise SystemExit(f"no tasks in {tasks_source} (split {split!r})")
    if samples > 1 and cfg.engine.eval_temperature <= 0:
        raise SystemExit(f"--samples {samples} needs engine.eval_temperature > 0 (greedy samples are identical): "
                         "add `-- engine.eval_temperature=0.7`")
    tasks = [t for t in tasks for _ in range(samples)]
    extra = load_tasks(extra_tasks).tasks if extra_tasks else []
    model_path = resolve_checkpoint(model)
    fleet = None
    if cfg.engine.type == "sglang":  # servers of this model (or the ones named in engine.sglang.urls)
        # server logs in a folder of this evaluation's own: a shared /tmp/sglang-0.log would mix the logs of
        # jobs running side by side (and the start-up retry reads its own server's log)
        fleet = SGLangFleet(cfg.engine.server_config(), model_path,
                            log_dir=tempfile.mkdtemp(prefix="rl-evaluate-sglang-"), use_ray=False)
        fleet.start()
    try:
        worker = RolloutWorker(model_path, cfg.engine, cfg.agent, cfg.guard, cfg.model.chat_format,
                               cfg.model.tool_format, cfg.env.sandbox, dict(vars(cfg.env.limits)), cfg.env.reward,
                               cfg.env.grade_timeout_s, sglang_endpoint=fleet.endpoint() if fleet else None,
                               episode_log=episode_log, episode_log_every=cfg.logging.episode_log_every)
        started = time.perf_counter()
        seeds = [seed + i for i in range(len(tasks))] + [seed + j for j in range(len(extra))]
        trajs = asyncio.run(run(worker, tasks + extra, seeds, cfg.engine.max_concurrent_episodes))
    finally:
        if fleet is not None:
            fleet.stop()
    trajs, extra_trajs = trajs[:len(tasks)], trajs[len(tasks):]
    metrics = trajectory_metrics(trajs, "eval")
    metrics["eval/seconds"] = time.perf_counter() - started
    out = {"extra_metrics": trajectory_metrics(extra_trajs, "eval_extra")} if extra else {}
    return {"model": model, "tasks": tasks_source, "split": split, "skipped_records": task_set.skipped,
            "metrics": metrics, **out,
            "per_task": [{"task": t.task_id, "reward": t.reward, "passed": t.passed, "turns": t.num_turns,
                          "tokens": t.num_tokens, "finish": t.finish_reason} for t in trajs]}


def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    overrides = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(prog="python -m rl.evaluate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="built-in name, HF folder or training checkpoint")
    p.add_argument("--tasks", default=None, help="task dataset (default: the experiment's env.tasks)")
    p.add_argument("--split", default=None, help="split to evaluate; 'all' for every record "
                                                 "(default: the experiment's env.eval_split)")
    p.add_argument("--experiment", default="coding_ppo", help="experiment whose agent/sampling settings to use")
    p.add_argument("--max-tasks", type=int, default=0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--samples", type=int, default=1, help="episodes per task (needs engine.eval_temperature > 0)")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    p.add_argument("--episode-log", default="", help="JSONL of decoded episodes (every logging.episode_log_every-th)")
    args = p.parse_args(argv)
    cfg = load_config(args.experiment, overrides)
    result = evaluate(args.model, cfg, args.tasks or cfg.env.tasks, args.split or cfg.env.eval_split,
                      args.max_tasks, args.seed, args.samples, args.episode_log)
    m = result["metrics"]
    print(f"{args.model}: pass@1 {m['eval/pass_rate']:.3f}  mean reward {m['eval/reward_mean']:.3f}  "
          f"turns {m['eval/turns_mean']:.2f}  tokens {m['eval/episode_tokens_mean']:.0f}  "
          f"solved {m['eval/tasks_solved']:.3f}  ({m['eval/episodes']} episodes, {m['eval/seconds']:.0f} s)")
    for row in result["per_task"]:
        print(f"  {row['task']:<40} reward {row['reward']:.2f}  {row['finish']}")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
