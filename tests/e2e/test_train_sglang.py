"""`engine=sglang` end to end on the CPU: rl.train launches two SGLang-speaking servers as Ray actors
(tests/fakes/sglang_server.py: real generation by the policy, real weight loading), sglang-router in front when
installed, the agent loop through SGLangEngine, and after each update the trainer broadcasts the new weights
over a gloo process group (`weight_sync=distributed`, the NCCL path's code), verified by reading them back. The
loop is asynchronous (trainer.max_staleness=1): episodes run through the steps and a sync cuts their requests,
which continue on the new weights; the actor's and the critic's work of a step overlaps."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from rl.run_log import read_metrics

from .test_train_loop import config

pytestmark = pytest.mark.slow
FAKE = [sys.executable, str(Path(__file__).resolve().parents[1] / "fakes" / "sglang_server.py")]


def test_train_with_an_sglang_fleet(scripted_policy, tmp_path):
    from rl.train import train

    cfg = config(f"model.name={scripted_policy}", f"output_dir={tmp_path}", "engine=sglang", "engine.sglang.num_servers=2",
                 "engine.sglang.gpus_per_server=0", f"engine.sglang.launch_command={FAKE}",
                 "engine.sglang.weight_sync=distributed", "engine.sglang.startup_timeout_s=180",
                 "trainer.verify_weight_sync=true", "agent.context_window=896", "agent.max_turns=4",
                 "engine.temperature=0.5", "engine.max_concurrent_episodes=8", "trainer.max_staleness=1",
                 "trainer.overlap_models=on")
    final = train(cfg)
    records = read_metrics(tmp_path / "coding_ppo_tiny" / "metrics.jsonl")
    assert [r["step"] for r in records] == [0, 1, 2]
    for r in records[1:]:
        assert r["rollout/weight_version"] == r["step"] and r["perf/weight_sync_max_abs_diff"] == 0.0
        assert r["perf/weight_sync_probe_abs_diff"] < 1e-4  # the same logprobs on the probe, server and trainer
        assert r["engine/requests"] > 0 and r["rollout/server_restarts"] == 0
        assert r["perf/weight_sync_mb"] > 0
        assert r["async/staleness_max"] <= 1 and r["rollout/episodes"] == 4
    assert sum(r["engine/prefix_cache_hit"] for r in records[1:]) > 0  # later turns reuse their prefix
    assert "eval/pass_rate" in records[2] and final["rollout/episodes"] == 4
    assert (tmp_path / "coding_ppo_tiny" / "sglang" / "sglang-0.log").exists()
