"""The per-timestep GAE loop with observation skipping, as verl writes it (core_algos.compute_gae_advantage_return).

Kept as the slow, obviously-correct reference for tests and for bench/gae.py. At non-action positions the
running advantage and the bootstrap value are carried through unchanged; we then zero them, as our contract
gives non-action tokens advantage 0 and no target.
"""

from __future__ import annotations

import torch


def gae_naive(rewards: torch.Tensor, values: torch.Tensor, action_mask: torch.Tensor, gamma: float,
              lam: float) -> tuple[torch.Tensor, torch.Tensor]:
    mask = action_mask.to(values.dtype)
    b, t = values.shape
    next_value = torch.zeros(b, dtype=values.dtype)
    last_gae = torch.zeros(b, dtype=values.dtype)
    advantages = torch.zeros_like(values)
    for i in reversed(range(t)):
        delta = rewards[:, i] + gamma * next_value - values[:, i]
        gae = delta + gamma * lam * last_gae
        next_value = values[:, i] * mask[:, i] + (1 - mask[:, i]) * next_value
        last_gae = gae * mask[:, i] + (1 - mask[:, i]) * last_gae
        advantages[:, i] = last_gae
    advantages = advantages * mask
    returns = (advantages + values) * mask
    return advantages, returns
