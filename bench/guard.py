"""The guard's cost against the sandbox call it protects.

    python bench/guard.py [--corpus FILE ...] [--passes 5] [--repeat 20] [--no-sandbox]

Stage-1 (rule) latency of every corpus call, the history of its row replayed first as in an episode:

- first pass: a fresh process and fresh caches, as for calls never seen before (includes one-time costs such as
  compiling the static regexes at their first use);
- cold passes: `--passes` more passes, each after clearing the parse caches (shell, Python AST, each task's path
  matchers); the figure per call is its median over the passes, which a busy machine disturbs much less;
- warm: the same calls again with the caches hot (an agent repeats many calls).

Then the wall time of real sandbox calls of the kind the guard sits in front of (a trivial command, a file write
and a one-test pytest run in a bubblewrap sandbox, and a plain subprocess for scale), and the guard's cost as a
share of each. Also how the shell commands were read: our reader, or the bashlex fallback.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import time
from pathlib import Path

from antihack import pyast, shell, types
from antihack.evaluate import DEFAULT_CORPUS, load_corpus, run
from antihack.guard import Guard

HELDOUT = str(Path(DEFAULT_CORPUS).with_name("heldout_corpus.jsonl"))


def pct(values, q):
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def summary(values) -> str:
    return (f"p50 {pct(values, .5):.2f} ms, p90 {pct(values, .9):.2f} ms, p99 {pct(values, .99):.2f} ms, "
            f"max {max(values):.2f} ms")


def clear_caches() -> None:
    shell._parse_cached.cache_clear()
    pyast._inspect_cached.cache_clear()
    if hasattr(types, "_matcher"):  # (absent before the per-glob matchers)
        types._matcher.cache_clear()


def sandbox_times(repeat: int) -> dict[str, float]:
    from environments import make_sandbox

    times: dict[str, float] = {}
    plain = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        subprocess.run(["true"], check=True)
        plain.append(1000 * (time.perf_counter() - t0))
    times["plain subprocess: true"] = statistics.median(plain)
    with make_sandbox("bwrap") as box:
        box.write_file("tests/test_a.py", "def test_a():\n    assert 1 + 1 == 2\n")
        calls = [("bwrap bash: true", lambda: box.exec("true")),
                 ("bwrap write_file", lambda: box.write_file("x.py", "x = 1\n")),
                 ("bwrap pytest, 1 test", lambda: box.exec(["python", "-m", "pytest", "-q", "tests/test_a.py"]))]
        for name, fn in calls:
            measured = []
            for _ in range(repeat):
                t0 = time.perf_counter()
                fn()
                measured.append(1000 * (time.perf_counter() - t0))
            times[name] = statistics.median(measured)
    return times


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--corpus", action="append", help="corpus file (repeatable; default: both shipped corpora)")
    p.add_argument("--passes", type=int, default=5, help="cold passes after the first (median per call)")
    p.add_argument("--repeat", type=int, default=20, help="sandbox calls of each kind")
    p.add_argument("--no-sandbox", action="store_true")
    args = p.parse_args()
    rows = [row for path in (args.corpus or [DEFAULT_CORPUS, HELDOUT]) for row in load_corpus(path)[0]]

    first = [r["rules_ms"] for r in asyncio.run(run(Guard(), rows))]
    reads = dict(getattr(shell, "READER_STATS", {"reader": 0, "bashlex": 0, "tokens": 0}))
    per_call = [[] for _ in rows]
    for _ in range(args.passes):
        clear_caches()
        for i, r in enumerate(asyncio.run(run(Guard(), rows))):
            per_call[i].append(r["rules_ms"])
    cold = [statistics.median(v) for v in per_call] if args.passes else first
    warm = [r["rules_ms"] for r in asyncio.run(run(Guard(), rows))]

    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"guard stage 1 on {len(rows)} corpus calls ({os.cpu_count()} CPUs, load {load:.1f}):")
    print(f"  first pass (cold)            {summary(first)}")
    if args.passes:
        print(f"  cold, median of {args.passes} passes    {summary(cold)}")
    print(f"  warm (repeated calls)        {summary(warm)}")
    full = reads["reader"] + reads["bashlex"] + reads["tokens"]
    print(f"shell commands needing a full parse in the first pass: {full}; read by our reader {reads['reader']}, "
          f"bashlex fallback {reads['bashlex']}, token fallback {reads['tokens']}")
    if args.no_sandbox:
        return
    for name, ms in sandbox_times(args.repeat).items():
        print(f"{name:<24} median {ms:8.2f} ms   guard cold p50 / call = {pct(cold, .5) / ms:7.1%}, "
              f"p99 / call = {pct(cold, .99) / ms:7.1%}")


if __name__ == "__main__":
    main()
