"""Glm5Config: GLM-5.2 defaults, the IndexShare / MoE schedules (same as transformers'), config.json round trips."""

import json

import pytest

from models.glm5 import Glm5Config, derive_indexer_types
from models.glm5.tiny import REFERENCE_CONFIG


def test_defaults_are_glm52():
    c = Glm5Config()
    assert (c.hidden_size, c.num_hidden_layers, c.vocab_size, c.qk_head_dim) == (6144, 78, 154880, 256)
    assert c.full_indexer_layers == [0, 1, 2] + list(range(6, 78, 4))  # 21 indexers (docs/GLM52.md §4.5)
    assert len(c.full_indexer_layers) == 21
    assert c.mlp_layer_types == ["dense"] * 3 + ["sparse"] * 75
    assert c.rope_theta == 8e6 and c.index_share_for_mtp_iteration and c.num_nextn_predict_layers == 1
    assert c.layer_has_indexer(78) and c.layer_is_moe(78)  # the MTP layer


@pytest.mark.parametrize("layers", [1, 5, 8, 13, 78])
@pytest.mark.parametrize("freq,offset", [(1, 2), (4, 3), (4, 2), (2, 1), (3, 0), (5, 4), (4, 6)])
def test_indexer_types_match_transformers(layers, freq, offset):
    from transformers import GlmMoeDsaConfig

    hf = GlmMoeDsaConfig(num_hidden_layers=layers, index_topk_freq=freq, index_skip_topk_offset=offset)
    assert derive_indexer_types(layers, freq, offset) == hf.indexer_types
    kwargs = dict(num_hidden_layers=layers, first_k_dense_replace=min(3, layers), index_topk_freq=freq,
                  index_skip_topk_offset=offset)
    if hf.indexer_types[0] == "shared":  # transformers builds it, then fails in forward; we refuse up front
        with pytest.raises(ValueError, match="layer 0"):
            Glm5Config(**kwargs)
        return
    ours = Glm5Config(**kwargs)
    assert ours.indexer_types == hf.indexer_types
    assert ours.mlp_layer_types == hf.mlp_layer_types


@pytest.mark.parametrize("pattern", ["FSFS", "FFSSFS", ["full", "shared", "shared"]])
def test_pattern_and_explicit_list_match_transformers(pattern):
    from transformers import GlmMoeDsaConfig

    n = len(pattern)
    hf = GlmMoeDsaConfig(num_hidden_layers=n, index_topk_pattern=pattern)
    ours = Glm5Config(num_hidden_layers=n, first_k_dense_replace=1, index_topk_pattern=pattern)
    assert ours.indexer_types == hf.indexer_types
    explicit = ["full", "shared"] * (n // 2) + ["full"] * (n % 2)
    assert Glm5Config(num_hidden_layers=n, first_k_dense_replace=1, indexer_types=explicit,
                      index_topk_pattern=pattern).indexer_types == explicit  # an explicit list wins


def test_absent_indexshare_fields_default_like_transformers():
    """A GLM-5/5.1 config.json has no IndexShare fields: every layer runs its indexer (transformers: freq 1)."""
    from transformers import GlmMoeDsaConfig

    raw = Glm5Config(**REFERENCE_CONFIG).to_hf()
    for key in ("index_topk_freq", "index_skip_topk_offset", "index_topk_pattern", "indexer_types"):
        raw.pop(key)
    assert Glm5Config.from_hf(raw).indexer_types == ["full"] * 8 == GlmMoeDsaConfig(**raw).indexer_types
    assert derive_indexer_types(4, None, None) == ["full"] * 4


def test_round_trip_through_transformers(tmp_path):
    from transformers import AutoConfig, GlmMoeDsaConfig

    ours = Glm5Config(**REFERENCE_CONFIG)
    ours.save(tmp_path)
    hf = AutoConfig.from_pretrained(tmp_path)
    assert isinstance(hf, GlmMoeDsaConfig)
    for key in ("hidden_size", "num_hidden_layers", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim",
                "qk_rope_head_dim", "v_head_dim", "index_topk", "index_n_heads", "index_head_dim", "n_routed_experts",
                "num_experts_per_tok", "routed_scaling_factor", "indexer_types", "mlp_layer_types", "rope_parameters",
                "first_k_dense_replace", "n_group", "topk_group", "norm_topk_prob", "rms_norm_eps"):
        assert getattr(hf, key) == getattr(ours, key), key
    written = json.loads((tmp_path / "config.json").read_text())
    assert written["indexer_types"] == ours.indexer_types and written["rope_interleave"] is True
    assert "latent_norm_eps" not in written and "attn_query_chunk" not in written  # implementation knobs stay out
    # and back: transformers' own save → ours
    hf.save_pretrained(tmp_path / "hf")
    again = Glm5Config.from_hf(tmp_path / "hf")
    assert again.indexer_types == ours.indexer_types and again.hidden_size == ours.hidden_size
    assert Glm5Config.from_hf(ours.to_hf()).to_hf() == ours.to_hf()


def test_unknown_keys_round_trip_and_overrides():
    raw = {**Glm5Config().to_hf(), "quantization_config": {"quant_method": "fp8"}, "transformers_version": "5.12.0"}
    c = Glm5Config.from_hf(raw, latent_norm_eps=1e-5)
    assert c.extra["quantization_config"] == {"quant_method": "fp8"} and c.latent_norm_eps == 1e-5
    assert c.to_hf()["transformers_version"] == "5.12.0"


def test_rope_theta_from_older_files_and_validation():
    raw = Glm5Config(**REFERENCE_CONFIG).to_hf()
    raw.pop("rope_parameters")
    raw["rope_theta"] = 1e6
    assert Glm5Config.from_hf(raw).rope_theta == 1e6
    with pytest.raises(ValueError, match="layer 0"):
        Glm5Config(num_hidden_layers=3, first_k_dense_replace=1, indexer_types=["shared", "full", "full"])
    with pytest.raises(ValueError, match="rope_type"):
        Glm5Config(rope_parameters={"rope_theta": 1e4, "rope_type": "yarn"})
    with pytest.raises(ValueError, match="qk_head_dim"):
        Glm5Config(qk_head_dim=100)


def test_kernel_test_config_meets_sglang_constraints():
    """docs/GLM52.md §7 / §9B: what SGLang's FlashMLA-sparse, DSA indexer and fused router assert."""
    from models.glm5.tiny import KERNEL_CONFIG

    c = Glm5Config(**KERNEL_CONFIG)
    hf = c.to_hf()
    assert (c.kv_lora_rank, c.qk_rope_head_dim, c.index_head_dim) == (512, 64, 128)
    assert 64 % c.num_attention_heads == 0 and c.index_topk <= 2048 and c.index_topk % 64 == 0
    assert c.n_routed_experts & (c.n_routed_experts - 1) == 0 and c.num_experts_per_tok <= 8
    assert hf["topk_method"] == "noaux_tc" and hf["scoring_func"] == "sigmoid"
    assert hf["rope_interleave"] is True and hf["indexer_rope_interleave"] is True
    assert hf["indexer_types"] == ["full", "full", "full", "shared", "shared", "shared", "full", "shared"]
