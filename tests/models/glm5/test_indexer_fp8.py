"""`indexer_fp8`: the trainer's indexer scores as SGLang's DSA kernels do (bf16, then per-row FP8 e4m3), so that
its top-k can match the engine's. Checked against a naive nearest-value search over the FP8 grid, a hand-computed
row, and a naive top-k over the quantised tensors; the cached decode still selects exactly what the whole-sequence
forward selects."""

from __future__ import annotations

import pytest
import torch

from models import load_model
from models.glm5 import Glm5Cache, Glm5Config
from models.glm5.indexer import Indexer, fp8_act_quant
from models.glm5.tiny import REFERENCE_CONFIG, build_random

pytestmark = pytest.mark.usefixtures("one_thread")


def naive_fp8(x: torch.Tensor) -> torch.Tensor:
    """Per row: bf16, scale max(1e-4, amax)/448, then the nearest finite e4m3 value (ties to the even code)."""
    grid = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    codes = torch.arange(256)
    keep = torch.isfinite(grid)
    grid, codes = grid[keep], codes[keep]
    x = x.to(torch.bfloat16).float()
    out = torch.empty_like(x)
    for r in range(x.shape[0]):
        scale = max(float(x[r].abs().max()), 1e-4) / 448.0
        for c in range(x.shape[1]):
            v = float(x[r, c]) / scale
            d = (grid - v).abs()
            best = torch.nonzero(d == d.min()).flatten()
            pick = best[(codes[best] % 2 == 0).nonzero().flatten()[0]] if len(best) > 1 else best[0]
            out[r, c] = grid[pick] * scale
    return out


def test_fp8_act_quant_is_the_nearest_fp8_value_of_each_scaled_row():
    row = torch.tensor([[448.0, 1.0, 0.3, -2.0]])  # scale 1: 0.3 = 1.2·2⁻² → 1.25·2⁻² (3 mantissa bits)
    assert fp8_act_quant(row).tolist() == [[448.0, 1.0, 0.3125, -2.0]]
    magnitudes = torch.tensor([1, 10, 1e-3, 1e-6, 3, 50])[:, None]
    x = torch.randn(6, 32, generator=torch.Generator().manual_seed(0)) * magnitudes
    assert torch.equal(fp8_act_quant(x), naive_fp8(x))
    assert torch.equal(fp8_act_quant(torch.zeros(2, 8)), torch.zeros(2, 8))


def test_select_ranks_the_quantised_scores():
    cfg = Glm5Config(**dict(REFERENCE_CONFIG, indexer_fp8=True))
    g = torch.Generator().manual_seed(1)
    indexer = Indexer(cfg)
    b, s, h, d = 2, 40, cfg.index_n_heads, cfg.index_head_dim
    q, w, k = torch.randn(b, s, h, d, generator=g), torch.randn(b, s, h, generator=g), torch.randn(b, s, d, generator=g)
    pos = torch.arange(s).expand(b, s)
    chosen = indexer.select(q, w, k, pos, None)
    # naive: I[t, u] = Σ_j w̃_j ReLU(d^-½ q̃_j · k̃_u) over u ≤ t, top-k
    scale = h ** -0.5
    qq = fp8_act_quant(q.reshape(-1, d)).reshape(b, s, h, d)
    kk = fp8_act_quant(k.reshape(-1, d)).reshape(b, s, d)
    ww = (w / scale).to(torch.bfloat16).float() * scale
    width = chosen.shape[-1]
    for bi in range(b):
        for t in range(s):
            scores = torch.stack([(ww[bi, t] * torch.relu(qq[bi, t] @ kk[bi, u] * d ** -0.5)).sum()
                                  for u in range(t + 1)])
            want = scores.topk(min(width, t + 1)).indices.sort().values
            got = chosen[bi, t][chosen[bi, t] >= 0].sort().values
            assert torch.equal(got, want), (bi, t)
    exact = Indexer(Glm5Config(**REFERENCE_CONFIG))
    exact.load_state_dict(indexer.state_dict())
    assert not torch.equal(exact.select(q, w, k, pos, None).sort(-1).values, chosen.sort(-1).values)


def test_a_model_loaded_with_indexer_fp8_decodes_what_it_trains_on(tmp_path):
    model = build_random(Glm5Config(**dict(REFERENCE_CONFIG, initializer_range=0.05)), seed=3)
    model.save_pretrained(tmp_path / "m")
    fp8 = load_model(str(tmp_path / "m"), overrides={"indexer_fp8": True}).eval()
    indexers = [m for m in fp8.modules() if isinstance(m, Indexer)]
    assert indexers and all(m.fp8 for m in indexers)
    ids = torch.randint(0, 256, (2, 48), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        whole = fp8(input_ids=ids, use_cache=False, return_routing=True).indexer_topk
        cache = Glm5Cache()
        steps = [fp8(input_ids=ids[:, :30], cache=cache, use_cache=True, return_routing=True).indexer_topk]
        for i in range(30, 48):
            steps.append(fp8(input_ids=ids[:, i:i + 1], cache=cache, use_cache=True, return_routing=True).indexer_topk)
    for layer, chosen in whole.items():
        decoded = torch.cat([step[layer] for step in steps], 1)
        assert torch.equal(decoded.sort(-1).values, chosen.sort(-1).values), layer
    with pytest.raises(ValueError, match="for GLM-5.x models"):
        load_model("tiny-random", overrides={"indexer_fp8": True})

