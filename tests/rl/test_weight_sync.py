"""The weight-sync objects' shared logic (rl/weight_sync.py) with transports that fail on demand; the transports
themselves run for real in tests/rollout/test_sglang_fleet.py and the end-to-end runs."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest

from rl.weight_sync import FallbackSync, SGLangSync, make_weight_sync


class Transport(SGLangSync):
    def __init__(self, name, fails, fleet, sent):
        self.name, self.fails, self.sent = name, fails, sent
        self.workers = SimpleNamespace(rollout=[], actor=None, weight_version=0, fleet=fleet)
        self.fleet, self.verify, self.bucket_mb = fleet, False, 1

    def send(self, urls, version, fresh):
        self.sent.append((self.name, tuple(urls), version, fresh))
        if self.fails:
            raise ConnectionError(f"{self.name} refused")
        return {"seconds": 0.1, "bytes": 2**20, "buckets": 1}


@pytest.fixture
def fleet():
    return SimpleNamespace(urls=["http://a", "http://b"], sync_lock=threading.RLock(), restarts=0, sync_fallbacks=0,
                           cfg=SimpleNamespace(args={}, pause_mode="abort"), model_path="/nonexistent")


def test_a_failing_transport_hands_over_to_the_fallback_for_good(fleet, monkeypatch):
    monkeypatch.setattr("rl.weight_sync.ray.get", lambda refs: refs)
    sent = []
    sync = FallbackSync(Transport("distributed", True, fleet, sent), Transport("disk", False, fleet, sent))
    first = sync.push(1)
    assert sent == [("distributed", ("http://a", "http://b"), 1, False), ("disk", ("http://a", "http://b"), 1, True)]
    assert fleet.sync_fallbacks == 1 and sync.name == "disk" and sync.workers.weight_version == 1
    assert first["rollout/weight_version"] == 1 and first["perf/weight_sync_fallbacks"] == 1
    sync.push(2, urls=["http://b"])  # the fallback from now on; the failed transport is not tried again
    assert sent[-1] == ("disk", ("http://b",), 2, False) and fleet.sync_fallbacks == 1


def test_without_a_fallback_the_error_surfaces(fleet):
    sync = FallbackSync(Transport("tensor", True, fleet, []), None)
    with pytest.raises(ConnectionError, match="tensor refused"):
        sync.push(1)


def test_the_transport_follows_the_config(fleet, monkeypatch):
    from rl.config import Config

    cfg = Config()
    workers = SimpleNamespace(fleet=None)
    assert make_weight_sync(cfg, workers).name == "object_store"
    monkeypatch.setattr("rl.weight_sync.served_dtype", lambda fleet: None)
    workers.fleet = fleet
    cfg.engine.sglang.weight_sync, cfg.engine.sglang.weight_sync_fallback = "distributed", "disk"
    made = make_weight_sync(cfg, workers, "/run")
    assert isinstance(made, FallbackSync) and made.name == "distributed" and made.fallback.folder == "/run/weights"
    cfg.engine.sglang.weight_sync_fallback = ""
    assert make_weight_sync(cfg, workers).name == "distributed"


def test_a_weight_stream_is_walked_once_and_finish_walks_what_a_failed_consumer_left():
    """A sender that fails after bucket 0 leaves the other ranks waiting in bucket 1's gather (ZeRO-3, or the
    experts under expert parallelism): `finish()` walks buckets 1.. (their collectives) and keeps nothing."""
    import torch

    from models.weight_stream import WeightBuckets

    module = torch.nn.Sequential(*[torch.nn.Linear(64, 64, bias=False) for _ in range(4)])
    stream = WeightBuckets(module, bucket_mb=0.01, zero3=False)
    walked = []
    copy = stream._copy
    stream._copy = lambda names, mine: walked.append(names) or copy(names, mine)
    assert len(stream) == 4
    first = next(iter(stream))
    assert list(first) == ["0.weight"]
    stream.finish()
    assert walked == [["0.weight"], ["1.weight"], ["2.weight"], ["3.weight"]]
    assert list(stream) == []  # walked once: nothing is gathered twice
