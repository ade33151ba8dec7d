"""Token-level GAE that skips non-action tokens, vectorised (docs/ALGORITHMS.md §1.4-1.5).

Over the action positions a_1 < … < a_N of one trajectory (all its segments in time order):

    δ_j = r_{a_j} + γ V_{a_{j+1}} − V_{a_j},      V_{a_{N+1}} := 0
    Â_j = δ_j + γλ Â_{j+1},                       Â_{N+1} := 0
    G_j = Â_j + V_{a_j}                            (value target)

Observation and template tokens (action_mask = 0) are not time steps: they neither discount nor bootstrap,
and they get advantage 0 and no target. A reward placed on a non-action token belongs to the last action token
before it (the action whose consequence the observation reveals).

The recursion is a linear scan. We pack each row's action positions to the front (slot = running count), solve the
scan in chunks of C positions with one matmul against the discount matrix D[i, j] = (γλ)^(j−i) (j ≥ i), and
link the chunks with a second, small matmul of the same form (factor (γλ)^C). No sequential loop at all:
O(B·N·C) flops in large kernels instead of N sequential steps of tiny kernels (the per-timestep loop verl runs;
`critic.reference.gae_naive`). Work is in float32, or float64 when the inputs are float64.
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


def _decay_matrix(c: torch.Tensor, size: int, dtype: torch.dtype) -> torch.Tensor:
    """D[i, j] = c^(j−i) for j ≥ i, else 0; [size, size], or [B, size, size] for a per-row c."""
    steps = torch.arange(size, device=c.device, dtype=dtype)
    gap = steps.view(1, -1) - steps.view(-1, 1)
    powers = gap.clamp(min=0)
    base = c.to(dtype).view(-1, 1, 1) if c.dim() else c.to(dtype)
    return torch.where(gap >= 0, base ** powers, torch.zeros((), dtype=dtype, device=c.device))


def _discounted_reverse_cumsum(delta: torch.Tensor, c: torch.Tensor, chunk: int) -> torch.Tensor:
    """A_j = Σ_{k≥j} c^(k−j) δ_k along dim 1 of each row (c: [B], or a scalar shared by all rows).

    Two levels of the same identity: within chunks of C positions, one matmul against the decay matrix; then
    the chunk starts are themselves a discounted reverse sum with factor c^C, one more (small) matmul.
    """
    b, n = delta.shape
    k = -(-n // chunk)
    dtype = delta.dtype
    x = torch.nn.functional.pad(delta, (0, k * chunk - n)).view(b, k, chunk)
    inner = _decay_matrix(c, chunk, dtype)
    outer = _decay_matrix(c ** chunk, k, dtype)
    steps = torch.arange(chunk, device=delta.device, dtype=dtype)
    if c.dim() == 0:
        local = (x.reshape(b * k, chunk) @ inner.T).view(b, k, chunk)
        carry = local[:, :, 0] @ outer.T  # carry[i] = Σ_{j≥i} (c^C)^(j−i) · start_j
        tail = (c.to(dtype) ** (chunk - steps)).view(1, 1, -1)
    else:
        local = torch.einsum("bkj,bij->bki", x, inner)
        carry = torch.einsum("bj,bij->bi", local[:, :, 0], outer)
        tail = (c.to(dtype).view(b, 1) ** (chunk - steps).view(1, -1)).unsqueeze(1)
    next_carry = torch.nn.functional.pad(carry[:, 1:], (0, 1))  # what flows in from the following chunk
    out = local + tail * next_carry.unsqueeze(-1)
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
    b, t = mask.shape
    n = mask.sum(1)
    width = int(n.max()) if b else 0
    if width == 0:
        zeros = torch.zeros_like(values)
        return zeros, zeros.clone()
    # Pack every row's action tokens to the front, in order: slot = number of earlier action tokens. One
    # nonzero() gives flat indices; everything after is index_select / index_put on 1-D indices.
    flat = mask.reshape(-1).nonzero().squeeze(1)
    rows = torch.div(flat, t, rounding_mode="floor")
    slots = mask.to(torch.int32).cumsum(1).reshape(-1).index_select(0, flat).long() - 1
    packed = rows * width + slots
    work = torch.promote_types(values.dtype, torch.float32)  # float64 inputs stay float64
    r_act = _move_rewards_to_actions(rewards, mask).reshape(-1).index_select(0, flat).to(work)
    v_act = values.reshape(-1).index_select(0, flat).to(work)
    r_p = torch.zeros(b * width, dtype=work, device=mask.device).index_put_((packed,), r_act).view(b, width)
    v_p = torch.zeros(b * width, dtype=work, device=mask.device).index_put_((packed,), v_act).view(b, width)
    valid = torch.arange(width, device=mask.device).view(1, -1) < n.view(-1, 1)
    lam_t = lam.to(device=mask.device, dtype=work) if torch.is_tensor(lam) else torch.tensor(lam, dtype=work)
    if bool((lam_t == 1).all()):
        # λ = 1: the δ's telescope, Â_j = Σ_{k≥j} γ^(k−j) r_k − V_j. Summing the rewards (sparse) instead of
        # the δ's avoids accumulating rounding over thousands of terms.
        adv_p = _discounted_reverse_cumsum(r_p, torch.tensor(gamma, dtype=work, device=mask.device), chunk) - v_p
    else:
        v_next = torch.nn.functional.pad(v_p[:, 1:], (0, 1))  # 0 past the last action (terminal)
        delta = (r_p + gamma * v_next - v_p).masked_fill(~valid, 0.0)
        c = gamma * lam_t.to(mask.device)
        if c.dim() == 1 and bool((c == c[0]).all()):
            c = c[0]
        adv_p = _discounted_reverse_cumsum(delta, c, chunk)

    adv_act = adv_p.reshape(-1).index_select(0, packed)
    advantages = torch.zeros(b * t, dtype=out_dtype, device=mask.device).index_put_((flat,), adv_act.to(out_dtype))
    returns = torch.zeros(b * t, dtype=out_dtype, device=mask.device).index_put_((flat,), (adv_act + v_act).to(out_dtype))
    return advantages.view(b, t), returns.view(b, t)


def adaptive_lambda(num_action_tokens: torch.Tensor, alpha: float) -> torch.Tensor:
    """VAPO's length-adaptive λ = 1 − 1/(α·ℓ), ℓ = action tokens of the trajectory (docs/ALGORITHMS.md §1.4.2)."""
    length = num_action_tokens.clamp(min=1).double()
    return (1.0 - 1.0 / (alpha * length)).clamp(min=0.0, max=1.0)
