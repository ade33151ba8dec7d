"""Policy-side losses (docs/ALGORITHMS.md §1.6, §1.8, §1.10, §1.11). All take [B, T] tensors aligned with tokens and
return per-token terms; the caller aggregates with `masked_sum(...) / D`, D = the step's global count of
action tokens (whole-batch token-mean, §1.8).
"""

from __future__ import annotations

import torch

from critic.losses import masked_mean, masked_sum


def ppo_policy_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                    clip_low: float = 0.2, clip_high: float = 0.28, dual_clip: float | None = 3.0):
    """Clipped surrogate with an asymmetric clip and the dual clip on negative advantages.

        ρ = exp(clamp(log π − log π_old, −20, 20))
        ℓ_clip = max(−ρÂ, −clip(ρ, 1−ε_low, 1+ε_high)Â)
        ℓ = min(ℓ_clip, −cÂ) if Â < 0 else ℓ_clip                     (dual clip, c > 1)

    Returns (per-token loss, stats) where stats are masked sums (clipped, dual-clipped, approx-KL tokens).
    """
    if dual_clip is not None and dual_clip <= 1.0:
        raise ValueError(f"dual_clip must be > 1, got {dual_clip}")
    log_ratio = (logp - old_logp).clamp(-20.0, 20.0)
    ratio = log_ratio.exp()
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    loss = torch.maximum(unclipped, clipped)
    clip_active = (clipped > unclipped).float()
    dual_active = torch.zeros_like(loss)
    if dual_clip is not None:
        bound = -advantages * dual_clip
        dual_active = ((advantages < 0) & (loss > bound)).float()
        loss = torch.where(advantages < 0, torch.minimum(loss, bound), loss)
    stats = {"clip_tokens": masked_sum(clip_active, mask).detach(),
             "dual_clip_tokens": masked_sum(dual_active, mask).detach(),
             "approx_kl_sum": masked_sum(-log_ratio, mask).detach()}
    return loss, stats


def kl_estimate(logp: torch.Tensor, ref_logp: torch.Tensor, kind: str = "k3") -> torch.Tensor:
    """Per-token KL(π ‖ π_ref) estimators on sampled tokens (Schulman's k1, k2, k3), u = log π − log π_ref.

    k1 = u;  k2 = ½u²;  k3 = e^(−u) − 1 + u (non-negative, low variance; clamped like verl and slime).
    """
    u = logp - ref_logp
    if kind == "k1":
        return u
    if kind == "k2":
        return 0.5 * u.square()
    if kind == "k3":
        neg = (-u).clamp(-20.0, 20.0)
        return (neg.exp() - 1.0 - neg).clamp(-10.0, 10.0)
    raise ValueError(f"unknown KL estimator {kind!r}; use k1, k2 or k3")


def rollout_correction(old_logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor,
                       tis_low: float = 0.5, tis_high: float = 2.0, mask_low: float | None = 0.2,
                       mask_high: float | None = 5.0, veto: float | None = 1e-4,
                       samples: torch.Tensor | None = None, any_rank=None):
    """Importance weights on the behaviour policy (decoupled PPO + token TIS + two-sided mask + veto).

    Decoupled PPO (Hilton et al., 2022; AReaL's asynchronous loop): the tokens were sampled by μ, the engine's
    policy, which differs from the trainer's by numerics and, with trainer.max_staleness = K > 0, by up to K
    weight updates; the proximal policy π_old is the policy at the start of this update. The PPO ratio and its
    clip use π/π_old (ppo_policy_loss); each token's term is weighted by π_old/μ, so stale tokens are corrected,
    not only numerical mismatch:

        ρ^μ = π_old(a) / μ(a);  w = clamp(ρ^μ, tis_low, tis_high) (stop-gradient)
        M = 1[mask_low ≤ ρ^μ ≤ mask_high];  a sequence with any ρ^μ < veto is dropped whole.

    `samples` [B, T]: which sample each position belongs to (−1 none; `MicroBatch.sample_ids`), so that the veto
    drops a sample, not the other samples packed into its row (without it: a row is one sequence).
    `any_rank`: combines the veto flags when each rank sees part of every sample (sequence parallelism: any rank's
    tokens veto the sample on every rank).
    Returns (weights [B, T], keep mask [B, T], stats as masked sums).
    """
    log_rho = (old_logp - rollout_logp).clamp(-20.0, 20.0)
    rho = log_rho.exp() * mask
    weights = rho.clamp(tis_low, tis_high) if tis_high else torch.ones_like(rho)
    keep = mask.clone()
    if mask_low is not None:
        keep = keep * (rho >= mask_low).float()
    if mask_high is not None:
        keep = keep * (rho <= mask_high).float()
    vetoed = torch.zeros(mask.shape[0], dtype=torch.bool, device=mask.device)
    if veto is not None:
        bad = (rho < veto) & mask.bool()
        if samples is None:
            vetoed = bad.any(dim=1)
        else:  # per sample: any of its positions
            count = int(samples.max()) + 1 if samples.numel() else 0
            hits = (bad & (samples >= 0)).flatten().long()
            vetoed = torch.zeros(count, dtype=torch.long, device=mask.device).scatter_add_(
                0, samples.clamp(min=0).flatten(), hits) > 0
        if any_rank is not None:
            vetoed = any_rank(vetoed)
        dropped = vetoed.unsqueeze(1) if samples is None else vetoed[samples.clamp(min=0)] & (samples >= 0)
        keep = keep * (~dropped).float()
    stats = {"tis_truncated_tokens": masked_sum(((rho > tis_high) | (rho < tis_low)).float(), mask),
             "mismatch_masked_tokens": masked_sum(1.0 - keep, mask),
             "mismatch_abs_logp_sum": masked_sum((old_logp - rollout_logp).abs(), mask),
             # KL(μ ‖ π_old) on μ's own samples (k3): how far the trainer's policy is from the one that sampled
             "mismatch_kl_sum": masked_sum(kl_estimate(rollout_logp, old_logp, "k3"), mask),
             "vetoed_sequences": vetoed.float().sum()}
    return weights.detach(), keep.detach(), stats


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    mean = masked_mean(x, mask)
    var = masked_mean((x - mean).square(), mask)
    return ((x - mean) * torch.rsqrt(var + eps)) * mask
