"""HF-format interop for GLM-5.2: sharded safetensors + model.safetensors.index.json + config.json, in and out.

Tensor names are GLM-5.2's checkpoint names (docs/GLM52.md §5), which are also our parameter names:
`model.embed_tokens.weight`, `model.layers.{i}.self_attn.{q_a_proj,q_a_layernorm,q_b_proj,kv_a_proj_with_mqa,
kv_a_layernorm,kv_b_proj,o_proj}.weight`, `…self_attn.indexer.{wq_b,wk,k_norm,weights_proj}.*` on full-indexer
layers only (shared layers carry none), `…mlp.{gate,up,down}_proj.weight` (dense layers), `…mlp.gate.weight`,
`…mlp.gate.e_score_correction_bias` (fp32), `…mlp.shared_experts.*`, `…mlp.experts.{e}.{gate,up,down}_proj.weight`
(one tensor per expert; transformers fuses them in memory and splits them again on save), `model.norm.weight`,
`lm_head.weight`, and the MTP layer at `model.layers.{N}.*` with `enorm`, `hnorm`, `eh_proj`,
`shared_head.norm` (transformers ignores it on load). A critic adds `score.{weight,bias}` and has no lm_head/MTP.

Loading also accepts GLM's block-FP8 checkpoints (`weight_scale_inv` [⌈out/128⌉, ⌈in/128⌉] next to an e4m3
`weight`): each block is de-quantised to the requested dtype, w = w_fp8 · scale_inv.
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import torch
from torch import nn

from models.glm5.config import Glm5Config

log = logging.getLogger(__name__)

INDEX_FILE = "model.safetensors.index.json"
POLICY_ARCH = "GlmMoeDsaForCausalLM"
CRITIC_ARCH = "GlmMoeDsaForTokenClassification"
_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def _parse_size(size: int | str) -> int:
    if isinstance(size, int):
        return size
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]?B)\s*", size.upper())
    if not m:
        raise ValueError(f"bad shard size {size!r} (e.g. '5GB', '200MB' or bytes)")
    return int(float(m.group(1)) * {"B": 1, "KB": 2**10, "MB": 2**20, "GB": 2**30}[m.group(2)])


def _is_critic(model: nn.Module) -> bool:
    return hasattr(model, "score") and not hasattr(model, "lm_head")


def hf_config(model: nn.Module) -> dict:
    """The config.json of `model` in GLM-5.2's HF form: architecture, the weights' dtype, never quantised."""
    config: Glm5Config = model.config
    hf = config.to_hf()
    hf["architectures"] = [CRITIC_ARCH if _is_critic(model) else POLICY_ARCH]
    weight_dtype = model.get_input_embeddings().weight.dtype
    hf["dtype"] = _DTYPE_NAMES.get(weight_dtype, str(weight_dtype).replace("torch.", ""))
    hf.pop("quantization_config", None)  # what we write is never quantised
    if _is_critic(model):
        hf["num_labels"] = 1
    return hf


def save_hf(model: nn.Module, folder: str | Path, state_dict: dict[str, torch.Tensor] | None = None,
            max_shard_size: int | str = "5GB") -> None:
    """Write config.json and the weights, sharded when they exceed `max_shard_size` (then with the index file).
    `state_dict` (e.g. gathered from ZeRO-3 partitions) overrides the model's own tensors; it may omit buffers.
    Old *.safetensors in the folder are removed first (engines glob the folder)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    state = dict(model.state_dict())
    if state_dict is not None:
        unknown = set(state_dict) - set(state)
        if unknown:
            raise KeyError(f"state_dict has names the model does not: {sorted(unknown)[:5]}")
        state.update(state_dict)
    state = {k: v.detach().to("cpu").contiguous() for k, v in state.items()}
    for k in [k for k in state if k.endswith("e_score_correction_bias")]:
        state[k] = state[k].float()
    hf = hf_config(model)

    from safetensors.torch import save_file

    for old in list(folder.glob("*.safetensors")) + [folder / INDEX_FILE]:
        old.unlink(missing_ok=True)
    limit = _parse_size(max_shard_size)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name in sorted(state, key=_natural_key):
        nbytes = state[name].numel() * state[name].element_size()
        if shards[-1] and size + nbytes > limit:
            shards.append({})
            size = 0
        shards[-1][name] = state[name]
        size += nbytes
    if len(shards) == 1:
        save_file(shards[0], str(folder / "model.safetensors"), metadata={"format": "pt"})
    else:
        weight_map = {}
        for i, shard in enumerate(shards, start=1):
            fname = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, str(folder / fname), metadata={"format": "pt"})
            weight_map.update({name: fname for name in shard})
        total = sum(t.numel() * t.element_size() for t in state.values())
        (folder / INDEX_FILE).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map},
                                                    indent=2, sort_keys=True) + "\n")
    (folder / "config.json").write_text(json.dumps(hf, indent=2, sort_keys=True) + "\n")


