"""Model definitions and loading: HF causal LMs, GLM-5.2 (models.glm5), value heads, tiny test models, HF-format
safetensors in/out."""

from models.glm5.tiny import GLM52_SMALL, GLM52_TINY  # registers glm52-tiny and glm52-small
from models.registry import DEFAULT_POLICY, cache_dir, default_policy_dir, resolve_model_path
from models.loading import load_model, load_tokenizer, to_dtype
from models.logprobs import policy_logprobs, token_values
from models.tiny import TINY  # registers tiny-random

__all__ = [
    "DEFAULT_POLICY", "GLM52_SMALL", "GLM52_TINY", "TINY", "cache_dir", "default_policy_dir", "resolve_model_path",
    "load_model", "load_tokenizer", "to_dtype", "policy_logprobs", "token_values",
]
