"""Token sampling with the log-probability of the sampled token under the distribution actually sampled from.

For temperature T, top-k K and top-p P the behaviour distribution μ is softmax(logits / T) restricted to the
top-k tokens and then to the smallest prefix (by probability) whose mass reaches P, renormalised. The trainer
recomputes π(x) as softmax(logits / T) over the full vocabulary, so with K = 0 and P = 1 (the defaults) the
two coincide exactly; with truncation the importance correction of docs/ALGORITHMS.md §1.11 sees the difference.
Greedy decoding (T = 0) reports log softmax(logits) of the chosen token.
"""

from __future__ import annotations

import torch


def processed_logprobs(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                       top_p: torch.Tensor) -> torch.Tensor:
    """Row-wise log μ over the vocabulary. logits [B, V] (fp32); temperature, top_p [B] float; top_k [B] long."""
    greedy = temperature <= 0
    t = torch.where(greedy, torch.ones_like(temperature), temperature)
    scaled = logits / t.unsqueeze(-1)
    vocab = logits.shape[-1]
    k = torch.where((top_k > 0) & (top_k < vocab) & ~greedy, top_k, torch.full_like(top_k, vocab))
    top_p = torch.where(greedy, torch.ones_like(top_p), top_p)
    needs_trunc = (k < vocab) | (top_p < 1.0)
    if bool(needs_trunc.any()):
        sorted_logits, order = scaled.sort(dim=-1, descending=True)
        ranks = torch.arange(vocab, device=logits.device).unsqueeze(0)
        drop = ranks >= k.unsqueeze(-1)
        probs = torch.softmax(sorted_logits.masked_fill(drop, float("-inf")), dim=-1)
        mass_before = probs.cumsum(-1) - probs  # mass of strictly better tokens
        drop |= mass_before >= top_p.unsqueeze(-1)
        drop[:, 0] = False  # the best token always stays
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        scaled = torch.empty_like(scaled).scatter_(-1, order, sorted_logits)
    return torch.log_softmax(scaled, dim=-1)


def sample(logprobs: torch.Tensor, greedy: torch.Tensor, generators: list[torch.Generator | None]):
    """Draw one token per row from exp(logprobs); returns (tokens [B], their logprobs [B]).

    Exponential race (Gumbel-max): with E_v ~ Exp(1) i.i.d., argmax_v log μ_v − log E_v is distributed as μ.
    Each row's noise comes from its own generator, so a seeded request draws the same tokens whatever batch it
    is in, and nothing waits on the device: one vectorised argmax instead of a multinomial (and a host sync)
    per row, which on a GPU was most of a decode step.
    """
    noise = torch.stack([torch.empty(logprobs.shape[-1], device=logprobs.device).exponential_(generator=gen)
                         for gen in generators])
    scores = torch.where(greedy.unsqueeze(-1), logprobs, logprobs - noise.log())
    tokens = scores.argmax(dim=-1)
    return tokens, logprobs.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


def verify_drafts(target_logp: torch.Tensor, draft_logp: torch.Tensor, drafts: torch.Tensor, greedy: torch.Tensor,
                  generators: list[torch.Generator | None]) -> tuple[torch.Tensor, torch.Tensor]:
    """Speculative sampling (Leviathan et al. 2023; Chen et al. 2023): which drafts each row keeps, and the token
    that follows them, such that every emitted token is distributed exactly as the target's μ.

    target_logp [B, k+1, V]: log μ at the k+1 verified positions (position j scores draft j+1; position k the
    bonus token after all k); draft_logp [B, k, V]: log q of the drafter at each draft; drafts [B, k].
    Draft j is kept with probability min(1, μ_j(d)/q_j(d)) (greedy: iff it is μ's argmax), up to the first
    rejection; then the next token is drawn from the residual norm(max(0, μ_m − q_m)) (greedy: μ's argmax), or
    after k acceptances from μ_k. Vectorised over rows, no host sync. Returns (kept counts [B], next tokens [B]).
    """
    b, k = drafts.shape
    rows = torch.arange(b, device=drafts.device)
    u = torch.stack([torch.rand(k, device=drafts.device, generator=g) for g in generators])
    logp_d = target_logp[:, :k].gather(-1, drafts.unsqueeze(-1)).squeeze(-1)
    logq_d = draft_logp.gather(-1, drafts.unsqueeze(-1)).squeeze(-1)
    ok = torch.where(greedy.unsqueeze(-1), target_logp[:, :k].argmax(-1) == drafts, u.log() < logp_d - logq_d)
    kept = ok.long().cumprod(1).sum(1)  # drafts before the first rejection
    mu = target_logp[rows, kept].exp()
    residual = (mu - draft_logp[rows, kept.clamp(max=k - 1)].exp()).clamp(min=0)
    use_residual = (kept < k) & (residual.sum(-1) > 0)  # μ = q exactly: the rejection had probability 0
    dist = torch.where(use_residual.unsqueeze(-1), residual, mu)
    following, _ = sample(dist.log(), greedy, generators)  # greedy rows: argmax μ_m (residual unused)
    following = torch.where(greedy, mu.argmax(-1), following)
    return kept, following
