"""The asynchronous loop against the synchronous one: the same run with trainer.max_staleness = K for each K.

    python bench/async_loop.py --experiment coding_ppo --steps 5 --ks 0 1 2 [--out F.json] [-- hydra overrides]

Each K is a fresh `python -m rl.train` with the same config and seed (evaluation off but for the final one,
checkpoints only at the end). Per K, over the steps between the first and the last (the first warms up, the last
evaluates and checkpoints): seconds a step, steps and episodes an hour, the trainer's idle time (waiting for a
batch) and the engines' idle fraction, the batch's staleness, episodes dropped or aborted as too stale, and
partial rollouts, and the weight sync's seconds and GB/s; ratios against K = 0 measured in the same invocation.
With `algorithm.reference_every = N` (the GPU recipes: 4) choose --steps so that the measured steps hold their
share of reference passes (steps 1, N+1, ... run one): --steps 6 measures steps 2-5, one of them with the pass.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def run_one(experiment: str, k: int, steps: int, out_dir: Path, overrides: list[str], timeout: float) -> dict:
    name = f"async_k{k}"
    cmd = [sys.executable, "-m", "rl.train", f"+experiment={experiment}", f"trainer.max_staleness={k}",
           f"trainer.steps={steps}", "trainer.eval_at_start=false", "trainer.eval_every=0", "trainer.save_every=0",
           f"output_dir={out_dir}", f"run_name={name}", "logging.wandb_mode=disabled", "logging.plot=false",
           *overrides]
    started = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    wall = time.perf_counter() - started
    if proc.returncode != 0:
        raise RuntimeError(f"K={k} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    from rl.run_log import read_metrics

    records = [r for r in read_metrics(out_dir / name / "metrics.jsonl") if r["step"] > 0]
    middle = records[1:-1] or records
    mean = lambda key: statistics.fmean(r.get(key, 0.0) for r in middle)  # noqa: E731
    step_s = mean("perf/step_s")
    episodes = statistics.fmean(r["rollout/episodes"] for r in middle)
    return {"k": k, "wall_s": wall, "steps_measured": len(middle), "step_s": step_s, "steps_per_hour": 3600 / step_s,
            "episodes_per_hour": 3600 * episodes / step_s, "trainer_idle_s": mean("async/trainer_idle_s"),
            "trainer_idle_frac": mean("async/trainer_idle_s") / step_s,
            "engine_idle_frac": mean("async/engine_idle_frac"), "staleness_mean": mean("async/staleness_mean"),
            "staleness_max": max(r.get("async/staleness_max", 0) for r in records),
            "dropped_stale": sum(r.get("async/dropped_stale", 0) for r in records),
            "aborted_stale": sum(r.get("async/aborted_stale", 0) for r in records),
            "partial_rollouts": sum(r.get("engine/partial_rollouts", 0) for r in records),
            "train_s": mean("perf/train_s"), "reward_mean": mean("rollout/reward_mean"),
            "weight_sync_s": mean("perf/weight_sync_s"),
            "weight_sync_gb_per_s": mean("perf/weight_sync_mb") * 2**20 / 1e9 / max(mean("perf/weight_sync_s"), 1e-9),
            "weight_sync_max_abs_diff": max((r.get("perf/weight_sync_max_abs_diff") for r in records
                                             if r.get("perf/weight_sync_max_abs_diff") is not None), default=None),
            "weight_sync_fallbacks": max(r.get("perf/weight_sync_fallbacks", 0) for r in records),
            "final_eval_pass": records[-1].get("eval/pass_rate")}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--experiment", default="coding_ppo")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--ks", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--out", default="")
    p.add_argument("--run-dir", default="/tmp/async-bench")
    p.add_argument("--timeout", type=float, default=3600)
    p.add_argument("overrides", nargs="*")
    args = p.parse_args()
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    rows = []
    for k in args.ks:
        rows.append(run_one(args.experiment, k, args.steps, Path(args.run_dir), args.overrides, args.timeout))
        print(json.dumps(rows[-1]), flush=True)
        write(args, rows)  # after every K: a run cut short keeps the Ks it finished
    base = next((r for r in rows if r["k"] == 0), rows[0])
    print(f"\n{'K':>2} {'s/step':>7} {'steps/h':>8} {'× K=0':>6} {'trainer idle':>12} {'engine idle':>11} "
          f"{'staleness':>9} {'dropped+aborted':>15} {'partial':>7} {'sync s':>6} {'sync GB/s':>9}")
    for r in rows:
        r["speedup_vs_k0"] = r["steps_per_hour"] / base["steps_per_hour"]
        print(f"{r['k']:>2} {r['step_s']:>7.1f} {r['steps_per_hour']:>8.0f} {r['speedup_vs_k0']:>6.2f} "
              f"{r['trainer_idle_frac']:>12.2f} {r['engine_idle_frac']:>11.2f} {r['staleness_mean']:>9.2f} "
              f"{r['dropped_stale'] + r['aborted_stale']:>15} {r['partial_rollouts']:>7} {r['weight_sync_s']:>6.2f} "
              f"{r['weight_sync_gb_per_s']:>9.2f}")
    write(args, rows)


def write(args, rows: list[dict]) -> None:
    if args.out:
        Path(args.out).write_text(json.dumps({"experiment": args.experiment, "steps": args.steps,
                                              "overrides": args.overrides, "date": time.strftime("%Y-%m-%d"),
                                              "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
