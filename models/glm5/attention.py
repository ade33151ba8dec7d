"""Multi-head latent attention (MLA) with DeepSeek sparse attention (DSA) over the indexer's top-k keys.

Per layer (docs/GLM52.md §4.2; H heads, d_n nope / d_r rope / d_v value dims, d_c KV latent rank):

    c_q = RMSNorm_εa(x W_qaᵀ);  [q_n | q_r]_h = (c_q W_qbᵀ)_h,  q_r ← RoPE(q_r)
    c_kv = RMSNorm_εa((x W_kvaᵀ)[:d_c]),  k_r = RoPE((x W_kvaᵀ)[d_c:])        (one rope key shared by all heads)
    [k_n | v]_h,s = W_kvb,h c_kv,s
    a_{h,t,s} = (q_n,h,t · k_n,h,s + q_r,h,t · k_r,s) / sqrt(d_n + d_r)   for s ∈ S_t (the indexer's top-k)
    o_h,t = Σ_s softmax_s(a) v_h,s,   out = [o_1 … o_H] W_oᵀ

We compute it in the *absorbed* (MQA) form that FlashMLA, SGLang and prime-rl use: fold W_UK (the k_n rows of
W_kvb) into the query, q̃_h = [W_UK,hᵀ q_n,h ; q_r,h] ∈ R^{d_c + d_r}, so a_{h,t,s} = q̃_h,t · [c_kv,s ; k_r,s] and
o_h,t = W_UV,h Σ_s p c_kv,s. The per-token state is the 576-wide latent [c_kv ; k_r] (what the KV cache holds),
and sparse attention *gathers* the k selected latents per query — [chunk, k, 576] at a time, one copy shared by
all heads — instead of masking a dense [S, T] score matrix. Queries are processed in chunks; the sparse chunks run
through `SparseMLA` (models/glm5/sparse_mla.py: a hand-written backward that re-gathers once and scatters once),
the dense ones (every causal key fits in top-k) are checkpointed; neither keeps gathered keys between passes.
On a GPU in bf16 the sparse core is instead one fused Triton kernel over all queries that reads the selected
latents in place (models/glm5/kernels/sparse_mla.py; `sparse_attn_kernel="torch"` keeps the chunked torch path),
and at short contexts (≤ `masked_attn_max_keys`, no KV cache) the un-absorbed form through SDPA with the selection
as a boolean mask (`MLA.attend_masked`), which is faster there.

Layer kinds (IndexShare, §4.5): a "full" layer owns an `Indexer` and selects S_t itself; a "shared" layer has no
indexer weights and reuses the top-k of the last full layer (the *carry*) but projects and attends over its own
KV. Selection `None` means "every causal key" (all keys fit in top-k), the dense case.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from models.glm5 import kernels
from models.glm5.config import Glm5Config
from models.glm5.indexer import Indexer, causal_indices, indexer_kl_loss
from models.glm5.indexer_rows import LayerRows
from models.glm5.kernels.sparse_mla import sparse_mla_fused
from models.glm5.layers import RMSNorm, apply_rope, chunk_key_ends, key_bounds, masked_softmax, valid_keys
from models.glm5.sparse_mla import sparse_mla


@dataclass
class AttnContext:
    """What every attention layer of one forward shares. B batch, S new tokens, T = cached + new keys."""
    cos: torch.Tensor  # [B, S, d_r/2] RoPE of the queries' (and new keys') positions
    sin: torch.Tensor
    query_index: torch.Tensor  # [B, S] each query's own index on the key (cache) axis: causal bound
    key_mask: torch.Tensor | None  # [B, T] 1 = real token, 0 = padding; None = all real
    cache: object | None = None  # anything with update(keys, values, slot) → (all_keys, all_values)
    index_slot_offset: int = 0  # cache slot of layer i's indexer keys = offset + i
    indexer_loss: str | None = None  # None | "dense" | "sparse": DSA warm-up loss on full layers
    # [B, S] packed rows (models/batching.py): the key index where each query's sample begins, the lower bound of
    # the keys it may see (its upper bound is query_index); None = one sample a row
    query_start: torch.Tensor | None = None
    # {full layer: [B, S] the indexer's top-k margin of each query} filled where a layer ran its indexer, when
    # not None (an engine recording the rows whose selection another implementation could make differently)
    margins: dict | None = None
    _bounds: torch.Tensor | None = field(default=None, repr=False)

    def key_bounds(self) -> torch.Tensor:
        """`layers.key_bounds(query_index)`, read to the host once per forward (every layer and every checkpoint
        recompute shares it)."""
        if self._bounds is None:
            self._bounds = key_bounds(self.query_index)
        return self._bounds


@dataclass
class SharedKV:
    """MTP KVShare (§4.8): later MTP steps attend over step 1's latents at step 1's selection."""
    latents: torch.Tensor  # [B, T, d_c + d_r]
    index_keys: torch.Tensor | None  # [B, T, d_I]
    selection: torch.Tensor | None  # [B, S, k] or None (dense)


class AttnOut(NamedTuple):
    out: torch.Tensor  # [B, S, D]
    selection: torch.Tensor | None  # [B, S, k] key indices (−1 = empty) or None = all causal keys
    latents: torch.Tensor  # [B, T, d_c + d_r]
    index_keys: torch.Tensor | None  # [B, T, d_I] (full layers)
    indexer_loss: tuple[torch.Tensor, torch.Tensor] | None  # (Σ_t KL, #tokens)


class Queries(NamedTuple):
    c_q: torch.Tensor  # [B, S, d_q] the normed query latent (the indexer reads it)
    nope: torch.Tensor  # [B, S, H, d_n]
    rope: torch.Tensor  # [B, S, H, d_r], RoPE applied


# Queries per SDPA call of the masked path: its mask is [chunk, keys] booleans, and each chunk attends to every key
# up to its last query, so about S²/2 + S·chunk/2 pairs are computed (S²/2 are causal). Smaller chunks waste fewer
# pairs but launch more and sum more gradient pieces.
MASKED_QUERY_CHUNK = 1024


class MLA(nn.Module):
    def __init__(self, config: Glm5Config, layer_idx: int, has_indexer: bool):
        super().__init__()
        self.layer_idx = layer_idx
        self.n_heads = config.num_attention_heads
        self.d_nope, self.d_rope, self.d_v = config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim
        self.d_c = config.kv_lora_rank
        self.scale = (self.d_nope + self.d_rope) ** -0.5
        self.dropout = config.attention_dropout
        self.chunk = config.attn_query_chunk
        if config.sparse_attn_kernel not in ("auto", "torch"):
            raise ValueError(f"sparse_attn_kernel must be 'auto' or 'torch', got {config.sparse_attn_kernel!r}")
        self.kernel = config.sparse_attn_kernel
        self.masked_max_keys = config.masked_attn_max_keys
        bias = config.attention_bias
        self.q_a_proj = nn.Linear(config.hidden_size, config.q_lora_rank, bias=bias)
        self.q_a_layernorm = RMSNorm(config.q_lora_rank, config.latent_norm_eps)
        self.q_b_proj = nn.Linear(config.q_lora_rank, self.n_heads * (self.d_nope + self.d_rope), bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(config.hidden_size, self.d_c + self.d_rope, bias=bias)
        self.kv_a_layernorm = RMSNorm(self.d_c, config.latent_norm_eps)
        self.kv_b_proj = nn.Linear(self.d_c, self.n_heads * (self.d_nope + self.d_v), bias=False)
        self.o_proj = nn.Linear(self.n_heads * self.d_v, config.hidden_size, bias=bias)
        self.indexer = Indexer(config) if has_indexer else None

    # ---- projections ----------------------------------------------------------------------------------------
    def _w_uk_uv(self) -> tuple[torch.Tensor, torch.Tensor]:
        """W_UK [H, d_n, d_c] and W_UV [H, d_v, d_c]: the per-head row blocks of kv_b_proj (head h owns rows
        [h(d_n+d_v), (h+1)(d_n+d_v)), k_nope first)."""
        w = self.kv_b_proj.weight.view(self.n_heads, self.d_nope + self.d_v, self.d_c)
        return w[:, :self.d_nope], w[:, self.d_nope:]

    def queries(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> Queries:
        """c_q [B, S, d_q] (the indexer's input) and the per-head query parts, RoPE applied to q_r."""
        b, s, _ = x.shape
        c_q = self.q_a_layernorm(self.q_a_proj(x))
        q = self.q_b_proj(c_q).view(b, s, self.n_heads, self.d_nope + self.d_rope)
        q_nope, q_rope = q.split([self.d_nope, self.d_rope], dim=-1)
        return Queries(c_q, q_nope, apply_rope(q_rope, cos, sin))

    def absorb(self, q: Queries) -> torch.Tensor:
        """Absorbed queries q̃ [B, S, H, d_c + d_r] = [W_UK,hᵀ q_n,h ; q_r,h]."""
        w_uk, _ = self._w_uk_uv()
        return torch.cat([torch.einsum("bshn,hnc->bshc", q.nope, w_uk), q.rope], dim=-1)

    def latents(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """[c_kv ; k_r] [B, S, d_c + d_r]: the 576 numbers per token the KV cache stores."""
        kv = self.kv_a_proj_with_mqa(x)
        c_kv, k_rope = kv.split([self.d_c, self.d_rope], dim=-1)
        return torch.cat([self.kv_a_layernorm(c_kv), apply_rope(k_rope, cos, sin)], dim=-1)

    # ---- attention core -------------------------------------------------------------------------------------
    def _chunk(self, q: torch.Tensor, kv: torch.Tensor, sel: torch.Tensor | None, qi: torch.Tensor,
               key_mask: torch.Tensor | None, w_uv: torch.Tensor, start: torch.Tensor | None = None) -> torch.Tensor:
        """Queries q [B, c, H, d_c+d_r] over their keys → [B, c, H, d_v]. sel [B, c, k] gathers k latents per
        query; sel None attends to the causal prefix (keys ≤ qi, and ≥ start in a packed row) of kv directly."""
        if sel is None:
            end = int(qi.max()) + 1
            keys = kv[:, :end]
            pos = torch.arange(end, device=kv.device)
            ok = pos <= qi[..., None]
            if start is not None:
                ok = ok & (pos >= start[..., None])
            if key_mask is not None:
                ok = ok & key_mask[:, None, :end].bool()
            scores = torch.einsum("bchd,btd->bcht", q, keys)
            p = masked_softmax(scores * self.scale, ok[:, :, None, :]).to(q.dtype)
            p = F.dropout(p, self.dropout, self.training)
            o_lat = torch.einsum("bcht,btd->bchd", p, keys[..., :self.d_c])
        else:
            b, c, k = sel.shape
            rows = torch.arange(b, device=kv.device)[:, None, None]
            keys = kv[rows, sel.clamp(0, kv.shape[1] - 1)]  # [B, c, k, d_c + d_r]
            ok = valid_keys(sel, qi, key_mask)
            scores = torch.einsum("bchd,bckd->bchk", q, keys)
            p = masked_softmax(scores * self.scale, ok[:, :, None, :]).to(q.dtype)
            p = F.dropout(p, self.dropout, self.training)
            o_lat = torch.einsum("bchk,bckd->bchd", p, keys[..., :self.d_c])
        return torch.einsum("bchd,hvd->bchv", o_lat, w_uv)

    def attend(self, q: torch.Tensor, kv: torch.Tensor, selection: torch.Tensor | None, query_index: torch.Tensor,
               key_mask: torch.Tensor | None, query_start: torch.Tensor | None = None) -> torch.Tensor:
        """Sparse (or, selection None, causal-dense) absorbed attention in query chunks → [B, S, H·d_v].
        `query_start` bounds the dense case's keys from below (packed rows; a selection is masked already)."""
        _, w_uv = self._w_uk_uv()
        outs = []
        grad = torch.is_grad_enabled() and (q.requires_grad or kv.requires_grad or w_uv.requires_grad)
        by_hand = selection is not None and not (self.training and self.dropout)  # SparseMLA has no dropout
        if by_hand and self.kernel == "auto" and kernels.usable(q):  # no gather: all queries at once
            o_lat = sparse_mla_fused(q, kv, selection, query_index, key_mask, self.scale, self.d_c)
            return torch.einsum("bshd,hvd->bshv", o_lat, w_uv).flatten(2)
        for a in range(0, q.shape[1], self.chunk):
            args = (q[:, a:a + self.chunk], kv, None if selection is None else selection[:, a:a + self.chunk],
                    query_index[:, a:a + self.chunk], key_mask)
            if by_hand:
                o_lat = sparse_mla(*args, self.scale, self.d_c)
                outs.append(torch.einsum("bchd,hvd->bchv", o_lat, w_uv))
            else:
                start = None if query_start is None else query_start[:, a:a + self.chunk]
                outs.append(checkpoint(self._chunk, *args, w_uv, start, use_reentrant=False) if grad
                            else self._chunk(*args, w_uv, start))
        o = torch.cat(outs, dim=1)
        return o.flatten(2)

    def use_masked(self, q: Queries, num_keys: int, cache) -> bool:
        """The masked path: a GPU forward without a KV cache over at most `masked_attn_max_keys` keys."""
        return (self.kernel == "auto" and cache is None and num_keys <= self.masked_max_keys
                and kernels.usable(q.nope) and not kernels.interpreted())

    def attend_masked(self, q: Queries, latents: torch.Tensor, selection: torch.Tensor | None,
                      query_index: torch.Tensor, key_mask: torch.Tensor | None,
                      bounds: torch.Tensor | None = None, query_start: torch.Tensor | None = None) -> torch.Tensor:
        """The same attention un-absorbed, through SDPA with the selection as a boolean mask → [B, S, H·d_v].

        Per head K = [k_n ; k_r] and V from kv_b_proj(c_kv); a query may attend to key s iff s ∈ S_t (or, with
        selection None, s is in its causal prefix), and padding keys never (a key selected twice counts once here,
        twice when gathered; the indexer's top-k never repeats one). Queries go in chunks of
        MASKED_QUERY_CHUNK, each against the keys up to its last query only, so causality skips about half the
        pairs; the [chunk, keys] mask is all that is built. `bounds`: `key_bounds(query_index)` if already known.

        Why: at short contexts the top-k covers a large share of each prefix (2,048 of ≤ 8K keys), and a flash
        kernel over every pair of a chunk, with the mask applied in its tiles (cuDNN's, through SDPA), beats
        reading 2,048 gathered latents per query for 16 heads; at long contexts the gather wins by far. The
        crossover was measured on the H200 (docs/BENCHMARKS.md) and sets `masked_attn_max_keys`."""
        b, s, h, _ = q.nope.shape
        t = latents.shape[1]
        c_kv, k_rope = latents.split([self.d_c, self.d_rope], dim=-1)
        k_nope, v = self.kv_b_proj(c_kv).view(b, t, h, self.d_nope + self.d_v).split([self.d_nope, self.d_v], -1)
        k = torch.cat([k_nope, k_rope[:, :, None].expand(-1, -1, h, -1)], dim=-1).transpose(1, 2)  # [B, H, T, d]
        v = v.transpose(1, 2)
        qq = torch.cat([q.nope, q.rope], dim=-1).transpose(1, 2)  # [B, H, S, d]
        ends = chunk_key_ends(key_bounds(query_index) if bounds is None else bounds, MASKED_QUERY_CHUNK)
        # the chunks' queries by split and their keys by `prefixes`: each gradient is then assembled once (a cat,
        # a sum into one buffer), not zero-filled to full size and added per chunk as slicing would have autograd do
        q_chunks = qq.split(MASKED_QUERY_CHUNK, dim=2)
        k_prefixes, v_prefixes = prefixes(k, ends), prefixes(v, ends)
        outs = []
        for i, (a, end) in enumerate(zip(range(0, s, MASKED_QUERY_CHUNK), ends)):
            qi = query_index[:, a:a + MASKED_QUERY_CHUNK]
            sel = None if selection is None else selection[:, a:a + MASKED_QUERY_CHUNK]
            start = None if query_start is None else query_start[:, a:a + MASKED_QUERY_CHUNK]
            allowed = allowed_keys(sel, qi, key_mask, end, start)
            empty = ~allowed.any(-1, keepdim=True)  # e.g. a padding query: give it one key, zero its output
            allowed[..., :1] |= empty
            o = F.scaled_dot_product_attention(q_chunks[i], k_prefixes[i], v_prefixes[i], attn_mask=allowed[:, None],
                                               scale=self.scale, dropout_p=self.dropout if self.training else 0.0)
            outs.append(o.transpose(1, 2).masked_fill(empty[..., None], 0.0))
        return torch.cat(outs, dim=1).flatten(2)

    def head_summed_probs(self, q: torch.Tensor, kv: torch.Tensor, key_idx: torch.Tensor,
                          query_index: torch.Tensor, key_mask: torch.Tensor | None) -> torch.Tensor:
        """p_t over the keys key_idx [B, c, K]: the attention distribution summed over heads, L1-normalised
        (the indexer's warm-up target, DeepSeek-V3.2 §2.1). No grad."""
        with torch.no_grad():
            b = q.shape[0]
            rows = torch.arange(b, device=kv.device)[:, None, None]
            keys = kv[rows, key_idx.clamp(0, kv.shape[1] - 1)]
            ok = valid_keys(key_idx, query_index, key_mask)
            p = masked_softmax(torch.einsum("bchd,bckd->bchk", q, keys) * self.scale, ok[:, :, None, :])
            return p.sum(2) / self.n_heads

    # ---- layer forward --------------------------------------------------------------------------------------
    def forward(self, x: torch.Tensor, ctx: AttnContext, carry: torch.Tensor | None = None,
                replay: torch.Tensor | LayerRows | None = None, shared_kv: SharedKV | None = None,
                share_selection: bool = True) -> AttnOut:
        """x [B, S, D] (already input-normed). `carry`: the last full layer's selection (shared layers).
        `replay` [B, S, k]: use these key indices instead of running the indexer (train = rollout); a row of −1
        only is not replayed: that query selects for itself (a partial replay: rollout/indexer_replay.py). Or
        `LayerRows`: the same partial replay kept sparse (models/glm5/indexer_rows.py).
        `shared_kv`: attend over these latents instead of our own (MTP steps ≥ 2); with `share_selection` their
        selection is reused too, else our indexer scores our queries against their index keys."""
        queries = self.queries(x, ctx.cos, ctx.sin)
        c_q = queries.c_q
        cache = ctx.cache if shared_kv is None else None
        if shared_kv is None:
            latents = self.latents(x, ctx.cos, ctx.sin)
            if cache is not None:
                latents = cache.update(latents, latents[..., :0], self.layer_idx)[0]
        else:
            latents = shared_kv.latents
        num_keys = latents.shape[1]

        index_keys, loss = None, None
        if self.indexer is None:
            selection = replay if replay is not None else carry
        elif shared_kv is not None:
            index_keys = shared_kv.index_keys
            if replay is not None:
                selection = replay
            elif share_selection or num_keys <= self.indexer.topk:
                selection = shared_kv.selection if share_selection else None
            else:
                selection = self._run_indexer(x, c_q, index_keys, ctx)
        else:
            # [B, S] the rows a partial replay gives (None: all of them, or no replay). Decided per rank: under
            # ZeRO-3 a rank replaying every row would skip the indexer's gathers. A margin-gated replay never
            # covers a sample's first k queries (no choice to make), so only a sequence-parallel chunk past them,
            # under a τ so large that every query is shipped, could
            replayed, rows = None, None
            if isinstance(replay, LayerRows):  # sparse: select, then write the replayed rows over the selection
                replay, rows = None, replay
            if replay is not None:
                replayed = (replay >= 0).any(-1)
                if bool(replayed.all()):
                    replayed = None
                elif not bool(replayed.any()):
                    replay, replayed = None, None
            own = replay is None or replayed is not None  # some rows select for themselves
            need_keys = cache is not None or (own and num_keys > self.indexer.topk)
            if need_keys:
                with torch.no_grad():
                    index_keys = self.indexer.keys(x, ctx.cos, ctx.sin)
                    if cache is not None:
                        index_keys = cache.update(index_keys, index_keys[..., :0],
                                                  ctx.index_slot_offset + self.layer_idx)[0]
            if not own:
                selection = replay
            elif num_keys <= self.indexer.topk:
                selection = None  # every causal key fits: dense
            else:
                selection = self._run_indexer(x, c_q, index_keys, ctx)
            if replayed is not None:
                selection = merge_replay(replay, replayed, selection, ctx, num_keys)
            if rows is not None:
                selection = rows.scatter(selection if selection is not None else
                                         causal_indices(ctx.query_index, ctx.key_mask, num_keys, ctx.query_start))
            if ctx.indexer_loss is not None:
                loss = self._indexer_loss(x, c_q, self.absorb(queries), latents, selection, ctx)

        if selection is not None and ctx.query_start is not None:  # packed rows: never a key of another sample
            selection = selection.masked_fill(selection < ctx.query_start[..., None], -1)
        if self.use_masked(queries, num_keys, cache):
            o = self.attend_masked(queries, latents, selection, ctx.query_index, ctx.key_mask, ctx.key_bounds(),
                                   ctx.query_start)
        else:
            o = self.attend(self.absorb(queries), latents, selection, ctx.query_index, ctx.key_mask, ctx.query_start)
        out = self.o_proj(o)
        return AttnOut(out, selection, latents, index_keys, loss)

    @torch.no_grad()
    def _run_indexer(self, x, c_q, index_keys, ctx: AttnContext) -> torch.Tensor:
        out = self.indexer.select(self.indexer.queries(c_q, ctx.cos, ctx.sin), self.indexer.head_weights(x),
                                  index_keys, ctx.query_index, ctx.key_mask, ctx.key_bounds(), ctx.query_start,
                                  margins=ctx.margins is not None)
        if ctx.margins is None:
            return out
        ctx.margins[self.layer_idx] = out[1]
        return out[0]

    def _indexer_loss(self, x, c_q, q, latents, selection, ctx: AttnContext):
        """DSA warm-up KL on detached inputs (gradient reaches only the indexer)."""
        if latents.shape[1] != x.shape[1]:
            raise ValueError("the indexer warm-up loss needs a full-sequence forward (no KV cache)")
        if ctx.query_start is not None:
            raise ValueError("the indexer warm-up loss takes one sample a row, not packed rows")
        if ctx.indexer_loss not in ("dense", "sparse"):
            raise ValueError(f"indexer_loss must be None, 'dense' or 'sparse', got {ctx.indexer_loss!r}")
        x_d, cq_d = x.detach(), c_q.detach()
        q_idx = self.indexer.queries(cq_d, ctx.cos, ctx.sin)
        w_idx = self.indexer.head_weights(x_d)
        k_idx = self.indexer.keys(x_d, ctx.cos, ctx.sin)
        q_d, kv_d = q.detach(), latents.detach()

        def probs(a, b, key_idx):
            return self.head_summed_probs(q_d[:, a:b], kv_d, key_idx, ctx.query_index[:, a:b], ctx.key_mask)

        selected = selection if ctx.indexer_loss == "sparse" else None
        return indexer_kl_loss(self.indexer, q_idx, w_idx, k_idx, probs, ctx.query_index, ctx.key_mask, selected,
                               self.chunk)


class _Prefixes(torch.autograd.Function):
    """x[:, :, :e] for each e in `ends` (views); backward sums the prefixes' gradients into one buffer."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, ends: list[int]):
        ctx.shape, ctx.ends = x.shape, ends
        return tuple(x[:, :, :e] for e in ends)

    @staticmethod
    def backward(ctx, *grads):
        out = None
        for g, e in zip(grads, ctx.ends):
            if g is None:
                continue
            if out is None:
                out = g.new_zeros(ctx.shape)
            out[:, :, :e] += g
        return out, None


def prefixes(x: torch.Tensor, ends: list[int]) -> tuple[torch.Tensor, ...]:
    """The leading `e` entries of x's third axis, for each e in `ends`."""
    return _Prefixes.apply(x, ends)


def allowed_keys(selection: torch.Tensor | None, query_index: torch.Tensor, key_mask: torch.Tensor | None,
                 num_keys: int, query_start: torch.Tensor | None = None) -> torch.Tensor:
    """[B, c, num_keys] booleans: which keys each query attends to (its valid selected slots, or with selection
    None its causal prefix, from `query_start` on in a packed row), padding keys excluded."""
    if selection is None:
        return causal_indices(query_index, key_mask, num_keys, query_start) >= 0
    ok = valid_keys(selection, query_index, key_mask) & (selection < num_keys)
    slots = torch.where(ok, selection, num_keys)  # invalid slots land in a spare column, then dropped
    allowed = torch.zeros(*selection.shape[:2], num_keys + 1, dtype=torch.bool, device=selection.device)
    return allowed.scatter_(-1, slots, True)[..., :num_keys]


def materialize_selection(selection: torch.Tensor | None, query_index: torch.Tensor, key_mask: torch.Tensor | None,
                          num_keys: int, query_start: torch.Tensor | None = None) -> torch.Tensor:
    """A selection as explicit indices [B, S, k] with −1 in every slot the query may not attend to (so what we
    return for replay is canonical whether the layer ran sparse, dense or from a replay)."""
    if selection is None:
        return causal_indices(query_index, key_mask, num_keys, query_start)
    ok = valid_keys(selection, query_index, key_mask)
    if query_start is not None:
        ok = ok & (selection >= query_start[..., None])
    return torch.where(ok, selection, torch.full_like(selection, -1))


def merge_replay(replay: torch.Tensor, replayed: torch.Tensor, own: torch.Tensor | None, ctx: AttnContext,
                 num_keys: int) -> torch.Tensor:
    """A partial replay: the replayed rows' key indices where `replayed` [B, S], the layer's own selection (None:
    every causal key) elsewhere, in one [B, S, k] (the narrower side padded with −1)."""
    if own is None:
        own = causal_indices(ctx.query_index, ctx.key_mask, num_keys, ctx.query_start)
    width = max(own.shape[-1], replay.shape[-1])
    own = F.pad(own, (0, width - own.shape[-1]), value=-1)
    replay = F.pad(replay, (0, width - replay.shape[-1]), value=-1)
    return torch.where(replayed[..., None], replay, own)
