"""The OPD signal (docs/ALGORITHMS.md §3.1, §3.5).

Per action token t of a trajectory routed to teacher T:

    d̂_t = log μ(a_t | h_t) − log π_T(a_t | h_t)          (sampled reverse KL, student first; μ = the rollout policy)
    Â_t = Â_t^RL − λ · clip(d̂_t, −d_max, d_max)           (Â^RL = 0 in pure OPD)

d̂ is local to its token (discount zero): it is added after GAE, never run through it. Its mean over a domain's
tokens is the per-domain reverse-KL estimate that should fall during distillation.
"""

from __future__ import annotations

import torch


def opd_advantages(samples: list[dict], kl_coef: float, kl_clip: float, add_to_existing: bool = False) -> dict:
    """Set (or add to) `advantages` of every sample (float32 tensors) from its `rollout_logprobs` and
    `teacher_logprobs`. Samples carry `domain`. Returns per-domain reverse-KL means and the clipped fraction."""
    sums: dict[str, float] = {}
    counts: dict[str, int] = {}
    clipped = tokens = 0
    for s in samples:
        mask = torch.as_tensor(s["loss_mask"]) > 0
        d = (torch.as_tensor(s["rollout_logprobs"], dtype=torch.float64)
             - torch.as_tensor(s["teacher_logprobs"], dtype=torch.float64))[mask]
        c = d.clamp(-kl_clip, kl_clip)
        adv = torch.as_tensor(s["advantages"], dtype=torch.float64).clone() if add_to_existing \
            else torch.zeros(len(mask), dtype=torch.float64)
        adv[mask] -= kl_coef * c
        s["advantages"] = adv.float()
        sums[s["domain"]] = sums.get(s["domain"], 0.0) + float(d.sum())
        counts[s["domain"]] = counts.get(s["domain"], 0) + len(d)
        clipped += int((c != d).sum())
        tokens += len(d)
    metrics = {f"opd/reverse_kl/{dom}": sums[dom] / counts[dom] for dom in sums if counts[dom]}
    metrics["opd/reverse_kl"] = sum(sums.values()) / max(tokens, 1)
    metrics["opd/clipped_frac"] = clipped / max(tokens, 1)
    metrics["opd/tokens"] = tokens
    return metrics
