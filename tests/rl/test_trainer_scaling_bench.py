"""bench/trainer_scaling.py: the longest-context search and the parallel layouts it takes, and a CPU smoke run of a
GLM-5.2 model under expert and sequence parallelism with the search, so the multi-GPU benchmark does not rot
between the sessions that have several GPUs."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

import pytest

from tests.bench_scripts import BENCH, load


@pytest.fixture(scope="module")
def bench():
    return load("trainer_scaling")


def test_the_search_doubles_until_the_first_failure_and_reports_it(bench):
    tried = []

    def trains(length):
        tried.append(length)
        if length > 5000:
            raise MemoryError("CUDA out of memory. Tried to allocate 2.00 GiB\nmore detail")
        return {"seconds": length / 1000}

    found = bench.longest_trainable(trains, 1024, 65536)
    assert tried == [1024, 2048, 4096, 8192]
    assert found["longest"] == 4096 and found["at_longest"] == {"seconds": 4.096}
    assert found["failed_at"] == 8192
    assert found["failure"] == "MemoryError: CUDA out of memory. Tried to allocate 2.00 GiB"


def test_a_ranks_error_is_reported_by_its_cause(bench):
    """Ray wraps a rank's exception; its first line names the actor, not the reason. The report takes the cause."""
    class Wrapped(RuntimeError):  # the shape of ray.exceptions.RayTaskError: the original under .cause
        def __init__(self, cause):
            super().__init__("\x1b[36mray::ActorWorker.train_step()\x1b[39m (pid=1, ip=10.0.0.1)\n  File ...")
            self.cause = cause

    oom = Wrapped(MemoryError("CUDA out of memory. Tried to allocate 9.00 GiB\nGPU 0 has a total capacity ..."))
    assert bench.describe(oom) == "MemoryError: CUDA out of memory. Tried to allocate 9.00 GiB"
    assert bench.longest_trainable(lambda n: (_ for _ in ()).throw(oom), 8, 64)["failure"] == bench.describe(oom)
    assert bench.describe(TimeoutError()) == "TimeoutError: "


def test_the_search_stops_at_its_maximum_or_reports_that_nothing_trained(bench):
    assert bench.longest_trainable(lambda n: n, 100, 450) == {"longest": 400, "at_longest": 400, "failed_at": None,
                                                               "failure": None}

    def never(length):
        raise TimeoutError("2 rank(s) did not answer within 180 s")

    found = bench.longest_trainable(never, 100, 450)
    assert found["longest"] == 0 and found["at_longest"] is None and found["failed_at"] == 100


def test_layouts_parse_and_bad_ones_are_refused(bench):
    assert bench.parse_layout("2x1") == (2, 1) and bench.parse_layout("1X4") == (1, 4)
    for bad in ("2", "2x", "axb", "0x2", "2x1x1"):
        with pytest.raises(argparse.ArgumentTypeError):
            bench.parse_layout(bad)
    with pytest.raises(SystemExit):  # E > 1 needs ZeRO-1/2 (DeepSpeed's expert groups)
        bench.main(["--parallel", "2x1", "--zero", "3"])
    with pytest.raises(SystemExit):  # no layout divides the rank counts
        bench.main(["--ranks", "1", "--parallel", "2x1", "--zero", "2"])


def test_glm52_under_expert_and_sequence_parallelism_on_cpu_ranks(tmp_path):
    """The command as a GPU session runs it, on two gloo ranks with E = 2 and S = 2 at once (the layout nothing
    but the benchmark combines with the search): the actor's and the critic's steps, the weight buckets, and the
    longest-context search, which here reaches its maximum (no memory limit is near)."""
    out = tmp_path / "scaling.json"
    run = subprocess.run([sys.executable, str(BENCH / "trainer_scaling.py"), "--model", "glm52-tiny", "--ranks", "2",
                          "--parallel", "2x2", "--zero", "2", "--layouts", "packed", "--samples", "4", "--lengths", "24",
                          "64", "--steps", "2", "--longest", "64", "--longest-max", "128", "--out", str(out)],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    (r,) = json.loads(out.read_text())
    assert (r["ranks"], r["expert_parallel"], r["sequence_parallel"]) == (2, 2, 2)
    for name in ("actor", "critic"):
        assert r[name]["tokens_per_s"] > 0 and r[name]["loss"] == r[name]["loss"]  # a number, not NaN
        assert len(r[name]["peak_rss_mib_per_rank"]) == 2
    assert r["sync"]["gb"] > 0
    assert r["longest"]["longest"] == 128 and r["longest"]["failed_at"] is None
    assert len(r["longest"]["at_longest"]["peak_rss_mib_per_rank"]) == 2
    assert "longest ranks 2 packed E2 S2: 128 tokens trained" in run.stdout
