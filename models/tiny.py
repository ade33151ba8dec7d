"""Tiny random models for tests: the default policy's tokenizer and chat format, a few thousand parameters.

`tiny-random` is a 2-layer Llama; `tiny-random:<seed>` picks the initialisation seed. The folder is written
once into the cache and is an ordinary HF-format checkpoint.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import torch

from models.hub import TINY, cache_dir, default_policy_dir

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


def tiny_model_dir(name: str = TINY) -> Path:
    seed = int(name.split(":", 1)[1]) if ":" in name else 0
    out = cache_dir() / f"tiny-random-{seed}"
    if (out / "config.json").exists():
        return out
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(default_policy_dir())
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        **TINY_CONFIG,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    tmp = Path(tempfile.mkdtemp(prefix=out.name + ".", dir=out.parent))
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        os.replace(tmp, out)
    except OSError:
        if not (out / "config.json").exists():  # lost a race with another process: fine if it won
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out