def _natural_key(name: str):
    return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name)]


def checkpoint_files(folder: str | Path) -> dict[str, Path]:
    """tensor name → safetensors file, from the index when there is one."""
    folder = Path(folder)
    index = folder / INDEX_FILE
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: folder / fname for name, fname in weight_map.items()}
    from safetensors import safe_open

    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no safetensors weights in {folder}")
    out = {}
    for f in files:
        with safe_open(str(f), framework="pt") as handle:
            out.update({name: f for name in handle.keys()})
    return out


def dequantize_block_fp8(weight: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """w[r, c] = w_fp8[r, c] · scale_inv[r // br, c // bc], blocks br × bc = ⌈rows / scale rows⌉ × … (128 × 128)."""
    rows, cols = weight.shape
    br, bc = -(-rows // scale_inv.shape[0]), -(-cols // scale_inv.shape[1])
    scale = scale_inv.float().repeat_interleave(br, 0)[:rows].repeat_interleave(bc, 1)[:, :cols]
    return (weight.float() * scale).to(dtype)


def _fresh_value(name: str, like: torch.Tensor, std: float) -> torch.Tensor:
    """Init for a tensor the checkpoint lacks (the MTP layer in a transformers-written folder, a new value head):
    norm gains 1, biases and the value head 0, matrices normal(0, std) — as `init_weights` does."""
    t = torch.empty(like.shape, dtype=like.dtype)
    module_leaf = name.rsplit(".", 2)[-2] if name.count(".") >= 1 else name
    if name.startswith("score.") or name.endswith((".bias", "e_score_correction_bias")):
        return t.zero_()
    if "norm" in module_leaf:
        return t.fill_(1.0)
    return t.normal_(0.0, std)


def _set_tensor(model: nn.Module, name: str, value: torch.Tensor) -> None:
    prefix, _, leaf = name.rpartition(".")
    module = model.get_submodule(prefix) if prefix else model
    if leaf in module._parameters:
        old = module._parameters[leaf]
        module._parameters[leaf] = nn.Parameter(value, requires_grad=old.requires_grad)
    else:
        module._buffers[leaf] = value


_ROUTED_EXPERT = re.compile(r"(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.")


class AbsentExpert(nn.Module):
    """Stands in for a routed expert another rank holds (a sharded load): no parameters, never run. Expert
    parallelism (`expert_parallel.shard_experts`) then keeps only the rank's own experts."""

    def forward(self, *args, **kwargs):
        raise RuntimeError("this routed expert lives on another expert-parallel rank (the model was loaded "
                           "sharded: shard its experts before running it)")


def load_checkpoint(cls: type[nn.Module], folder: str | Path, dtype: torch.dtype | str = torch.float32,
                    device: str | torch.device = "cpu", strict: bool = True,
                    expert_shard: tuple[int, int] | None = None, **config_overrides) -> nn.Module:
    """A `cls` (our policy or critic class; its `role` says which) from an HF-format GLM-5.x folder.

    A critic built from a policy checkpoint drops lm_head and MTP and gets a zero value head; a policy from a
    checkpoint without the MTP layer (transformers drops it on save) gets a freshly initialised one (logged).
    Anything else missing or unexpected is an error unless strict=False. `config_overrides` set config fields,
    e.g. latent_norm_eps=1e-5 for SGLang parity. The class is passed in so that this module never imports the
    model module (which imports this one for `save_pretrained` / `from_pretrained`).

    `expert_shard=(r, E)`: read only the routed experts rank r of an expert-parallel group of E holds (experts
    [r·n/E, (r+1)·n/E) of every MoE layer); the others are never read nor allocated and stand as `AbsentExpert`
    until `shard_experts` drops them. At GLM-5.2's size that is what lets a rank load at all: its routed experts
    are 97% of the 744B parameters."""
    from safetensors import safe_open

    from models.dtypes import to_dtype

    role = cls.role
    dtype = to_dtype(dtype)
    folder = Path(folder)
    config = Glm5Config.from_hf(folder, **config_overrides)
    config.extra.pop("quantization_config", None)
    critic_ckpt = any(a.endswith("ForTokenClassification") for a in config.architectures)
    if role == "policy" and critic_ckpt:
        raise ValueError(f"{folder} is a critic checkpoint; load it with role='value'")
    with torch.device("meta"):
        model = cls(config, init=False)
    config.architectures = [CRITIC_ARCH if role == "value" else POLICY_ARCH]
    expected = model.state_dict(keep_vars=True)
    absent: set[str] = set()  # the routed experts (module paths) another rank loads
    if expert_shard is not None:
        rank, size = expert_shard
        n_local = config.n_routed_experts // size
        if size < 1 or config.n_routed_experts % size or not 0 <= rank < size:
            raise ValueError(f"expert_shard={expert_shard}: {config.n_routed_experts} routed experts cannot be "
                             f"split {size} ways for rank {rank}")
        for name in list(expected):
            m = _ROUTED_EXPERT.match(name)
            if m and not rank * n_local <= int(m.group(2)) < (rank + 1) * n_local:
                absent.add(f"{m.group(1)}.{m.group(2)}")
                del expected[name]
    files = checkpoint_files(folder)
    n = config.num_hidden_layers
    mtp_prefix = re.compile(r"model\.layers\.(\d+)\.")

    def ignorable(name: str) -> bool:
        if name.endswith("weight_scale_inv"):
            return True
        if role == "value" and not critic_ckpt:
            m = mtp_prefix.match(name)
            return name.startswith("lm_head.") or bool(m and int(m.group(1)) >= n)
        return False

    unexpected = [k for k in files if k not in expected and not ignorable(k)
                  and not ((m := _ROUTED_EXPERT.match(k)) and f"{m.group(1)}.{m.group(2)}" in absent)]
    by_file: dict[Path, list[str]] = {}
    for name in expected:
        if name in files:
            by_file.setdefault(files[name], []).append(name)
    for path, names in by_file.items():
        with safe_open(str(path), framework="pt") as handle:
            for name in names:
                t = handle.get_tensor(name)
                if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
                    scale_name = name + "_scale_inv"
                    if scale_name not in files:
                        raise ValueError(f"{name} is FP8 but {scale_name} is missing")
                    with safe_open(str(files[scale_name]), framework="pt") as sh:
                        t = dequantize_block_fp8(t, sh.get_tensor(scale_name), dtype)
                want = torch.float32 if name.endswith("e_score_correction_bias") else dtype
                if tuple(t.shape) != tuple(expected[name].shape):
                    raise ValueError(f"{name}: checkpoint shape {tuple(t.shape)} != "
                                     f"model {tuple(expected[name].shape)}")
                _set_tensor(model, name, t.to(want))
    missing = [k for k in expected if k not in files]
    allowed = [k for k in missing if k.startswith("score.") or (role == "policy" and (m := mtp_prefix.match(k))
                                                                  and int(m.group(1)) >= n)]
    other = sorted(set(missing) - set(allowed))
    if strict and (unexpected or other):
        raise ValueError(f"checkpoint {folder} does not match GLM-5 {role}: missing {other[:8]}"
                         f"{' …' if len(other) > 8 else ''}, unexpected {sorted(unexpected)[:8]}")
    if any(not k.startswith("score.") for k in allowed):
        log.warning("%s has no MTP layer (model.layers.%d.*): initialising it randomly", folder, n)
    for name in missing:
        want = torch.float32 if name.endswith("e_score_correction_bias") else dtype
        _set_tensor(model, name, _fresh_value(name, expected[name], config.initializer_range).to(want))
    for path in absent:
        owner, index = path.rsplit(".", 1)
        model.get_submodule(owner)[int(index)] = AbsentExpert()
    model.config.use_cache = False
    return model.to(device)
