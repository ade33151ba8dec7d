"""`Glm5Config`: every field of GLM-5.2's config.json (`model_type: glm_moe_dsa`), plus a few implementation knobs.

The dataclass defaults are GLM-5.2's values (docs/GLM52.md §2), so `Glm5Config()` describes the 744B model. Fields fall in
two groups:

* **HF fields** are read from and written to config.json under their original names, so transformers'
  `GlmMoeDsaConfig` and SGLang read what we write (`to_hf`) and we read what they write (`from_hf`). Keys we do not
  model (e.g. `quantization_config`, `transformers_version`) are kept in `extra` and written back unchanged.
* **Implementation knobs** (`metadata={"hf": False}`) change how we compute, not what the checkpoint is: the eps
  of the q/kv latent norms (a live discrepancy between implementations, docs/GLM52.md §4.2), the streaming chunk sizes.
  They are never written to config.json.

Derived per-layer schedules:

* `indexer_types[i]` ("full" runs the lightning indexer, "shared" reuses the last full layer's top-k). An explicit
  list wins; else `index_topk_pattern` (one char per layer, F/S, or a list); else layer i is full iff
  max(i − offset + 1, 0) mod freq == 0. This is transformers' and SGLang's rule; when config.json lacks the fields,
  transformers defaults to freq = 1 (every layer full) and offset = 2, and so does `from_hf`. For GLM-5.2
  (freq 4, offset 3) the full layers are 0, 1, 2, 6, 10, …, 74.
* `mlp_layer_types[i]` ("dense" SwiGLU or "sparse" MoE): explicit list wins; else sparse iff
  i ≥ first_k_dense_replace and i mod moe_layer_freq == 0 (DeepSeek/SGLang's rule; transformers ignores
  moe_layer_freq, which is 1 for every GLM release, where the two agree). MTP layers are always MoE with an indexer.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# transformers' defaults for the IndexShare fields when a config.json does not carry them (GLM-5 / 5.1 files).
HF_DEFAULT_INDEX_TOPK_FREQ = 1
HF_DEFAULT_INDEX_SKIP_TOPK_OFFSET = 2


def _impl(default):
    return field(default=default, metadata={"hf": False})


@dataclass
class Glm5Config:
    # ---- identity -------------------------------------------------------------------------------------------
    architectures: list[str] = field(default_factory=lambda: ["GlmMoeDsaForCausalLM"])
    model_type: str = "glm_moe_dsa"
    dtype: str = "bfloat16"
    # ---- sizes ----------------------------------------------------------------------------------------------
    vocab_size: int = 154880
    hidden_size: int = 6144
    num_hidden_layers: int = 78
    intermediate_size: int = 12288
    max_position_embeddings: int = 1048576
    # ---- MLA ------------------------------------------------------------------------------------------------
    num_attention_heads: int = 64
    num_key_value_heads: int = 64  # nominal: MLA caches one latent per token
    q_lora_rank: int = 2048
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 192
    qk_rope_head_dim: int = 64
    qk_head_dim: int | None = None  # derived: nope + rope
    v_head_dim: int = 256
    head_dim: int | None = 192  # GLM-5.2 writes 192 (= nope); misleading, never used (docs/GLM52.md §2)
    attention_bias: bool = False
    attention_dropout: float = 0.0
    rope_parameters: dict = field(default_factory=lambda: {"rope_theta": 8000000.0, "rope_type": "default"})
    rope_interleave: bool = True
    indexer_rope_interleave: bool = True
    # ---- DSA lightning indexer and IndexShare ---------------------------------------------------------------
    index_n_heads: int = 32
    index_head_dim: int = 128
    index_topk: int = 2048
    index_topk_freq: int = 4
    index_skip_topk_offset: int = 3
    index_topk_pattern: str | list | None = None
    indexer_types: list[str] | None = None  # derived when absent (module docstring)
    index_share_for_mtp_iteration: bool = True
    # ---- MLP / MoE ------------------------------------------------------------------------------------------
    first_k_dense_replace: int = 3
    moe_layer_freq: int = 1
    mlp_layer_types: list[str] | None = None  # derived when absent
    moe_intermediate_size: int = 2048
    n_routed_experts: int = 256
    num_experts_per_tok: int = 8
    n_shared_experts: int = 1
    n_group: int = 1
    topk_group: int = 1
    scoring_func: str = "sigmoid"
    topk_method: str = "noaux_tc"
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 2.5
    moe_router_dtype: str | None = "float32"
    hidden_act: str = "silu"
    # ---- MTP ------------------------------------------------------------------------------------------------
    num_nextn_predict_layers: int = 1
    # ---- misc -----------------------------------------------------------------------------------------------
    rms_norm_eps: float = 1e-5
    initializer_range: float = 0.02
    tie_word_embeddings: bool = False
    use_cache: bool = True
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = field(default_factory=lambda: [154820, 154827, 154829])
    pad_token_id: int | None = 154820
    extra: dict = field(default_factory=dict, metadata={"hf": False})  # unmodelled config.json keys, round-tripped
    # ---- implementation knobs (never written to config.json) ------------------------------------------------
    latent_norm_eps: float = _impl(1e-6)  # q_a/kv_a RMSNorm eps: transformers & NeMo 1e-6, SGLang & prime-rl 1e-5
    indexer_norm_eps: float = _impl(1e-6)  # indexer k_norm (LayerNorm) eps, the same everywhere
    # score the indexer as SGLang's DSA kernels do (models.glm5.indexer.fp8_act_quant): q and k rounded through
    # bf16 and per-row FP8 e4m3, head gates through bf16; a trainer that should select what the engine selected
    indexer_fp8: bool = _impl(False)
    attn_query_chunk: int = _impl(256)  # queries per sparse-attention chunk (gathered KV: chunk × topk × 576)
    moe_impl: str = _impl("auto")  # "auto": grouped GEMMs on CUDA, a loop over experts on CPU; "loop"; "grouped"
    sparse_attn_kernel: str = _impl("auto")  # "auto": fused Triton on CUDA in bf16/fp16, else torch; "torch"
    # with "auto", a GPU forward without a KV cache over at most this many keys runs SDPA with the selection as a
    # boolean mask instead (faster there: models.glm5.attention.MLA.attend_masked); 0 = never
    masked_attn_max_keys: int = _impl(12288)
    indexer_query_chunk: int = _impl(256)  # queries per indexer scoring chunk (torch path)
    indexer_key_block: int = _impl(4096)  # keys per indexer scoring block (scores: q_chunk × heads × block)
    # the same with the fused scores kernel, which writes no per-head scores (q_chunk × block): larger blocks, far
    # fewer top-k merges and launches (docs/BENCHMARKS.md: 8K 27.1k → 34.2k tokens/s on the H200)
    indexer_fused_query_chunk: int = _impl(2048)
    indexer_fused_key_block: int = _impl(8192)

    def __post_init__(self):
        derived = self.qk_nope_head_dim + self.qk_rope_head_dim
        if self.qk_head_dim is not None and self.qk_head_dim != derived:
            raise ValueError(f"qk_head_dim {self.qk_head_dim} != qk_nope_head_dim + qk_rope_head_dim = {derived}")
        self.qk_head_dim = derived
        if self.indexer_types is None:
            self.indexer_types = derive_indexer_types(self.num_hidden_layers, self.index_topk_freq,
                                                      self.index_skip_topk_offset, self.index_topk_pattern)
        self.indexer_types = list(self.indexer_types)
        if self.mlp_layer_types is None:
            self.mlp_layer_types = ["sparse" if (i >= self.first_k_dense_replace and i % max(self.moe_layer_freq, 1)
                                                 == 0 and self.n_routed_experts > 0) else "dense"
                                    for i in range(self.num_hidden_layers)]
        self.mlp_layer_types = list(self.mlp_layer_types)
        self.validate()

    # ---- checks ---------------------------------------------------------------------------------------------
    def validate(self) -> None:
        n = self.num_hidden_layers
        if len(self.indexer_types) != n or set(self.indexer_types) - {"full", "shared"}:
            raise ValueError(f"indexer_types must be {n} entries of 'full'/'shared', got {self.indexer_types}")
        if n and self.indexer_types[0] != "full":
            raise ValueError("layer 0 must be a 'full' indexer layer: a shared layer needs an earlier full layer")
        if len(self.mlp_layer_types) != n or set(self.mlp_layer_types) - {"dense", "sparse"}:
            raise ValueError(f"mlp_layer_types must be {n} entries of 'dense'/'sparse', got {self.mlp_layer_types}")
        rope_type = self.rope_parameters.get("rope_type", self.rope_parameters.get("type", "default"))
        if rope_type != "default":
            raise ValueError(f"rope_type {rope_type!r} is not supported (GLM-5.x uses plain RoPE, no scaling)")
        if self.scoring_func != "sigmoid" or self.topk_method != "noaux_tc":
            raise ValueError("only GLM/DeepSeek-V3 routing is supported: scoring_func='sigmoid', "
                             f"topk_method='noaux_tc' (got {self.scoring_func!r}, {self.topk_method!r})")
        if self.n_routed_experts % self.n_group or self.topk_group > self.n_group:
            raise ValueError("n_routed_experts must divide into n_group groups and topk_group <= n_group")
        if self.qk_rope_head_dim % 2 or self.index_head_dim < self.qk_rope_head_dim:
            raise ValueError("qk_rope_head_dim must be even and <= index_head_dim (the indexer ropes its first "
                             "qk_rope_head_dim dims)")
        if self.hidden_act != "silu":
            raise ValueError(f"hidden_act {self.hidden_act!r} is not supported (GLM uses silu)")
        if self.tie_word_embeddings:
            raise ValueError("GLM-5.x has untied embeddings; tie_word_embeddings=True is not supported")

    # ---- derived views --------------------------------------------------------------------------------------
    @property
    def rope_theta(self) -> float:
        return float(self.rope_parameters["rope_theta"])

    @property
    def num_mtp_layers(self) -> int:
        return self.num_nextn_predict_layers

    @property
    def full_indexer_layers(self) -> list[int]:
        """Backbone layers that run their own indexer (the MTP layer, index N, always does as well)."""
        return [i for i, t in enumerate(self.indexer_types) if t == "full"]

    @property
    def moe_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.mlp_layer_types) if t == "sparse"]

    def layer_has_indexer(self, i: int) -> bool:
        return i >= self.num_hidden_layers or self.indexer_types[i] == "full"

    def layer_is_moe(self, i: int) -> bool:
        return i >= self.num_hidden_layers or self.mlp_layer_types[i] == "sparse"

    # ---- config.json ----------------------------------------------------------------------------------------
    @classmethod
    def hf_field_names(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls) if f.metadata.get("hf", True)]

    @classmethod
    def from_hf(cls, source: dict | str | Path, **overrides) -> "Glm5Config":
        """From a config.json dict, a config.json path or a folder holding one. `overrides` set any field,
        implementation knobs included. Keys we do not model are kept in `extra`."""
        if not isinstance(source, dict):
            path = Path(source)
            source = json.loads((path / "config.json" if path.is_dir() else path).read_text())
        raw = dict(source)
        if raw.get("model_type", "glm_moe_dsa") != "glm_moe_dsa":
            raise ValueError(f"not a GLM-5.x config: model_type={raw.get('model_type')!r}")
        if "rope_parameters" not in raw:  # older files: top-level rope_theta (+ rope_scaling)
            scaling = raw.pop("rope_scaling", None) or {}
            raw["rope_parameters"] = {"rope_theta": raw.pop("rope_theta", 10000.0),
                                      "rope_type": scaling.get("rope_type", scaling.get("type", "default"))}
        # transformers' defaults when the IndexShare fields are missing (not ours, which are GLM-5.2's)
        raw.setdefault("index_topk_freq", HF_DEFAULT_INDEX_TOPK_FREQ)
        raw.setdefault("index_skip_topk_offset", HF_DEFAULT_INDEX_SKIP_TOPK_OFFSET)
        raw.setdefault("index_topk_pattern", None)
        if raw.get("torch_dtype") and "dtype" not in raw:
            raw["dtype"] = raw.pop("torch_dtype")
        if "num_experts" in raw and "n_routed_experts" not in raw:
            raw["n_routed_experts"] = raw.pop("num_experts")
        names = set(cls.hf_field_names())
        known = {k: v for k, v in raw.items() if k in names}
        extra = {k: v for k, v in raw.items() if k not in names}
        return cls(**known, extra={**extra, **overrides.pop("extra", {})}, **overrides)

    def to_hf(self) -> dict[str, Any]:
        """config.json dict: every HF field under its original name, `indexer_types` always explicit (SGLang and
        prime-rl otherwise fall back to different schedules, docs/GLM52.md §4.5), plus the round-tripped extras."""
        out = {name: getattr(self, name) for name in self.hf_field_names()}
        out = {**self.extra, **out}
        return json.loads(json.dumps(out))  # plain JSON types (tuples → lists), a deep copy

    def save(self, folder: str | Path) -> None:
        Path(folder).mkdir(parents=True, exist_ok=True)
        (Path(folder) / "config.json").write_text(json.dumps(self.to_hf(), indent=2, sort_keys=True) + "\n")

    def replace(self, **changes) -> "Glm5Config":
        """A copy with some fields changed; the schedules are re-derived unless given."""
        values = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        if any(k in changes for k in ("num_hidden_layers", "index_topk_freq", "index_skip_topk_offset",
                                      "index_topk_pattern")):
            values["indexer_types"] = None
        if any(k in changes for k in ("num_hidden_layers", "first_k_dense_replace", "moe_layer_freq",
                                      "n_routed_experts")):
            values["mlp_layer_types"] = None
        values.update(changes)
        return Glm5Config(**values)


def derive_indexer_types(num_layers: int, freq: int | None, offset: int | None,
                         pattern: str | list | None = None) -> list[str]:
    """Per-layer indexer schedule from `index_topk_pattern`, or else from freq/offset (module docstring)."""
    if pattern is not None:
        if isinstance(pattern, str):
            table = {"F": "full", "S": "shared"}
            if set(pattern) - set(table):
                raise ValueError(f"index_topk_pattern must be F/S characters, got {pattern!r}")
            return [table[c] for c in pattern]
        return list(pattern)
    freq = max(freq if freq is not None else HF_DEFAULT_INDEX_TOPK_FREQ, 1)
    offset = offset if offset is not None else HF_DEFAULT_INDEX_SKIP_TOPK_OFFSET
    return ["full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(num_layers)]
