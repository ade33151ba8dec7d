"""Token-level GAE that skips non-action tokens, vectorised (ALGORITHMS.md §1.4-1.5).

Over the action positions a_1 < … < a_N of one trajectory (all its segments in time order):

    δ_j = r_{a_j} + γ V_{a_{j+1}} − V_{a_j},      V_{a_{N+1}} := 0
    Â_j = δ_j + γλ Â_{j+1},                       Â_{N+1} := 0
    G_j = Â_j + V_{a_j}                            (value target)

Observation and template tokens (action_mask = 0) are not time steps: they neither discount nor bootstrap,
and they get advantage 0 and no target. A reward placed on a non-action token belongs to the last action token
before it (the action whose consequence the observation reveals).

The recursion is a linear scan. We pack each row's action positions to the front (a stable argsort), solve the
scan in chunks of C positions with one batched matmul against the discount matrix D[i, j] = (γλ)^(j−i) (j ≥ i),
and carry the chunk boundaries backwards in N/C small steps. Cost: O(B·N·C) flops in large kernels instead of
N sequential steps of tiny kernels (the per-timestep loop verl runs; `critic.reference.gae_naive`).
"""

from __future__ import annotations

import torch

CHUNK = 128


def _move_rewards_to_actions(rewards: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    stray = rewards.masked_fill(mask, 0.0)
    if not bool(stray.ne(0).any()):
        return rewards.masked_fill(~mask, 0.0)
    positions = torch.arange(mask.shape[1], device=mask.device).expand_as(mask)
    last_action = torch.where(mask, positions, torch.full_like(positions, -1)).cummax(dim=1).values
    if bool((stray.ne(0) & (last_action < 0)).any()):
        raise ValueError("compute_gae: a reward sits before the first action token of its row")
    out = rewards.masked_fill(~mask, 0.0)
    return out.scatter_add(1, last_action.clamp(min=0), stray)


def _discounted_reverse_cumsum(delta: torch.Tensor, c: torch.Tensor, chunk: int) -> torch.Tensor:
    """A_j = Σ_{k≥j} c^(k−j) δ_k along dim 1 for each row (c: [B])."""
    b, n = delta.shape
    k = -(-n // chunk)
    x = torch.nn.functional.pad(delta, (0, k * chunk - n)).view(b, k, chunk)
    steps = torch.arange(chunk, device=delta.device, dtype=delta.dtype)
    gap = steps.view(1, -1) - steps.view(-1, 1)  # gap[i, j] = j − i
    upper = gap >= 0
    cb = c.view(b, 1, 1)
    decay = torch.where(upper, cb ** gap.clamp(min=0), torch.zeros((), dtype=delta.dtype, device=delta.device))
    local = torch.einsum("bkj,bij->bki", x, decay)  # within-chunk sums
    tail = c.view(b, 1) ** (chunk - steps).view(1, -1)  # c^(C−i): weight of the next chunk's start
    carry = torch.zeros(b, k + 1, dtype=delta.dtype, device=delta.device)
    c_chunk = c ** chunk
    for i in range(k - 1, -1, -1):
        carry[:, i] = local[:, i, 0] + c_chunk * carry[:, i + 1]
    out = local + tail.unsqueeze(1) * carry[:, 1:].unsqueeze(-1)
    return out.reshape(b, k * chunk)[:, :n]


def compute_gae(rewards: torch.Tensor, values: torch.Tensor, action_mask: torch.Tensor, gamma: float = 1.0,
                lam: float | torch.Tensor = 1.0, chunk: int = CHUNK) -> tuple[torch.Tensor, torch.Tensor]:
    """Skip-observation GAE on [B, T] rows, each one trajectory's segment chain; the row's end is terminal.

    `lam` is a float or a [B] tensor (length-adaptive λ per trajectory). Returns (advantages, returns), both
    [B, T] in the dtype of `values`, zero where `action_mask` is 0.
    """
    if rewards.shape != values.shape or values.shape != action_mask.shape or values.dim() != 2:
        raise ValueError(f"compute_gae: rewards {tuple(rewards.shape)}, values {tuple(values.shape)} and "
                         f"action_mask {tuple(action_mask.shape)} must be the same [B, T] shape")
    out_dtype = values.dtype
    mask = action_mask.bool()
    r = _move_rewards_to_actions(rewards.double(), mask)
    v = values.double().masked_fill(~mask, 0.0)
    b, t = v.shape
    lam_t = torch.as_tensor(lam, dtype=torch.float64, device=v.device).expand(b) if not torch.is_tensor(lam) \
        else lam.to(device=v.device, dtype=torch.float64).expand(b)

    order = torch.argsort((~mask).to(torch.int8), dim=1, stable=True)  # action positions first, in order
    n = mask.sum(1)
    width = int(n.max()) if b else 0
    if width == 0:
        zeros = torch.zeros_like(values)
        return zeros, zeros.clone()
    order = order[:, :width]
    valid = torch.arange(width, device=v.device).view(1, -1) < n.view(-1, 1)
    r_p = r.gather(1, order).masked_fill(~valid, 0.0)
    v_p = v.gather(1, order).masked_fill(~valid, 0.0)
    v_next = torch.nn.functional.pad(v_p[:, 1:], (0, 1))  # 0 past the last action (terminal)
    delta = (r_p + gamma * v_next - v_p).masked_fill(~valid, 0.0)
    adv_p = _discounted_reverse_cumsum(delta, gamma * lam_t, chunk).masked_fill(~valid, 0.0)

    advantages = torch.zeros(b, t, dtype=torch.float64, device=v.device).scatter(1, order, adv_p)
    advantages = advantages.masked_fill(~mask, 0.0)
    returns = (advantages + v).masked_fill(~mask, 0.0)
    return advantages.to(out_dtype), returns.to(out_dtype)


def adaptive_lambda(num_action_tokens: torch.Tensor, alpha: float) -> torch.Tensor:
    """VAPO's length-adaptive λ = 1 − 1/(α·ℓ), ℓ = action tokens of the trajectory (ALGORITHMS.md §1.4.2)."""
    length = num_action_tokens.clamp(min=1).double()
    return (1.0 - 1.0 / (alpha * length)).clamp(min=0.0, max=1.0)
