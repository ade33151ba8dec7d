"""The driver's own torch work at 1 thread against a thread per core, on an idle or a busy host.

    python bench/driver_threads.py [--episodes 64] [--busy 2] [--repeats 20]

The work is a step's advantages (`rl.batch.add_advantages`: thousands of ops on small tensors, what `perf/gae_s`
times in a run) for `--episodes` episodes of 900-2,000 tokens. `--busy N` keeps N processes spinning beside it,
as the engine, the sandboxes and the trainer workers keep a GPU machine's cores busy during a step. Prints the
median seconds at each thread count and the ratio against the host's default count (every core), measured in
the same run. Why trainer.driver_torch_threads defaults to 1.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import random
import statistics
import time
from types import SimpleNamespace

import torch

from rl.batch import add_advantages
from rl.config import AlgorithmConfig


def _spin() -> None:
    while True:
        pass


def batch(episodes: int, seed: int = 0):
    rng = random.Random(seed)
    samples, trajectories = [], []
    for i in range(episodes):
        n = rng.randint(900, 2000)
        mask = torch.zeros(n)
        mask[200:] = 1
        mask[500:700] = 0  # a tool's output inside the episode: not an action
        samples.append({"traj": i, "segment_index": 0, "token_ids": torch.zeros(n, dtype=torch.long),
                        "loss_mask": mask, "values": torch.randn(n)})
        trajectories.append(SimpleNamespace(reward=rng.random()))
    return samples, trajectories


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--episodes", type=int, default=64)
    p.add_argument("--busy", type=int, default=0, help="processes spinning beside the timed work")
    p.add_argument("--repeats", type=int, default=20)
    args = p.parse_args()
    samples, trajectories = batch(args.episodes)
    algo = AlgorithmConfig()
    spinners = [mp.Process(target=_spin, daemon=True) for _ in range(args.busy)]
    for s in spinners:
        s.start()
    every_core = torch.get_num_threads()
    counts = sorted({1, every_core})
    times = {}
    try:
        for threads in counts * 2:  # twice through, the first pass warms up
            torch.set_num_threads(threads)
            runs = []
            for _ in range(args.repeats):
                started = time.perf_counter()
                add_advantages(samples, trajectories, algo)
                runs.append(time.perf_counter() - started)
            times[threads] = statistics.median(runs)
    finally:
        for s in spinners:
            s.terminate()
    print(f"{os.cpu_count()} cores, {args.busy} busy processes beside, {args.episodes} episodes' advantages "
          f"(median of {args.repeats}):")
    for threads in counts:
        print(f"  {threads:>3} torch threads: {times[threads] * 1000:7.1f} ms  "
              f"({times[every_core] / times[threads]:.2f}x the default of {every_core})")


if __name__ == "__main__":
    main()
