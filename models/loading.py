"""`load_model`: one entry point for policies and critics, HF-format folders in and out."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import torch
from torch import nn

from models.dtypes import to_dtype
from models.registry import resolve_model_path

def load_tokenizer(name_or_path: str):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(name_or_path))
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def model_type(path: Path) -> str | None:
    """`model_type` of an HF-format folder's config.json (None when absent)."""
    import json

    config = Path(path) / "config.json"
    return json.loads(config.read_text()).get("model_type") if config.exists() else None


def load_model(
    name_or_path: str,
    role: Literal["policy", "value"] = "policy",
    dtype: str | torch.dtype = "float32",
    device: str | torch.device = "cpu",
    expert_shard: tuple[int, int] | None = None,
    overrides: dict | None = None,
) -> nn.Module:
    """Load a policy (causal LM) or a critic (same backbone + a scalar value head).

    `name_or_path`: a built-in name (`smollm2-135m-instruct`, `tiny-random[:seed]`) or a local HF-format folder.
    A critic loaded from a policy checkpoint gets a fresh value head, initialised to zero so that V ≡ 0 at the
    start (the first advantages are then the plain returns); a critic checkpoint we saved loads its trained head.
    The critic is an HF `*ForTokenClassification` model with one label, so `save_pretrained` output loads in
    transformers as it is. A folder whose config.json says `model_type: glm_moe_dsa` (GLM-5.x, e.g. the built-in
    `glm52-tiny[:seed]`) loads our implementation instead (`models.glm5`: `Glm5ForCausalLM` / `Glm5ForValue`),
    which keeps the same interface (get_decoder, get_output_embeddings, save_pretrained, `.logits`).
    `expert_shard=(r, E)` (GLM-5.x only): load only the routed experts expert-parallel rank r of E holds
    (`models.glm5.checkpoint.load_checkpoint`); other models have no routed experts to split and ignore it.
    `overrides`: GLM-5.x config fields to change at load, e.g. implementation knobs such as `indexer_fp8`
    (models/glm5/config.py); refused for other models.
    """
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForTokenClassification

    path: Path = resolve_model_path(name_or_path)
    torch_dtype = to_dtype(dtype)
    if model_type(path) == "glm_moe_dsa":  # GLM-5.x: our own implementation (models/glm5), same contract
        from models.glm5 import load_hf

        if role not in ("policy", "value"):
            raise ValueError(f"role must be 'policy' or 'value', got {role!r}")
        return load_hf(path, role=role, dtype=torch_dtype, device=device, expert_shard=expert_shard,
                       **(overrides or {}))
    if overrides:
        raise ValueError(f"model overrides {sorted(overrides)} are for GLM-5.x models; {path} is not one")
    if role == "policy":
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype)
    elif role == "value":
        config = AutoConfig.from_pretrained(path)
        is_critic_checkpoint = any(a.endswith("ForTokenClassification") for a in (config.architectures or []))
        config.num_labels = 1
        config.classifier_dropout = 0.0  # dropout on a regression head only adds noise to value targets
        model = AutoModelForTokenClassification.from_pretrained(path, config=config, dtype=torch_dtype)
        if not is_critic_checkpoint:
            with torch.no_grad():
                model.score.weight.zero_()
                if model.score.bias is not None:
                    model.score.bias.zero_()
    else:
        raise ValueError(f"role must be 'policy' or 'value', got {role!r}")
    model.config.use_cache = False
    return model.to(device)


def supports_packed_sequences(model: nn.Module) -> bool:
    """Whether `model` keeps the samples of a packed row apart (models/batching.py): transformers' models that
    build their attention mask with `masking_utils.create_causal_mask` read sample boundaries from the position
    ids when no attention mask is given, and so does GLM-5.2 (models.glm5: each query's keys are bounded below by
    its sample's first token, in the dense, sparse and masked attention paths and in the indexer's top-k)."""
    import sys

    if type(model).__module__.startswith("models.glm5."):
        return True
    module = sys.modules.get(type(model).__module__)
    if module is None or not type(model).__module__.startswith("transformers."):
        return False
    return getattr(module, "create_causal_mask", None) is not None
