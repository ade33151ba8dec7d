"""GLM-5.2 backbone, causal LM (policy) and value model (critic).

Model level (docs/GLM52.md §4.1): h⁰ = E[ids]; h^{ℓ+1} = DecoderLayer_ℓ(h^ℓ, carry) for ℓ < N, where `carry` is the
selection of the most recent full-indexer layer (IndexShare); h_out = RMSNorm(h^N); logits = h_out W_lmᵀ.

**Train = rollout replay.** `indexer_topk` ({full layer index: [B, S, k] key indices, −1 = empty slot}) and
`routed_experts` ({MoE layer index: [B, S, k_e] expert ids}) replace the model's own choices in those layers;
shared layers follow their full layer's (replayed) selection. Key indices live on the cache axis: for a
training forward without cache and without left padding that is the token's position in the sequence (0-based),
so whatever an engine reports (SGLang: `--enable-return-indexer-topk`) must be mapped to sequence positions
first. Entries may be int32 or int64, in any width; −1, keys after the query and padding keys are ignored;
entries must not repeat (a repeated key would be attended twice). A row of −1 only is not replayed: that query
selects its keys itself (a partial replay, of the rows whose choice could differ: rollout/indexer_replay.py);
such a replay may also come sparse, as `IndexerRows` (models/glm5/indexer_rows.py), never made dense.
With `return_routing=True` the output carries the same two dicts as computed (or replayed), canonicalised: every
slot the query could not attend to is −1, and layers whose keys all fit in top-k list their full causal prefix.

`return_routing="experts"`: the expert ids only (what an engine reports for replay; the indexer's selections are
large and are not materialised).

**Gradient checkpointing** recomputes each layer in the backward; the recompute *replays* the selections and
expert ids of the first pass (docs/GLM52.md §4.4: never re-select during recompute, a flip would change the graph).

**Cache.** `use_cache=True` (or a `cache=`/`past_key_values=` object: our `Glm5Cache` or transformers'
`DynamicCache`) stores each layer's latent [c_kv ; k_r] (576 wide for GLM-5.2) and each full layer's indexer keys; `attention_mask` must then
cover cached + new tokens ([B, T], left padding allowed), as transformers expects. MTP does not use the cache.

Parameter names equal the HF checkpoint names; the MTP layer sits at `model.layers.N` (the policy only).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from models.glm5.attention import AttnContext, materialize_selection
from models.glm5.checkpoint import load_checkpoint, save_hf
from models.glm5.config import Glm5Config
from models.glm5.decoder import DecoderLayer, Glm5Cache
from models.glm5.indexer import Indexer
from models.glm5.indexer_rows import IndexerRows
from models.glm5.layers import RMSNorm, rope_angles
from models.glm5.moe import Router
from models.glm5.mtp import MTPLayer, MTPLoss, chunked_head, head_ce_sum, mtp_loss


@dataclass
class Glm5ModelOutput:
    last_hidden_state: torch.Tensor
    past_key_values: object | None = None
    indexer_topk: dict[int, torch.Tensor] | None = None
    routed_experts: dict[int, torch.Tensor] | None = None
    indexer_loss: torch.Tensor | None = None  # mean over full layers of the mean per-token KL
    # {full layer: [B, S] top-k margin} where the layer ran its indexer (`indexer_margins=True`; Indexer.select)
    indexer_margins: dict[int, torch.Tensor] | None = None

    @property
    def cache(self):
        return self.past_key_values


@dataclass
class Glm5CausalLMOutput(Glm5ModelOutput):
    logits: torch.Tensor | None = None
    loss: torch.Tensor | None = None
    mtp: MTPLoss | None = None


def packed_starts(position_ids: torch.Tensor, query_index: torch.Tensor) -> torch.Tensor | None:
    """[B, S] the key index where each query's sample begins, for a packed row (models/batching.py: samples end to
    end, positions restarting at 0 for each, no attention mask); None when every row is one sample."""
    start = (query_index - position_ids).clamp(min=0)
    return start if bool(start.any()) else None


def init_weights(module: nn.Module, std: float) -> None:
    """Random init for a fresh model: normal(0, std) matrices and embeddings, unit norm gains, zero biases and
    zero router bias."""
    for m in module.modules():
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, 0.0, std)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Embedding):
            nn.init.normal_(m.weight, 0.0, std)
        elif isinstance(m, (RMSNorm, nn.LayerNorm)):
            nn.init.ones_(m.weight)
            if getattr(m, "bias", None) is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, Router):
            nn.init.normal_(m.weight, 0.0, std)
            nn.init.zeros_(m.e_score_correction_bias)


class Glm5Model(nn.Module):
    """The backbone: embeddings, N decoder layers (+ the MTP layers, policy only), final norm."""

    def __init__(self, config: Glm5Config, with_mtp: bool = True):
        super().__init__()
        self.config = config
        n = config.num_hidden_layers
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        layers = [DecoderLayer(config, i) for i in range(n)]
        if with_mtp:
            layers += [MTPLayer(config, n + j) for j in range(config.num_nextn_predict_layers)]
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.gradient_checkpointing = False

    def forward(self, input_ids: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, cache=None, past_key_values=None,
                inputs_embeds: torch.Tensor | None = None, use_cache: bool | None = None,
                indexer_topk: dict[int, torch.Tensor] | IndexerRows | None = None,
                routed_experts: dict[int, torch.Tensor] | None = None, return_routing: bool = False,
                indexer_loss: str | None = None, indexer_margins: bool = False,
                return_dict: bool = True) -> Glm5ModelOutput:
        """input_ids [B, S] (or inputs_embeds [B, S, D]); attention_mask [B, T] 1/0 over cached + new tokens;
        position_ids [B, S] RoPE positions (default: cache length + arange(S)); see the module docstring for
        the cache and replay arguments. `indexer_loss`: None, "dense" or "sparse" (DSA warm-up KL).
        `indexer_margins`: report each full layer's top-k margins (Indexer.select) where it ran its indexer."""
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("give exactly one of input_ids and inputs_embeds")
        h = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        b, s = h.shape[:2]
        cache = cache if cache is not None else past_key_values
        if cache is None and (use_cache or (use_cache is None and self.config.use_cache and not self.training)):
            cache = Glm5Cache()
        past = cache.get_seq_length() if cache is not None else 0
        # a sequence-parallel chunk (models/glm5/sequence_parallel.py) sees keys after its own tokens too
        chunk = hasattr(cache, "total_keys")
        keys = cache.total_keys if chunk else past + s
        query_index = (past + torch.arange(s, device=h.device)).expand(b, s)
        # a packed row (given positions, no mask, no cache but a sequence chunk's); read only then: a host sync
        query_start = (packed_starts(position_ids, query_index)
                       if position_ids is not None and attention_mask is None and (past == 0 or chunk) else None)
        if position_ids is None:
            position_ids = query_index
        key_mask = None
        if attention_mask is not None:
            if attention_mask.shape != (b, keys):
                raise ValueError(f"attention_mask must be [B, cached + new] = {(b, keys)}, "
                                 f"got {tuple(attention_mask.shape)}")
            key_mask = None if bool(attention_mask.bool().all()) else attention_mask.bool()
        cos, sin = rope_angles(position_ids, self.config.qk_rope_head_dim, self.config.rope_theta)
        ctx = AttnContext(cos, sin, query_index, key_mask, cache, len(self.layers), indexer_loss,
                          query_start=query_start, margins={} if indexer_margins else None)

        n = self.config.num_hidden_layers
        if isinstance(indexer_topk, IndexerRows):
            indexer_topk = indexer_topk.to(h.device)
            replay_of = indexer_topk.layer
        else:
            replay_of = (indexer_topk or {}).get
        routed_experts = routed_experts or {}
        topk_out, experts_out, losses = {}, {}, []
        carry = None
        for i, layer in enumerate(self.layers[:n]):
            replay_t = replay_of(i) if layer.has_indexer else None
            replay_e = routed_experts.get(i) if layer.is_moe else None
            if isinstance(replay_t, torch.Tensor):  # engines hand back int32; gather needs int64
                replay_t = replay_t.to(device=h.device, dtype=torch.long)
            record: dict = {}
            if self.gradient_checkpointing and self.training and torch.is_grad_enabled():
                h, loss_sum, loss_n = checkpoint(self._run_layer, layer, h, ctx, carry, replay_t, replay_e, record,
                                                 use_reentrant=False)
            else:
                h, loss_sum, loss_n = self._run_layer(layer, h, ctx, carry, replay_t, replay_e, record)
            if layer.has_indexer:
                carry = record["selection"]
                if return_routing and return_routing != "experts":
                    topk_out[i] = materialize_selection(carry, query_index, key_mask, record["num_keys"],
                                                        query_start)
                if loss_sum is not None:
                    losses.append(loss_sum / loss_n.clamp(min=1))
            if layer.is_moe and return_routing:
                experts_out[i] = record["experts"]
        return Glm5ModelOutput(
            last_hidden_state=self.norm(h), past_key_values=cache,
            indexer_topk=topk_out if return_routing else None,
            routed_experts=experts_out if return_routing else None,
            indexer_loss=torch.stack(losses).mean() if losses else None, indexer_margins=ctx.margins)

    @staticmethod
    def _run_layer(layer, h, ctx, carry, replay_t, replay_e, record):
        """One layer; under checkpoint the backward's recompute finds `record` filled and replays it."""
        if "selection" in record:
            replay_t = record["selection"] if layer.has_indexer else replay_t
            replay_e = record["experts"]
        h, attn, experts = layer(h, ctx, carry=carry, replay_topk=replay_t, replay_experts=replay_e)
        if "selection" not in record:
            record.update(selection=attn.selection, experts=experts, num_keys=attn.latents.shape[1])
        loss_sum, loss_n = attn.indexer_loss if attn.indexer_loss is not None else (None, None)
        return h, loss_sum, loss_n


