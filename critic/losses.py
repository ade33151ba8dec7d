"""Masked reductions and the critic's clipped value loss (docs/ALGORITHMS.md §1.7)."""

from __future__ import annotations

import torch


def masked_sum(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (x * mask).sum()


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (x * mask).sum() / mask.sum().clamp(min=1)


def value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, clip: float | None = 0.2):
    """Per-token ½·max((V − G)², (V_old + clip(V − V_old, −ε, ε) − G)²) and where the clipped branch won.

    V_old are the critic's values at the start of the step (the ones GAE used); ε bounds how far one step
    moves a value, in reward units.
    """
    plain = (values - returns).square()
    if clip is None:
        return 0.5 * plain, torch.zeros_like(plain)
    clipped_v = old_values + (values - old_values).clamp(-clip, clip)
    clipped = (clipped_v - returns).square()
    return 0.5 * torch.maximum(plain, clipped), (clipped > plain).float()


def explained_variance(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> float:
    """1 − Var[G − V] / Var[G] over action tokens (1: perfect critic, 0: no better than a constant)."""
    m = mask.bool()
    if int(m.sum()) < 2:
        return float("nan")
    g, v = returns[m].double(), values[m].double()
    var_g = g.var()
    return float("nan") if var_g <= 0 else float(1.0 - (g - v).var() / var_g)


def explained_variance_from_sums(n: float, sum_g: float, sum_g2: float, sum_d: float, sum_d2: float) -> float:
    """`explained_variance` from sums over the action tokens (n, Σg, Σg², Σd, Σd² with d = G − V), which add up
    across ranks: 1 − Var[d] / Var[g] (the 1/n or 1/(n−1) of both variances cancels)."""
    if n < 2:
        return float("nan")
    var_g = sum_g2 / n - (sum_g / n) ** 2
    var_d = sum_d2 / n - (sum_d / n) ** 2
    return float("nan") if var_g <= 0 else 1.0 - var_d / var_g
