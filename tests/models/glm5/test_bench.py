"""bench/glm5.py: its FLOPs model counted against the module's own parameters, and a CPU smoke run of both sides
(ours and transformers' GlmMoeDsa on the same config), so the GPU benchmark does not rot between GPU sessions."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.bench_scripts import BENCH, load


@pytest.fixture(scope="module")
def bench():
    return load("glm5")


def _counted(model, cfg) -> tuple[dict[str, int], int]:
    """Parameters per kind from the module itself: routed experts apart, without embeddings, norms, biases and
    the MTP layers (a training token's forward does not use them)."""
    mtp = {str(i) for i in range(cfg.num_hidden_layers, cfg.num_hidden_layers + cfg.num_nextn_predict_layers)}
    routed, other = 0, 0
    for name, p in model.named_parameters():
        parts = name.split(".")
        if "embed_tokens" in name or "norm" in name or name.endswith("bias") or \
                (len(parts) > 2 and parts[1] == "layers" and parts[2] in mtp):
            continue
        if ".experts." in name:
            routed += p.numel()
        else:
            other += p.numel()
    return routed, other


@pytest.mark.parametrize("dense_layers", [8, 2])
def test_activated_parameters_match_the_module(bench, dense_layers):
    from models.glm5.config import Glm5Config
    from models.glm5.tiny import build_random

    cfg = Glm5Config(**dict(bench.CONFIGS["tiny"], first_k_dense_replace=dense_layers))
    routed, other = _counted(build_random(cfg, randomise=False), cfg)
    # a token passes through top-k of each MoE layer's routed experts (and all of everything else)
    assert bench.activated_params(cfg) == other + routed * cfg.num_experts_per_tok / cfg.n_routed_experts


def test_flops_per_token_by_hand(bench):
    from models.glm5.config import Glm5Config

    cfg = Glm5Config(**bench.CONFIGS["tiny"])  # 8 layers, 4 with an indexer; 4 heads, d_c 32, d_r 16, top-k 16
    seq = 63  # 32 keys on average, more than the top-k: the attention reads 16
    attention = 2 * 16 * 4 * (2 * 32 + 16)
    indexer = 2 * 16 * 32 * 32
    expected = 3 * (2 * bench.activated_params(cfg) + 8 * attention + 4 * indexer)
    assert bench.train_flops_per_token(cfg, seq) == expected


def test_cpu_smoke_run_of_both_sides(tmp_path):
    out = tmp_path / "glm5.json"
    run = subprocess.run([sys.executable, str(BENCH / "glm5.py"), "--device", "cpu", "--config", "tiny", "--seqs", "32",
                          "--steps", "1", "--index-share", "--profile", "--out", str(out)], capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    row = json.loads(out.read_text())["rows"][0]
    for side in ("ours", "transformers", "ours_indexer_every_layer"):
        assert row[side]["tokens_per_s"] > 0, row
    assert "ours/transformers" in run.stdout
    assert "profile of one ours step at 32 tokens" in run.stdout and "SparseMLABackward" in run.stdout


def test_indexer_margins_bench_smoke(tmp_path):
    """bench/indexer_margins.py at a small top-k: the rounding-matched trainer's ε is fp32 rounding and every row
    whose selection differs lies under 2ε (what makes the margin gate sound); the fp32 trainer's ε is FP8's."""
    out = tmp_path / "margins.json"
    subprocess.run([sys.executable, str(BENCH / "indexer_margins.py"), "--lengths", "400", "--topk", "64",
                    "--sample", "16", "--threads", "1", "--out", str(out)], check=True, capture_output=True,
                   timeout=600)
    results = json.loads(out.read_text())["results"]
    assert [r["tokens"] for r in results] == ["random", "docs"]
    for r in results:
        fp8, fp32 = r["fp8_trainer"], r["fp32_trainer"]
        assert r["rows_with_a_choice"] == 400 - 64
        assert fp8["eps_max"] < 1e-5 < 1e-3 < fp32["eps_max"]
        assert fp8["sound_at_2eps"] and fp32["sound_at_2eps"]
        assert fp32["rows_differing"] > fp8["rows_differing"]
        assert fp8["full_replay_bytes_per_token_per_full_layer"] == 4 * 64