class _Glm5Base(nn.Module):
    """What our trainers, engines and `models.load_model` expect of a model, HF-style."""

    config: Glm5Config
    model: Glm5Model

    def _post_init(self, init: bool) -> None:
        if init:
            init_weights(self, self.config.initializer_range)
        self.set_indexer_trainable(False)

    def get_decoder(self) -> Glm5Model:
        return self.model

    def get_input_embeddings(self) -> nn.Embedding:
        return self.model.embed_tokens

    def set_indexer_trainable(self, trainable: bool) -> None:
        """The indexer is frozen by default (its selection is not differentiable; only the DSA warm-up loss
        trains it). Optimisers built from `requires_grad` parameters then leave it alone."""
        for m in self.modules():
            if isinstance(m, Indexer):
                m.requires_grad_(trainable)

    def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs: dict | None = None) -> None:
        if gradient_checkpointing_kwargs and gradient_checkpointing_kwargs.get("use_reentrant", False):
            raise ValueError("only non-reentrant checkpointing is supported")
        self.model.gradient_checkpointing = True

    def gradient_checkpointing_disable(self) -> None:
        self.model.gradient_checkpointing = False

    @property
    def device(self) -> torch.device:
        return next(self.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return self.model.embed_tokens.weight.dtype

    def save_pretrained(self, folder: str | Path, state_dict: dict | None = None, safe_serialization: bool = True,
                        max_shard_size: int | str = "5GB", **_) -> None:
        """HF-format folder: config.json + (sharded) safetensors with GLM-5.2 tensor names."""
        save_hf(self, folder, state_dict=state_dict, max_shard_size=max_shard_size)

    @classmethod
    def from_pretrained(cls, folder: str | Path, dtype: torch.dtype | str = torch.float32,
                        device: str | torch.device = "cpu", strict: bool = True,
                        expert_shard: tuple[int, int] | None = None, **config_overrides):
        return load_checkpoint(cls, folder, dtype=dtype, device=device, strict=strict, expert_shard=expert_shard,
                               **config_overrides)


class Glm5ForCausalLM(_Glm5Base):
    """The policy: backbone (+ MTP layer) and an untied LM head."""

    role = "policy"

    def __init__(self, config: Glm5Config, init: bool = True):
        super().__init__()
        self.config = config
        self.model = Glm5Model(config, with_mtp=True)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self._post_init(init)

    def get_output_embeddings(self) -> nn.Linear:
        return self.lm_head

    def forward(self, input_ids: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, cache=None, past_key_values=None,
                inputs_embeds: torch.Tensor | None = None, use_cache: bool | None = None,
                logits_to_keep: int | torch.Tensor | None = 0, labels: torch.Tensor | None = None,
                indexer_topk: dict[int, torch.Tensor] | IndexerRows | None = None,
                routed_experts: dict[int, torch.Tensor] | None = None, return_routing: bool = False,
                indexer_loss: str | None = None, mtp_steps: int = 0, mtp_tv_weight: float = 0.0,
                loss_chunk_rows: int = 1024, indexer_margins: bool = False,
                return_dict: bool = True) -> Glm5CausalLMOutput:
        """HF-style causal LM forward. `logits_to_keep`: 0 = every position, n > 0 = the last n, a tensor = those
        positions, None = no logits (loss-only training calls). `labels` [B, S] (−100 ignored): mean next-token
        CE, computed in checkpointed row chunks of the LM head. `mtp_steps` > 0 (full-sequence training only): the
        MTP loss of `mtp_steps` shared-parameter steps in `.mtp` (optionally with the TV loss, `mtp_tv_weight`).
        Use `models.policy_logprobs` for RL: it runs `get_decoder()` and the head only at action positions."""
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                         cache=cache, past_key_values=past_key_values, inputs_embeds=inputs_embeds,
                         use_cache=use_cache, indexer_topk=indexer_topk, routed_experts=routed_experts,
                         return_routing=return_routing, indexer_loss=indexer_loss, indexer_margins=indexer_margins)
        h = out.last_hidden_state
        logits = None
        if logits_to_keep is not None:
            if isinstance(logits_to_keep, torch.Tensor):
                logits = self.lm_head(h[:, logits_to_keep])
            else:
                logits = self.lm_head(h[:, -logits_to_keep:] if logits_to_keep > 0 else h)
        loss = None
        if labels is not None:
            if hasattr(cache, "total_keys"):
                raise ValueError("labels= shifts within the rows given: a sequence-parallel chunk's last position "
                                 "predicts the next chunk's first token (use models.policy_logprobs(sequence=))")
            y = labels[:, 1:]
            keep = y != -100
            parts = chunked_head(head_ce_sum, self.lm_head, h[:, :-1][keep], y[keep], rows=loss_chunk_rows)
            loss = sum(parts, h.new_zeros((), dtype=torch.float32)) / keep.sum().clamp(min=1)
        mtp = None
        if mtp_steps > 0:
            if input_ids is None or cache is not None or past_key_values is not None:
                raise ValueError("the MTP loss needs input_ids and a full-sequence forward (no prior cache)")
            b, s = input_ids.shape
            pos = position_ids if position_ids is not None else torch.arange(s, device=h.device).expand(b, s)
            if attention_mask is None and packed_starts(pos, torch.arange(s, device=h.device).expand(b, s)) is not None:
                raise ValueError("the MTP loss takes one sample a row, not packed rows")
            mtp = mtp_loss(self.model, self.lm_head, h, input_ids, attention_mask, pos, mtp_steps, mtp_tv_weight,
                           rows=loss_chunk_rows)
        return Glm5CausalLMOutput(**vars(out), logits=logits, loss=loss, mtp=mtp)


