"""`python -m opd.distill` end to end with tiny models on the CPU: a student and two teachers (other random
inits, the same tokenizer), each teacher in its own Ray worker owning one task domain, scoring trajectories as
they finish; pure-OPD updates, per-domain metrics, checkpoint, resume (on the asynchronous loop), and the merged
student in HF format."""

from __future__ import annotations

from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from rl.run_log import read_metrics

CONFIGS = str(Path(__file__).resolve().parents[2] / "configs")
pytestmark = pytest.mark.slow


def config(*overrides):
    from opd.config import register_opd_configs

    register_opd_configs()
    with initialize_config_dir(config_dir=CONFIGS, version_base=None):
        return OmegaConf.to_object(compose(config_name="opd", overrides=["+experiment=opd_tiny", *overrides]))


def test_distill_two_teachers_then_resume(tmp_path):
    """The first step trains the student on two DeepSpeed ranks (ZeRO-2); the resume continues on one, through
    the universal checkpoint (models/deepspeed_worker.py)."""
    from opd.distill import distill

    final = distill(config(f"output_dir={tmp_path}", "trainer.steps=1", "trainer.actor_ranks=2",
                           "trainer.zero_stage=2"))
    assert final["actor/ranks"] == 2
    run = tmp_path / "opd_tiny"
    records = read_metrics(run / "metrics.jsonl")
    assert [r["step"] for r in records] == [0, 1]
    start, step = records
    for teacher, domain in (("t_function", "function"), ("t_bugfix", "bugfix")):
        assert f"teacher/{teacher}/eval/{domain}/pass_rate" in start
    assert "eval/function/pass_rate" in start and "eval/bugfix/pass_rate" in start
    kl_domains = [k for k in step if k.startswith("opd/reverse_kl/")]
    assert kl_domains and step["opd/tokens"] > 0 and step["perf/teacher_scoring_s"] > 0
    assert 0.0 <= step["perf/teacher_overlap"] <= 1.0
    assert step["rollout/weight_version"] == 1 and "actor/grad_norm" in step and "critic/value_loss" not in step
    assert (run / "student" / "config.json").exists() and list((run / "student").glob("*.safetensors"))

    # Resumed asynchronously (K = 1): step 3's episodes start while step 2 trains, and are scored as they finish.
    final = distill(config(f"output_dir={tmp_path}", "trainer.steps=3", "resume=true", "trainer.zero_stage=2",
                           "trainer.max_staleness=1", "trainer.keep_checkpoints=3"))
    assert final["actor/ranks"] == 1
    assert (run / "checkpoints" / "step_000001" / "actor" / "state" / "universal" / "state" / ".complete").exists()
    records = read_metrics(run / "metrics.jsonl")
    assert [r["step"] for r in records] == [0, 1, 2, 3] and final["rollout/weight_version"] == 3
    for r in records[2:]:
        assert r["opd/tokens"] > 0 and r["async/staleness_max"] <= 1 and r["opd/unscored_dropped"] == 0
    assert (run / "checkpoints" / "latest").read_text().strip() == "step_000003"
