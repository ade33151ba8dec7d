"""The DSA lightning indexer: per-query top-k key selection, computed in streaming chunks, and its warm-up loss.

Math (docs/GLM52.md §4.3, DeepSeek-V3.2 eq. 1). For query t and key s (s ≤ t, real tokens only):

    q^I_t = c_q,t W_qIᵀ ∈ R^{H_I × d_I}      (c_q: the attention's normalised query latent; first d_r dims roped)
    k^I_s = LayerNorm(x_s W_kIᵀ) ∈ R^{d_I}   (one head; first d_r dims roped; LayerNorm *with* bias)
    w_t   = (x_t W_wᵀ) · H_I^{−½} ∈ R^{H_I}   (fp32, may be negative)
    I_{t,s} = Σ_j w_{t,j} · ReLU(d_I^{−½} · q^I_{t,j} · k^I_s)           (fp32)
    S_t = TopK_s(I_{t,s}, k)

Streaming: for a chunk of queries we walk the keys in blocks, keep a running top-k (values + key indices) and
merge each block into it, so memory is O(chunk × heads × block) and the [S, T] score matrix never exists. Keys
past the chunk's last query are never scored (causality). Slots that found no valid key hold −1; a query with
t + 1 ≤ k valid keys thereby selects exactly its causal prefix, i.e. attends densely, as transformers and SGLang do.

Top-k is not differentiable and the indexer is frozen by default (selection runs under `no_grad`). Its only
training signal is the optional DSA warm-up loss `indexer_kl_loss` (DeepSeek-V3.2 §2.1): KL(p_t ‖ softmax(I_t)),
with p_t the main attention distribution summed over heads and L1-normalised, computed on detached inputs so that
the loss reaches only the indexer and the LM loss never reaches it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from models.glm5 import kernels
from models.glm5.config import Glm5Config
from models.glm5.kernels.indexer import index_scores_fused
from models.glm5.layers import apply_rope, chunk_key_ends, key_bounds


FP8_E4M3_MAX = 448.0


def fp8_act_quant(x: torch.Tensor) -> torch.Tensor:
    """x through SGLang's indexer act-quant and back, in fp32: rounded to bf16, then each row (last dim: one head
    of q, or a token's k) scaled by max(1e-4, amax) / 448 and rounded to FP8 e4m3 (nearest, ties to even).
    What SGLang 0.5.17's DSA kernels score (deepseek_v32/indexer_k.cuh for k; q per head likewise), so a trainer
    with `indexer_fp8` ranks keys as the engine did: the top-k differs only where the rounding reorders them."""
    x = x.to(torch.bfloat16).float()
    scale = x.abs().amax(-1, keepdim=True).clamp(min=1e-4) / FP8_E4M3_MAX
    return (x / scale).to(torch.float8_e4m3fn).float() * scale


class Indexer(nn.Module):
    def __init__(self, config: Glm5Config):
        super().__init__()
        self.fp8 = config.indexer_fp8
        self.n_heads = config.index_n_heads
        self.head_dim = config.index_head_dim
        self.rope_dim = config.qk_rope_head_dim
        self.topk = config.index_topk
        self.wq_b = nn.Linear(config.q_lora_rank, self.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(config.hidden_size, self.head_dim, bias=False)
        self.k_norm = nn.LayerNorm(self.head_dim, eps=config.indexer_norm_eps)
        self.weights_proj = nn.Linear(config.hidden_size, self.n_heads, bias=False)
        self.blocks = {"torch": (config.indexer_query_chunk, config.indexer_key_block),
                       "fused": (config.indexer_fused_query_chunk, config.indexer_fused_key_block)}

    def _rope_first(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """RoPE on the first d_r dims ("rope first" in the indexer, "nope first" in MLA)."""
        return torch.cat([apply_rope(x[..., :self.rope_dim], cos, sin), x[..., self.rope_dim:]], dim=-1)

    def queries(self, c_q: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """q^I [B, S, H_I, d_I]."""
        b, s, _ = c_q.shape
        return self._rope_first(self.wq_b(c_q).view(b, s, self.n_heads, self.head_dim), cos, sin)

    def keys(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """k^I [B, S, d_I]: what the indexer K cache stores per token."""
        return self._rope_first(self.k_norm(self.wk(x)), cos, sin)

    def head_weights(self, x: torch.Tensor) -> torch.Tensor:
        """w [B, S, H_I] in fp32 (transformers keeps weights_proj in fp32; SGLang runs it in bf16)."""
        weight = self.weights_proj.weight
        if weight.numel() == 0 and hasattr(weight, "ds_id"):
            raise RuntimeError("GLM-5.2's indexer under ZeRO-3: weights_proj is partitioned here (read outside its "
                               "module's forward): prepare the model with models.glm5.parallel.prepare_for_zero3 "
                               "before deepspeed.initialize")
        return F.linear(x.float(), weight.float()) * self.n_heads ** -0.5

    def scores(self, q: torch.Tensor, w: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        """I [B, c, t] for queries q [B, c, H_I, d_I] (weights w [B, c, H_I]) against keys k [B, t, d_I], fp32
        (fused in one Triton kernel on a GPU in bf16: models/glm5/kernels/indexer.py)."""
        if kernels.usable(q):
            return index_scores_fused(q, w, k, self.head_dim ** -0.5)
        dots = torch.einsum("bchd,btd->bcht", q.float(), k.float()) * self.head_dim ** -0.5
        return torch.einsum("bcht,bch->bct", F.relu(dots), w)

    def engine_rounded(self, q: torch.Tensor, w: torch.Tensor, k: torch.Tensor):
        """(q, w, k) rounded as SGLang's DSA kernels score them: q and k through `fp8_act_quant`, the head gates w
        from a bf16 GEMM (what `indexer_fp8` scores)."""
        scale = self.n_heads ** -0.5
        return fp8_act_quant(q), (w / scale).to(torch.bfloat16).float() * scale, fp8_act_quant(k)

    @torch.no_grad()
    def select(self, q: torch.Tensor, w: torch.Tensor, k: torch.Tensor, query_index: torch.Tensor,
               key_mask: torch.Tensor | None, bounds: torch.Tensor | None = None,
               query_start: torch.Tensor | None = None, margins: bool = False):
        """Streaming top-k → key indices [B, S, min(topk, T)] on the cache axis, −1 where no valid key was left.

        `margins=True` also returns each query's margin [B, S], I_(k) − I_(k+1): how far its k-th best score is
        above the best key left out (+inf where every valid key fits). A row whose margin exceeds twice the
        largest score error between two implementations selects the same keys in both; only the others can
        differ (rollout/indexer_replay.py replays just those). The selection itself is computed as without it.

        q [B, S, H_I, d_I], w [B, S, H_I], k [B, T, d_I] (the cached keys plus the new ones), query_index [B, S]
        the queries' own positions on the cache axis, key_mask [B, T] (1 = real token) or None, bounds
        `layers.key_bounds(query_index)` if already known, query_start [B, S] (packed rows) the first key of each
        query's sample: keys before it are never scored.
        """
        b, s = q.shape[:2]
        t_all = k.shape[1]
        width = min(self.topk, t_all)
        if self.fp8:
            q, w, k = self.engine_rounded(q, w, k)
        out = torch.full((b, s, width), -1, dtype=torch.long, device=q.device)
        margin = torch.full((b, s), float("inf"), device=q.device) if margins else None
        chunk, key_block = self.blocks["fused" if kernels.usable(q) else "torch"]
        # keys past a chunk's last query are invisible to all of it
        key_ends = chunk_key_ends(key_bounds(query_index) if bounds is None else bounds, chunk)
        for a, key_end in zip(range(0, s, chunk), key_ends):
            qi = query_index[:, a:a + chunk]
            first = None if query_start is None else query_start[:, a:a + chunk, None]
            q_c, w_c = q[:, a:a + chunk], w[:, a:a + chunk]
            best_v = torch.full((b, qi.shape[1], width), float("-inf"), device=q.device)
            best_i = torch.full((b, qi.shape[1], width), -1, dtype=torch.long, device=q.device)
            # the k + 1 best scores, kept apart so that the selection's own top-k (and its ties) stay untouched
            runner = torch.full((b, qi.shape[1], width + 1), float("-inf"), device=q.device) if margins else None
            for t0 in range(0, key_end, key_block):
                t1 = min(t0 + key_block, key_end)
                pos = torch.arange(t0, t1, device=q.device)
                v = self.scores(q_c, w_c, k[:, t0:t1])
                ok = pos <= qi[..., None]
                if first is not None:
                    ok = ok & (pos >= first)
                if key_mask is not None:
                    ok = ok & key_mask[:, None, t0:t1].bool()
                v = v.masked_fill(~ok, float("-inf"))
                cand_v = torch.cat([best_v, v], dim=-1)
                cand_i = torch.cat([best_i, pos.expand(b, qi.shape[1], -1)], dim=-1)
                best_v, top = cand_v.topk(width, dim=-1)
                best_i = cand_i.gather(-1, top)
                if margins:
                    runner = torch.cat([runner, v], dim=-1).topk(width + 1, dim=-1).values
            out[:, a:a + qi.shape[1]] = best_i.masked_fill(best_v == float("-inf"), -1)
            if margins:  # no (k+1)-th valid key: nothing was left out, so nothing can differ
                kth, next_ = runner[..., width - 1], runner[..., width]
                margin[:, a:a + qi.shape[1]] = torch.where(next_ == float("-inf"), float("inf"), kth - next_)
        return (out, margin) if margins else out


def causal_indices(query_index: torch.Tensor, key_mask: torch.Tensor | None, num_keys: int,
                   query_start: torch.Tensor | None = None) -> torch.Tensor:
    """The selection when every valid key fits in top-k (T ≤ k): each query's whole causal prefix (from
    `query_start` on in a packed row), [B, S, T], −1 for invisible keys. Used to report/replay what the dense case
    attended to."""
    pos = torch.arange(num_keys, device=query_index.device)
    ok = pos <= query_index[..., None]
    if query_start is not None:
        ok = ok & (pos >= query_start[..., None])
    if key_mask is not None:
        ok = ok & key_mask[:, None, :num_keys].bool()
    return torch.where(ok, pos, torch.full_like(pos, -1))


def indexer_kl_loss(indexer: Indexer, q_idx: torch.Tensor, w_idx: torch.Tensor, k_idx: torch.Tensor,
                    attn_probs_fn, query_index: torch.Tensor, key_mask: torch.Tensor | None,
                    selected: torch.Tensor | None, chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Σ_t KL(p_t ‖ softmax(I_t)) and the number of query tokens it covers (DeepSeek-V3.2 §2.1).

    q_idx/w_idx/k_idx: indexer queries, head weights and keys computed *with* grad from detached inputs.
    attn_probs_fn(a, b, key_idx) → main-attention probabilities of queries [a, b) summed over heads and
    L1-normalised, [B, c, K] over the keys `key_idx` ([B, c, K], −1 = none), detached.
    selected None: the dense warm-up (all causal keys); else [B, S, k] indices: the sparse stage, both
    distributions restricted to S_t. Streams over query chunks, like the selection.
    """
    b, s = q_idx.shape[:2]
    total = q_idx.new_zeros((), dtype=torch.float32)
    count = q_idx.new_zeros((), dtype=torch.float32)
    for a in range(0, s, chunk):
        qi = query_index[:, a:a + chunk]
        if selected is None:
            key_idx = causal_indices(qi, key_mask, int(qi.max()) + 1)
        else:
            key_idx = selected[:, a:a + chunk]
        safe = key_idx.clamp(min=0)
        ok = key_idx >= 0
        k_sel = k_idx.gather(1, safe.flatten(1)[..., None].expand(-1, -1, k_idx.shape[-1]))
        k_sel = k_sel.view(b, qi.shape[1], -1, k_idx.shape[-1])
        dots = torch.einsum("bchd,bckd->bchk", q_idx[:, a:a + chunk].float(), k_sel.float())
        logits = torch.einsum("bchk,bch->bck", F.relu(dots * indexer.head_dim ** -0.5), w_idx[:, a:a + chunk])
        # a large finite fill, not −inf: a row with no valid key must stay finite, or its NaN poisons the backward
        log_q = torch.log_softmax(logits.masked_fill(~ok, -1e30), dim=-1)
        p = attn_probs_fn(a, a + qi.shape[1], key_idx)
        row = ok.any(-1)
        if key_mask is not None:
            row = row & key_mask.bool().gather(1, qi)
        kl = torch.where(ok & (p > 0), p * (torch.log(p.clamp(min=1e-30)) - log_q), torch.zeros_like(p)).sum(-1)
        total = total + (kl * row).sum()
        count = count + row.sum()
    return total, count
