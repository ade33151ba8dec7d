"""Speculative decoding with GLM-5.2's MTP layer as the drafter (docs/GLM52.md §4.8; the acceptance rule is
`rollout.sampling.verify_drafts`).

One round for a batch of rows, each with its last emitted token x and k drafts d_1..d_k:

    verify   the target runs [x, d_1, …, d_k] in one forward (KV cache appended by k+1 slots per row)
    accept   row r keeps m_r drafts and gets a next token b_r; slots of its rejected drafts stay in the cache
             as holes (attention mask 0), so rows accept different counts without re-padding the batch
    extend   MTP step 1 runs over the k+1 new slots (anchor i: E[token after i], h⁰_i), appending its own
             latents to the cache (slot N = num_hidden_layers, aligned with the target's slots)
    draft    step 1's output at the row's last real anchor gives d'_1; step j ≥ 2 feeds (E[d'_{j−1}], h^{(j−1)})
             at RoPE position pos + j − 1 and attends over step 1's latents with step 1's selection (KVShare,
             IndexShare), as in training (models/glm5/mtp.py)

The MTP cache lags by nothing: a slot's MTP entry is written when the token after it is known (the prompt's
slots at prefill with the first sampled token; a round's slots once b_r is drawn).
"""

from __future__ import annotations

import torch

from models.glm5.attention import AttnContext, SharedKV
from models.glm5.decoder import Glm5Cache
from models.glm5.layers import rope_angles


class MTPDrafter:
    def __init__(self, model):
        backbone = model.get_decoder()
        config = backbone.config
        n = config.num_hidden_layers
        if len(backbone.layers) <= n:
            raise ValueError("speculative decoding needs the model's MTP layer (num_nextn_predict_layers ≥ 1)")
        self.backbone, self.head, self.config = backbone, model.get_output_embeddings(), config
        self.layers = list(backbone.layers[n:])
        self.index_offset = len(backbone.layers)

    def _ctx(self, positions, query_index, key_mask, cache) -> AttnContext:
        cos, sin = rope_angles(positions, self.config.qk_rope_head_dim, self.config.rope_theta)
        mask = None if key_mask is None or bool(key_mask.all()) else key_mask.bool()
        return AttnContext(cos, sin, query_index, mask, cache, self.index_offset)

    def extend(self, cache: Glm5Cache, h0: torch.Tensor, next_ids: torch.Tensor, positions: torch.Tensor,
               key_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """MTP step 1 over the S newest slots: h0 [B, S, D] the target's final-norm states there, next_ids [B, S]
        the token after each. Appends the step's latents to `cache`; returns (h¹ [B, S, D], selection)."""
        layer = self.layers[0]
        past = cache.get_seq_length(layer.layer_idx)
        s = h0.shape[1]
        query_index = (past + torch.arange(s, device=h0.device)).expand(h0.shape[0], s)
        z = layer.combine(self.backbone.embed_tokens(next_ids), h0)
        u, attn, _ = layer(z, self._ctx(positions, query_index, key_mask, cache))
        return layer.shared_head.norm(u), attn.selection

    def draft(self, cache: Glm5Cache, h1: torch.Tensor, selection: torch.Tensor | None, row: torch.Tensor,
              anchor: torch.Tensor, position: torch.Tensor, key_mask: torch.Tensor, steps: int, sample_fn):
        """k = `steps` drafts per row from step 1's state h1 [B, 1, D] at cache slot `anchor` [B] (RoPE
        `position` [B]); `row` [B] is that anchor's query row in `selection` (step 1's, from `extend`).
        sample_fn(logits [B, V]) → (tokens [B], log q [B, V]). Returns (drafts [B, k], log q [B, k, V])."""
        rows = torch.arange(h1.shape[0], device=h1.device)
        tokens, logq = sample_fn(self.head(h1[:, 0]).float())
        drafts, logqs = [tokens], [logq]
        if steps > 1:
            first = self.layers[0]
            index_keys = cache.keys.get(self.index_offset + first.layer_idx)
            shared = SharedKV(cache.keys[first.layer_idx], index_keys,
                              None if selection is None else selection[rows, row].unsqueeze(1))
            query_index = anchor.unsqueeze(1)
        h = h1
        for j in range(2, steps + 1):
            layer = self.layers[min(j, len(self.layers)) - 1]
            z = layer.combine(self.backbone.embed_tokens(drafts[-1]).unsqueeze(1), h)
            ctx = self._ctx((position + j - 1).unsqueeze(1), query_index, key_mask, None)
            u, _, _ = layer(z, ctx, shared_kv=shared, share_selection=self.config.index_share_for_mtp_iteration)
            h = layer.shared_head.norm(u)
            tokens, logq = sample_fn(self.head(h[:, 0]).float())
            drafts.append(tokens)
            logqs.append(logq)
        return torch.stack(drafts, 1), torch.stack(logqs, 1)
