"""One pre-norm decoder layer (MLA + dense MLP or MoE) and the KV cache for incremental decoding."""

from __future__ import annotations

import torch
from torch import nn

from models.glm5.attention import MLA, AttnContext, AttnOut, SharedKV
from models.glm5.config import Glm5Config
from models.glm5.layers import RMSNorm, SwiGLU
from models.glm5.moe import MoE


class DecoderLayer(nn.Module):
    """h ← h + MLA(RMSNorm(h));  h ← h + MLP(RMSNorm(h)), where MLP is SwiGLU on the first dense layers and the
    MoE elsewhere (and on MTP layers). Parameter names are GLM-5.2's checkpoint names (`self_attn.*`, `mlp.*`,
    `input_layernorm`, `post_attention_layernorm`, `mlp.experts.{e}.*`), so named_parameters() of our models are
    HF names and weight sync needs no renaming."""

    def __init__(self, config: Glm5Config, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.has_indexer = config.layer_has_indexer(layer_idx)
        self.is_moe = config.layer_is_moe(layer_idx)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = MLA(config, layer_idx, self.has_indexer)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MoE(config) if self.is_moe else SwiGLU(config.hidden_size, config.intermediate_size)

    def forward(self, h: torch.Tensor, ctx: AttnContext, carry: torch.Tensor | None = None,
                replay_topk: torch.Tensor | None = None, replay_experts: torch.Tensor | None = None,
                shared_kv: SharedKV | None = None, share_selection: bool = True
                ) -> tuple[torch.Tensor, AttnOut, torch.Tensor | None]:
        """→ (h, the attention's outputs (selection, latents, …), routed expert ids [B, S, k_e] or None)."""
        attn = self.self_attn(self.input_layernorm(h), ctx, carry=carry, replay=replay_topk, shared_kv=shared_kv,
                              share_selection=share_selection)
        h = h + attn.out
        x = self.post_attention_layernorm(h)
        if self.is_moe:
            y, experts = self.mlp(x, replay_experts)
        else:
            y, experts = self.mlp(x), None
        return h + y, attn, experts


class Glm5Cache:
    """Per-slot growing tensors, concatenated along dim −2 (the token axis of our [B, T, width] states).

    Same `update(keys, values, slot)` / `get_seq_length()` contract as transformers' `DynamicCache`, so the model
    runs with either (our rollout `LocalEngine` passes a fresh `DynamicCache()`). Slot i holds layer i's MLA
    latent [c_kv ; k_r] (keys; values are empty); slot `index_slot_offset + i` holds full layer i's indexer keys.
    """

    def __init__(self):
        self.keys: dict[int, torch.Tensor] = {}
        self.values: dict[int, torch.Tensor] = {}

    def update(self, keys: torch.Tensor, values: torch.Tensor, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        if layer_idx in self.keys:
            self.keys[layer_idx] = torch.cat([self.keys[layer_idx], keys], dim=-2)
            self.values[layer_idx] = torch.cat([self.values[layer_idx], values], dim=-2)
        else:
            self.keys[layer_idx], self.values[layer_idx] = keys, values
        return self.keys[layer_idx], self.values[layer_idx]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.keys[layer_idx].shape[-2] if layer_idx in self.keys else 0

    def reset(self) -> None:
        self.keys.clear()
        self.values.clear()

    def __len__(self) -> int:
        return len(self.keys)
