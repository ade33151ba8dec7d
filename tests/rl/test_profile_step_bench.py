"""bench/profile_step.py on the CPU: the two passes timed and profiled on rollout-shaped samples, so the GPU
session that profiles the trainer step finds the script working."""

from __future__ import annotations

from tests.bench_scripts import load


def test_the_step_is_timed_and_its_operators_tabled(tmp_path):
    bench = load("profile_step")
    result = bench.main(["--model", "tiny-random", "--samples", "4", "--lengths", "60", "120",
                         "--micro-batch-tokens", "512", "--rows", "5", "--attn", "eager", "--autocast",
                         "--out", str(tmp_path)])
    assert 4 * 60 <= result["tokens"] < 4 * 120
    assert result["logprob_s"] > 0 and result["update_s"] > 0
    # --autocast: timed against the same weights without it, whose π_old it matches to bf16's rounding
    assert result["peer_logprob_s"] > 0 and result["peer_update_s"] > 0
    assert 0 < result["logprob_abs_diff_max"] < 0.05
    text = (tmp_path / "profile.txt").read_text()
    assert "bf16-autocast eager attention" in text and "x one forward pass" in text and "(the peer)" in text
    assert text.count("aten::") >= 5  # both tables name operators
