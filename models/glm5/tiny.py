"""Tiny random GLM-5.2 models for tests: the real architecture (MLA, DSA indexer with IndexShare, dense first
layers, MoE, MTP) at a few million parameters.

`glm52-small[:seed]` (the GLM-5.2 recipe's policy on SGLang) is `KERNEL_CONFIG` below with that tokenizer, stored
in bf16: the smallest GLM-5.2 SGLang's kernels accept, about 0.3B parameters.

`glm52-tiny[:seed]` is a built-in model name (like `tiny-random`): 8 layers with GLM-5.2's own IndexShare schedule
(freq 4, offset 3 → F F F S S S F S), 2 dense layers, 8 experts, an MTP layer, top-k 16 so that any rollout past
16 tokens attends sparsely, and the default policy's (SmolLM2) tokenizer and vocabulary. The folder is written
once into the cache and is an ordinary HF-format checkpoint (transformers' GlmMoeDsaForCausalLM loads it).

`randomise_for_testing` perturbs what a fresh init leaves at 1 or 0 (norm gains, the indexer's LayerNorm bias,
the router's correction bias), so that a test comparing against another implementation notices a wrong order
of operations or a forgotten bias.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from models.glm5.config import Glm5Config
from models.registry import cached_random_model, register_builtin

GLM52_TINY = "glm52-tiny"  # a tiny random GLM-5.2, for tests
GLM52_SMALL = "glm52-small"  # the smallest random GLM-5.2 SGLang's kernels serve

# docs/GLM52.md §9A, the transformers-equality configuration
REFERENCE_CONFIG = dict(
    vocab_size=1024, hidden_size=256, intermediate_size=512, moe_intermediate_size=128, num_hidden_layers=8,
    first_k_dense_replace=2, moe_layer_freq=1, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=128,
    kv_lora_rank=64, qk_nope_head_dim=48, qk_rope_head_dim=16, v_head_dim=64, head_dim=48, n_routed_experts=8,
    num_experts_per_tok=2, n_shared_experts=1, n_group=1, topk_group=1, routed_scaling_factor=2.5,
    norm_topk_prob=True, index_n_heads=16, index_head_dim=32, index_topk=16, index_topk_freq=4,
    index_skip_topk_offset=3, num_nextn_predict_layers=1, max_position_embeddings=4096,
    rope_parameters={"rope_theta": 8000000.0, "rope_type": "default"}, rms_norm_eps=1e-5, dtype="float32",
    pad_token_id=None, eos_token_id=None,
)

# docs/GLM52.md §9B: the smallest config SGLang's GLM-5.2 kernels accept (FlashMLA: kv_lora 512 + rope 64, v 256;
# indexer head dim 128; heads dividing 64; top-k a multiple of 64 and ≤ 2048; a power-of-two expert count), for
# `--load-format dummy` smoke tests and ours-vs-SGLang parity on a GPU. Same layer pattern as REFERENCE_CONFIG.
KERNEL_CONFIG = dict(
    vocab_size=154880, hidden_size=1024, intermediate_size=1024, moe_intermediate_size=256, num_hidden_layers=8,
    first_k_dense_replace=2, num_attention_heads=16, num_key_value_heads=16, q_lora_rank=512, kv_lora_rank=512,
    qk_nope_head_dim=192, qk_rope_head_dim=64, v_head_dim=256, head_dim=192, n_routed_experts=16,
    num_experts_per_tok=4, n_shared_experts=1, index_n_heads=32, index_head_dim=128, index_topk=64,
    index_topk_freq=4, index_skip_topk_offset=3, num_nextn_predict_layers=1, max_position_embeddings=8192,
    rope_parameters={"rope_theta": 8000000.0, "rope_type": "default"}, dtype="bfloat16",
)

# the built-in glm52-small: KERNEL_CONFIG with the tokenizer's vocabulary and sgl-kernel's DSA top-k, which asserts
# index_topk == 2048 (contexts up to 2,048 tokens attend densely, longer ones sparsely)
SMALL_CONFIG = {**{k: v for k, v in KERNEL_CONFIG.items() if k != "vocab_size"}, "index_topk": 2048}

# the built-in glm52-tiny (vocab and special tokens come from the tokenizer)
TINY_CONFIG = dict(
    hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=8, first_k_dense_replace=2,
    num_attention_heads=4, num_key_value_heads=4, q_lora_rank=64, kv_lora_rank=32, qk_nope_head_dim=16,
    qk_rope_head_dim=16, v_head_dim=16, head_dim=16, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
    index_n_heads=16, index_head_dim=32, index_topk=16, index_topk_freq=4, index_skip_topk_offset=3,
    num_nextn_predict_layers=1, max_position_embeddings=8192, dtype="float32",
    rope_parameters={"rope_theta": 8000000.0, "rope_type": "default"},
)


@torch.no_grad()
def randomise_for_testing(model: nn.Module, seed: int = 0, gain_std: float = 0.1, bias_std: float = 0.05) -> None:
    """Norm gains ← 1 + gain_std·N, LayerNorm biases and router correction biases ← bias_std·N."""
    g = torch.Generator().manual_seed(seed)
    for name, p in list(model.named_parameters()) + list(model.named_buffers()):
        module_leaf = name.rsplit(".", 2)[-2] if "." in name else ""
        if name.endswith("e_score_correction_bias") or (name.endswith(".bias") and "norm" in module_leaf):
            p.copy_(torch.randn(p.shape, generator=g) * bias_std)
        elif name.endswith(".weight") and "norm" in module_leaf:
            p.copy_(1 + torch.randn(p.shape, generator=g) * gain_std)


def build_random(config: Glm5Config, seed: int = 0, randomise: bool = True):
    """A policy with seeded random weights (and, by default, randomised norms and biases)."""
    from models.glm5.model import Glm5ForCausalLM

    torch.manual_seed(seed)
    model = Glm5ForCausalLM(config)
    if randomise:
        randomise_for_testing(model, seed)
    return model


def tiny_glm5_dir(name: str = GLM52_TINY) -> Path:
    """HF-format folder of `glm52-tiny[:seed]` in the model cache (written once)."""
    return _random_glm5_dir(name, "glm52-tiny", TINY_CONFIG)


def small_glm5_dir(name: str = GLM52_SMALL) -> Path:
    """HF-format folder of `glm52-small[:seed]` (bf16; the routers' correction bias stays fp32) in the cache."""
    return _random_glm5_dir(name, "glm52-small", SMALL_CONFIG, torch.bfloat16)


def _random_glm5_dir(name: str, prefix: str, layout: dict, dtype: torch.dtype = torch.float32) -> Path:
    def build(tokenizer, seed: int):
        eos = tokenizer.eos_token_id
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
        config = Glm5Config(vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id, eos_token_id=eos,
                            pad_token_id=pad, **{**layout, "dtype": str(dtype).removeprefix("torch.")})
        return build_random(config, seed).to(dtype)

    return cached_random_model(name, prefix, build)


register_builtin(GLM52_TINY, tiny_glm5_dir)
register_builtin(GLM52_SMALL, small_glm5_dir)
