"""Tiny random models for tests: the default policy's tokenizer and chat format, a few thousand parameters.

`tiny-random` is a 2-layer Llama; `tiny-random:<seed>` picks the initialisation seed. The folder is written
once into the cache and is an ordinary HF-format checkpoint.
"""

from __future__ import annotations

from pathlib import Path

import torch

from models.registry import cached_random_model, register_builtin

TINY = "tiny-random"

TINY_CONFIG = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=8192,
    rope_theta=10000.0,
    tie_word_embeddings=True,
)

# The default policy's shape (SmolLM2-135M-Instruct), for random-weight stand-ins of it where its weights are not
# needed (the benches on hosts without them: speed does not depend on the weights)
SMOLLM2_SHAPE = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                     num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192, rope_theta=100000.0,
                     tie_word_embeddings=True)


def tiny_model_dir(name: str = TINY) -> Path:
    def build(tokenizer, seed: int):
        from transformers import LlamaConfig, LlamaForCausalLM

        config = LlamaConfig(vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
                             eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, **TINY_CONFIG)
        torch.manual_seed(seed)
        return LlamaForCausalLM(config)

    return cached_random_model(name, "tiny-random", build)


register_builtin(TINY, tiny_model_dir)
