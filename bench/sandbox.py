"""What a sandbox costs per tool call, and how many calls per second many sandboxes serve together.

    python bench/sandbox.py [--calls 200] [--concurrency 16 64] [--per-sandbox 10]
                            [--backends bwrap bwrap-per-call docker]

1. Per-call overhead: the same trivial command (`true`, through a shell) run `--calls` times as a plain
   subprocess, as a bubblewrap `exec` (`bwrap`: the resident executor, the default as root; `bwrap-per-call`: a
   new bwrap for each call) and as a Docker `exec` (one warm sandbox each); median and p90 wall time,
   and each backend's ratio to the plain subprocess. Also the start-up of a sandbox (make, first call, close).
2. Throughput: 16 and 64 sandboxes created first (not timed), then one thread per sandbox running
   `--per-sandbox` calls back to back, all at once; calls per second over the wall time of the whole batch.

Docker needs an engine (DOCKER_HOST; launch/docker/start_engine.sh) and the image (launch/docker/build_image.sh);
without them its rows say why they are missing. Figures depend on the machine: the table prints its core count.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from environments import make_sandbox  # noqa: E402

COMMAND = "true"
KINDS = {"bwrap": ("bwrap", {}), "bwrap-per-call": ("bwrap", {"resident": False}), "docker": ("docker", {})}


def new_sandbox(kind: str):
    backend, options = KINDS[kind]
    return make_sandbox(backend, **options)


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def timed(fn, n: int) -> list[float]:
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        out.append(1000 * (time.perf_counter() - t0))
    return out


def plain_call():
    subprocess.run(["/bin/bash", "-c", COMMAND], check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def sandbox_call(box):
    def call():
        result = box.exec(COMMAND)
        if result.exit_code != 0:
            raise RuntimeError(f"sandbox call failed: {result}")
    return call


def startup(backend: str, n: int) -> list[float]:
    def once():
        with new_sandbox(backend) as box:
            box.exec(COMMAND)
    return timed(once, n)


def throughput(backend: str, sandboxes: int, per_sandbox: int) -> float:
    """Calls per second of `sandboxes` sandboxes each running `per_sandbox` calls at the same time."""
    if backend == "plain":
        boxes = [None] * sandboxes
    else:
        with ThreadPoolExecutor(8) as pool:
            boxes = list(pool.map(lambda _: new_sandbox(backend), range(sandboxes)))
        with ThreadPoolExecutor(8) as pool:  # start containers (Docker starts on the first call), untimed
            list(pool.map(lambda b: b.exec(COMMAND), boxes))
    errors: list[BaseException] = []
    barrier = threading.Barrier(sandboxes + 1)

    def worker(box):
        call = plain_call if box is None else sandbox_call(box)
        barrier.wait()
        try:
            for _ in range(per_sandbox):
                call()
        except BaseException as exc:  # reported after the batch
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(b,)) for b in boxes]
    for t in threads:
        t.start()
    barrier.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    for box in boxes:
        if box is not None:
            box.close()
    if errors:
        raise RuntimeError(f"{len(errors)} of {sandboxes} workers failed: {errors[0]!r}")
    return sandboxes * per_sandbox / wall


def available(backend: str) -> str | None:
    """None when the backend can run here, else why not."""
    if backend == "docker":
        from environments.sandbox.docker import docker_available

        ok, why = docker_available()
        return None if ok else why
    try:
        with new_sandbox(backend) as box:
            box.exec(COMMAND)
    except Exception as exc:
        return repr(exc)
    return None


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--calls", type=int, default=200, help="calls per backend for the per-call overhead")
    p.add_argument("--startups", type=int, default=10, help="sandboxes made and closed for the start-up time")
    p.add_argument("--concurrency", type=int, nargs="+", default=[16, 64])
    p.add_argument("--per-sandbox", type=int, default=10, help="calls per sandbox in the throughput runs")
    p.add_argument("--backends", nargs="+", default=list(KINDS), choices=list(KINDS))
    args = p.parse_args()

    missing = {b: available(b) for b in args.backends}
    backends = [b for b in args.backends if missing[b] is None]
    print(f"{os.cpu_count()} cores; command {COMMAND!r} through bash; {args.calls} calls per backend")
    for b in args.backends:
        if missing[b]:
            print(f"{b}: not measured: {missing[b]}")

    plain_call()
    latency = {"plain": timed(plain_call, args.calls)}
    starts = {}
    for b in backends:
        with new_sandbox(b) as box:
            call = sandbox_call(box)
            call()  # warm: Docker starts its container on the first call
            latency[b] = timed(call, args.calls)
        starts[b] = startup(b, args.startups)

    base = statistics.median(latency["plain"])
    print("\nper call            median ms    p90 ms   × plain (median)   overhead ms (median)   start-up ms (median)")
    for name, values in latency.items():
        med = statistics.median(values)
        start = f"{statistics.median(starts[name]):10.1f}" if name in starts else f"{'-':>10}"
        print(f"{name:<18} {med:10.2f} {pct(values, .9):9.2f} {med / base:14.1f}x {med - base:19.2f}"
              f"            {start}")

    print(f"\nthroughput, calls/s ({args.per_sandbox} calls per sandbox, all sandboxes at once)")
    print(f"{'sandboxes':<12}" + "".join(f"{name:>16}" for name in ["plain", *backends]))
    for n in args.concurrency:
        row = [throughput(name, n, args.per_sandbox) for name in ["plain", *backends]]
        print(f"{n:<12}" + "".join(f"{v:16.1f}" for v in row))


if __name__ == "__main__":
    main()
