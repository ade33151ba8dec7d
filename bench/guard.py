"""The guard's cost against the sandbox call it protects.

    python bench/guard.py [--corpus antihack/data/corpus.jsonl]

Stage-1 latency of every corpus call (history replayed first, as in an episode), against the wall time of real
sandbox calls of the kind the guard sits in front of: a trivial command, a file write, and a pytest run, each in
a fresh bubblewrap sandbox call.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

from antihack.evaluate import DEFAULT_CORPUS, load_corpus, run
from antihack.guard import Guard
from environments import make_sandbox


def pct(values, q):
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--corpus", default=DEFAULT_CORPUS)
    p.add_argument("--repeat", type=int, default=20)
    args = p.parse_args()
    rows, _ = load_corpus(args.corpus)
    results = asyncio.run(run(Guard(), rows))  # first pass: cold caches, as for calls never seen before
    cold = [r["rules_ms"] for r in results]
    warm = [r["rules_ms"] for r in asyncio.run(run(Guard(), rows))]  # repeated calls (parse caches hit)
    sandbox = {}
    with make_sandbox("bwrap") as box:
        box.write_file("tests/test_a.py", "def test_a():\n    assert 1 + 1 == 2\n")
        for name, fn in [("bash: true", lambda: box.exec("true")),
                         ("write_file", lambda: box.write_file("x.py", "x = 1\n")),
                         ("pytest, 1 test", lambda: box.exec(["python", "-m", "pytest", "-q", "tests/test_a.py"]))]:
            times = []
            for _ in range(args.repeat):
                t0 = time.perf_counter()
                fn()
                times.append(1000 * (time.perf_counter() - t0))
            sandbox[name] = statistics.median(times)
    print(f"guard stage 1 on {len(cold)} corpus calls: p50 {pct(cold, .5):.2f} ms, p99 {pct(cold, .99):.2f} ms "
          f"(repeated calls: p50 {pct(warm, .5):.2f} ms, p99 {pct(warm, .99):.2f} ms)")
    for name, ms in sandbox.items():
        print(f"sandbox {name:<16} median {ms:8.1f} ms   guard p50 / call = {pct(cold, .5) / ms:6.1%}, "
              f"p99 / call = {pct(cold, .99) / ms:6.1%}")


if __name__ == "__main__":
    main()
