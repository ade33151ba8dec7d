"""The OPD signal (docs/ALGORITHMS.md §3.1, §3.5).

Per action token t of a trajectory routed to teacher T:

    d̂_t = log μ(a_t | h_t) − log π_T(a_t | h_t)          (sampled reverse KL, student first; μ = the rollout policy)
    Â_t = Â_t^RL − λ · clip(d̂_t, −d_max, d_max)           (Â^RL = 0 in pure OPD)

d̂ is local to its token (discount zero): it is added after GAE, never run through it. Its mean over a domain's
tokens is the per-domain reverse-KL estimate that should fall during distillation.
"""

from __future__ import annotations


def opd_advantages(samples: list[dict], kl_coef: float, kl_clip: float, add_to_existing: bool = False) -> dict:
    """Set (or add to) `advantages` of every sample from its `rollout_logprobs` and `teacher_logprobs`.
    Samples carry `domain`. Returns per-domain reverse-KL means and the clipped fraction."""
    per_domain: dict[str, list[float]] = {}
    clipped = tokens = 0
    for s in samples:
        mask, mu, teacher = s["loss_mask"], s["rollout_logprobs"], s["teacher_logprobs"]
        adv = list(s["advantages"]) if add_to_existing else [0.0] * len(mask)
        for i, m in enumerate(mask):
            if not m:
                continue
            d = mu[i] - teacher[i]
            per_domain.setdefault(s["domain"], []).append(d)
            c = max(-kl_clip, min(kl_clip, d))
            clipped += c != d
            tokens += 1
            adv[i] -= kl_coef * c
        s["advantages"] = adv
    metrics = {f"opd/reverse_kl/{d}": sum(v) / len(v) for d, v in per_domain.items()}
    metrics["opd/reverse_kl"] = sum(sum(v) for v in per_domain.values()) / max(tokens, 1)
    metrics["opd/clipped_frac"] = clipped / max(tokens, 1)
    metrics["opd/tokens"] = tokens
    return metrics
