"""ZeRO-3 data parallelism of the GLM-5.2 model: two gloo ranks train exactly like one rank on the same data
(bench/zero3_glm5.py runs both worlds; on GPUs the same script makes docs/BENCHMARKS.md's figures), and the MoE
layer's idle-expert mode that keeps the ranks' collectives in step changes no number."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from models.glm5.config import Glm5Config
from models.glm5.moe import MoE
from models.glm5.parallel import prepare_for_zero3
from models.glm5.tiny import TINY_CONFIG, build_random

ROOT = Path(__file__).resolve().parents[2]


def test_idle_experts_change_nothing_but_get_zero_gradients():
    config = Glm5Config(vocab_size=256, **{**TINY_CONFIG, "n_routed_experts": 16, "num_experts_per_tok": 1})
    torch.manual_seed(0)
    moe = MoE(config)
    torch.nn.init.normal_(moe.gate.weight, std=0.5)
    x = torch.randn(1, 3, config.hidden_size)  # 3 tokens, top-1 of 16 experts: at least 13 experts idle

    def run(idle: bool):
        moe.zero_grad(set_to_none=True)
        moe.run_idle_experts = idle
        y, ids = moe(x)
        y.square().sum().backward()
        return y.detach(), ids, {n: p.grad for n, p in moe.named_parameters()}

    y0, ids, g0 = run(False)
    y1, _, g1 = run(True)
    torch.testing.assert_close(y1, y0, rtol=0, atol=0)
    used = set(ids.flatten().tolist())
    assert len(used) <= 3
    for name, grad in g1.items():
        if name.startswith("experts.") and int(name.split(".")[1]) not in used:
            assert g0[name] is None and grad is not None and not grad.any()  # every rank reduces a (zero) grad
        elif g0[name] is not None:
            torch.testing.assert_close(grad, g0[name], rtol=0, atol=0)


def test_prepare_for_zero3_switches_every_moe_layer():
    model = build_random(Glm5Config(vocab_size=256, **TINY_CONFIG))
    moes = [m for m in model.modules() if isinstance(m, MoE)]
    assert prepare_for_zero3(model, 1) == 0 and not any(m.run_idle_experts for m in moes)
    assert prepare_for_zero3(model, 2) == len(moes) > 0 and all(m.run_idle_experts for m in moes)


@pytest.mark.slow
def test_two_ranks_train_like_one(tmp_path):
    subprocess.run([sys.executable, str(ROOT / "bench" / "zero3_glm5.py"), "--device", "cpu", "--config", "tiny",
                    "--layers", "3", "--seq", "32", "--batch", "4", "--steps", "2", "--lr", "1e-3",
                    "--out", str(tmp_path)], check=True, cwd=ROOT, timeout=900)
    results = json.loads((tmp_path / "summary.json").read_text())["results"]
    one, two = results["1"]["losses"], results["2"]["losses"]
    assert one[1] != one[0]  # the first update changed the model
    # same initial weights and data: identical up to the order of floating-point reductions (fp32 on gloo)
    assert max(abs(a - b) for a, b in zip(one, two)) < 1e-4