@dataclass
class Glm5ValueOutput:
    logits: torch.Tensor  # [B, S, 1] values
    last_hidden_state: torch.Tensor
    past_key_values: object | None = None


class Glm5ForValue(_Glm5Base):
    """The critic: the same backbone (no MTP) and a scalar head `score` (HF TokenClassification naming). A fresh
    head is zero, so V ≡ 0 at the start, as `models.load_model` does for HF critics."""

    role = "value"

    def __init__(self, config: Glm5Config, init: bool = True):
        super().__init__()
        self.config = config
        self.model = Glm5Model(config, with_mtp=False)
        self.score = nn.Linear(config.hidden_size, 1)
        self._post_init(init)
        with torch.no_grad():
            self.score.weight.zero_()
            self.score.bias.zero_()

    def forward(self, input_ids: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, inputs_embeds: torch.Tensor | None = None,
                indexer_topk: dict[int, torch.Tensor] | IndexerRows | None = None,
                routed_experts: dict[int, torch.Tensor] | None = None, use_cache: bool | None = False,
                cache=None, return_dict: bool = True) -> Glm5ValueOutput:
        """`cache`: a KV cache, or a sequence-parallel chunk (models/glm5/sequence_parallel.py)."""
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                         inputs_embeds=inputs_embeds, use_cache=use_cache, indexer_topk=indexer_topk,
                         routed_experts=routed_experts, cache=cache)
        h = out.last_hidden_state
        return Glm5ValueOutput(logits=self.score(h), last_hidden_state=h, past_key_values=out.past_key_values)


def load_hf(folder: str | Path, role: str = "policy", dtype: torch.dtype | str = torch.float32,
            device: str | torch.device = "cpu", strict: bool = True, expert_shard: tuple[int, int] | None = None,
            **config_overrides) -> _Glm5Base:
    """Our policy (role "policy") or critic (role "value") from an HF-format GLM-5.x folder
    (`checkpoint.load_checkpoint` says what is filled in and what is an error)."""
    classes = {"policy": Glm5ForCausalLM, "value": Glm5ForValue}
    if role not in classes:
        raise ValueError(f"role must be one of {sorted(classes)}, got {role!r}")
    return classes[role].from_pretrained(folder, dtype=dtype, device=device, strict=strict,
                                         expert_shard=expert_shard, **config_overrides)
