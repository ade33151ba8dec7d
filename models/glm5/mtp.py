"""GLM-5.2's multi-token-prediction (MTP) layer: training forward with shared parameters, KVShare and IndexShare.

Structure (docs/GLM52.md §4.8): checkpoint `model.layers.N` (N = num_hidden_layers) is a full decoder layer — MLA with
its own indexer, always MoE — plus `enorm`, `hnorm` (RMSNorm), `eh_proj` [D, 2D] and `shared_head.norm`. It
reuses the target's `embed_tokens` and `lm_head`. One step:

    z = eh_proj([enorm(E[y]) ; hnorm(h_prev)])          (the embedding half comes first)
    h = shared_head.norm(DecoderLayer_N(z)),  logits = h W_lmᵀ

Training alignment on anchors i (0-based token positions) — the spec's [inferred] reading of the GLM-5.2 blog:

* step 1 runs causally over all anchors with input (E[t_{i+1}], h⁰_i), h⁰ the target's final-norm output, and
  predicts t_{i+2}. It produces the MTP layer's latents (c_kv, k_r)_i and its indexer selection S^mtp_i.
* step j ≥ 2 at anchor i has input (E[t_{i+j}], h^{(j−1)}_i) and predicts t_{i+j+1}. Only its *query* is new: it
  attends over the **step-1** latents (KVShare) at positions ≤ i, selected by **S^mtp_i**, the step-1 row of
  the same anchor (IndexShare; with `index_share_for_mtp_iteration` false the MTP indexer scores the step-j query
  against step 1's index keys instead). No step-j key is visible, not even its own. Its RoPE position is
  pos_i + (j − 1), where the j-th draft query sits at inference.
* all steps share one parameter set; with several MTP layers in a checkpoint step j uses layer min(j, n) − 1.

Losses, never materialising [B, S, V] logits (chunks of the LM head, checkpointed):

* CE_j = mean over valid anchors of −log q_j(t_{i+j+1}); `mtp_loss` = mean_j CE_j.
* optional TV loss (docs/ALGORITHMS.md §6, Bebop): with speculative *rejection sampling* a step-j draft is accepted
  with probability 1 − TV(p, q_j), p the target's next-token distribution at i + j (detached) and q_j the draft's.
  We maximise the expected accepted length, A_i = Σ_j Π_{m≤j} (1 − TV_{m,i}) (a later step counts only if every
  earlier one was accepted), i.e. L_TV = −mean_i A_i / K (K = steps).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from models.glm5.attention import AttnContext, SharedKV
from models.glm5.config import Glm5Config
from models.glm5.decoder import DecoderLayer
from models.glm5.layers import RMSNorm, rope_angles


class SharedHead(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.norm = RMSNorm(dim, eps)


class MTPLayer(DecoderLayer):
    def __init__(self, config: Glm5Config, layer_idx: int):
        super().__init__(config, layer_idx)
        d = config.hidden_size
        self.enorm = RMSNorm(d, config.rms_norm_eps)
        self.hnorm = RMSNorm(d, config.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * d, d, bias=False)
        self.shared_head = SharedHead(d, config.rms_norm_eps)

    def combine(self, embeds: torch.Tensor, h_prev: torch.Tensor) -> torch.Tensor:
        return self.eh_proj(torch.cat([self.enorm(embeds), self.hnorm(h_prev)], dim=-1))


def _shift(ids: torch.Tensor, j: int) -> torch.Tensor:
    """ids[:, i + j], the last column repeated past the end (those anchors have no target and are masked)."""
    if j == 0:
        return ids
    pad = ids[:, -1:].expand(ids.shape[0], min(j, ids.shape[1]), *ids.shape[2:])
    return torch.cat([ids[:, j:], pad], dim=1)[:, :ids.shape[1]]


def mtp_hidden_states(backbone, h0: torch.Tensor, input_ids: torch.Tensor, key_mask: torch.Tensor | None,
                      position_ids: torch.Tensor, steps: int) -> list[torch.Tensor]:
    """h^{(1)} … h^{(steps)}, each [B, S, D] indexed by anchor (see the module docstring)."""
    config: Glm5Config = backbone.config
    n = config.num_hidden_layers
    mtp_layers = list(backbone.layers[n:])
    if not mtp_layers:
        raise ValueError("this model has no MTP layer (num_nextn_predict_layers = 0)")
    b, s = input_ids.shape
    query_index = torch.arange(s, device=input_ids.device).expand(b, s)
    d_r, theta = config.qk_rope_head_dim, config.rope_theta
    shared, h, out = None, h0, []
    for j in range(1, steps + 1):
        layer: MTPLayer = mtp_layers[min(j, len(mtp_layers)) - 1]
        cos, sin = rope_angles(position_ids + (j - 1), d_r, theta)
        ctx = AttnContext(cos, sin, query_index, key_mask)
        z = layer.combine(backbone.embed_tokens(_shift(input_ids, j)), h)
        if shared is None:
            u, attn, _ = layer(z, ctx)
            shared = SharedKV(attn.latents, attn.index_keys, attn.selection)
        else:
            u, _, _ = layer(z, ctx, shared_kv=shared, share_selection=config.index_share_for_mtp_iteration)
        h = layer.shared_head.norm(u)
        out.append(h)
    return out


def head_ce_sum(head: nn.Module, h: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(head(h).float(), y, reduction="sum")


def _tv(head: nn.Module, h_draft: torch.Tensor, h_target: torch.Tensor) -> torch.Tensor:
    q = torch.softmax(head(h_draft).float(), dim=-1)
    with torch.no_grad():
        p = torch.softmax(head(h_target).float(), dim=-1)
    return 0.5 * (p - q).abs().sum(-1)


def chunked_head(fn, head: nn.Module, *tensors: torch.Tensor, rows: int) -> list[torch.Tensor]:
    """fn(head, *row_chunks) over row chunks of [N, ·] tensors, checkpointed under autograd: at most
    [rows, V] logits live at a time, forward and backward."""
    outs = []
    for a in range(0, tensors[0].shape[0], rows):
        args = (head,) + tuple(t[a:a + rows] for t in tensors)
        outs.append(checkpoint(fn, *args, use_reentrant=False) if torch.is_grad_enabled() else fn(*args))
    return outs


@dataclass
class MTPLoss:
    loss: torch.Tensor  # mean_j CE_j (+ tv_weight · L_TV)
    ce: list[torch.Tensor] = field(default_factory=list)  # per step, detached
    tv: list[torch.Tensor] = field(default_factory=list)  # per step mean TV, detached (with the TV loss on)
    accept_length: torch.Tensor | None = None  # mean expected accepted drafts per anchor, detached


def mtp_loss(backbone, head: nn.Module, hidden: torch.Tensor, input_ids: torch.Tensor,
             attention_mask: torch.Tensor | None, position_ids: torch.Tensor, steps: int, tv_weight: float = 0.0,
             rows: int = 1024) -> MTPLoss:
    """MTP training loss. `hidden` is the backbone's final-norm output h⁰ [B, S, D] of the same forward."""
    b, s = input_ids.shape
    mask = torch.ones_like(input_ids, dtype=torch.bool) if attention_mask is None else attention_mask.bool()
    hs = mtp_hidden_states(backbone, hidden, input_ids, None if attention_mask is None else attention_mask,
                           position_ids, steps)
    anchor = torch.arange(s, device=input_ids.device)
    ces, tvs, survive, accept = [], [], None, None
    total = hidden.new_zeros((), dtype=torch.float32)
    for j, h in enumerate(hs, start=1):
        valid = (anchor + j + 1 < s) & mask & _shift(mask, j + 1)  # target t_{i+j+1} exists and is real
        y = _shift(input_ids, j + 1)[valid]
        n = valid.sum().clamp(min=1)
        ce = sum(chunked_head(head_ce_sum, head, h[valid], y, rows=rows), hidden.new_zeros(())) / n
        ces.append(ce.detach())
        total = total + ce / steps
        if tv_weight > 0:
            tv = torch.zeros(b, s, device=h.device)
            parts = chunked_head(_tv, head, h[valid], _shift(hidden.detach(), j)[valid], rows=rows)
            if parts:
                tv = tv.masked_scatter(valid, torch.cat(parts))
            tvs.append((tv.sum() / n).detach())
            step_ok = (1 - tv) * valid
            survive = step_ok if survive is None else survive * step_ok
            accept = survive if accept is None else accept + survive
    out = MTPLoss(total, ces, tvs)
    if tv_weight > 0:
        first = (anchor + 2 < s) & mask & _shift(mask, 2)
        mean_accept = (accept * first).sum() / first.sum().clamp(min=1)
        out.loss = total - tv_weight * mean_accept / steps
        out.accept_length = mean_accept.detach()
    return out
