import math

import pytest
import torch

from critic.losses import masked_sum
from rl.losses import kl_estimate, masked_whiten, ppo_policy_loss, rollout_correction


def naive_ppo(logp, old, adv, lo, hi, c):
    """Per-token reference written from the equations, one scalar at a time."""
    ratio = math.exp(max(-20.0, min(20.0, logp - old)))
    unclipped = -adv * ratio
    clipped = -adv * min(max(ratio, 1 - lo), 1 + hi)
    loss = max(unclipped, clipped)
    if c is not None and adv < 0:
        loss = min(loss, -c * adv)
    return loss


@pytest.mark.parametrize("dual", [None, 3.0])
def test_ppo_matches_scalar_reference(dual):
    g = torch.Generator().manual_seed(1)
    logp = torch.randn(4, 9, generator=g) * 0.5 - 2
    old = logp + torch.randn(4, 9, generator=g) * 0.6
    adv = torch.randn(4, 9, generator=g)
    mask = (torch.rand(4, 9, generator=g) < 0.7).float()
    loss, stats = ppo_policy_loss(logp, old, adv, mask, 0.2, 0.28, dual)
    for i in range(4):
        for j in range(9):
            ref = naive_ppo(float(logp[i, j]), float(old[i, j]), float(adv[i, j]), 0.2, 0.28, dual)
            assert float(loss[i, j]) == pytest.approx(ref, rel=1e-5, abs=1e-6)
    assert stats["approx_kl_sum"] == pytest.approx(float(((old - logp) * mask).sum()), rel=1e-5)


def test_ppo_clip_cases_by_hand():
    old = torch.zeros(4)
    logp = torch.log(torch.tensor([1.5, 1.5, 0.5, 10.0]))  # ratios 1.5, 1.5, 0.5, 10
    adv = torch.tensor([1.0, -1.0, 1.0, -1.0])
    loss, stats = ppo_policy_loss(logp, old, adv, torch.ones(4), 0.2, 0.28, 3.0)
    # A>0, ρ=1.5 > 1.28: clipped → -1.28.  A<0, ρ=1.5: max(1.5, 1.28) = 1.5 (no clip).
    # A>0, ρ=0.5: max(-0.5, -0.8) = -0.5.  A<0, ρ=10: max(10, 1.28) = 10 → dual clip: min(10, 3) = 3
    assert loss.tolist() == pytest.approx([-1.28, 1.5, -0.5, 3.0])
    assert stats["clip_tokens"].item() == 1 and stats["dual_clip_tokens"].item() == 1


def test_ppo_gradient_direction():
    logp = torch.tensor([-1.0, -1.0], requires_grad=True)
    loss, _ = ppo_policy_loss(logp, logp.detach(), torch.tensor([1.0, -1.0]), torch.ones(2))
    loss.sum().backward()
    assert logp.grad.tolist() == [-1.0, 1.0]  # descent raises the good token, lowers the bad one


def test_kl_estimators():
    logp, ref = torch.tensor([-1.0]), torch.tensor([-1.5])
    u = 0.5
    assert kl_estimate(logp, ref, "k1").item() == pytest.approx(u)
    assert kl_estimate(logp, ref, "k2").item() == pytest.approx(0.5 * u * u)
    assert kl_estimate(logp, ref, "k3").item() == pytest.approx(math.exp(-u) - 1 + u)
    assert kl_estimate(ref, ref, "k3").item() == 0.0
    with pytest.raises(ValueError):
        kl_estimate(logp, ref, "k9")


def test_rollout_correction():
    old = torch.log(torch.tensor([[0.5, 0.5, 0.5, 0.5]]))
    rollout = torch.log(torch.tensor([[0.5, 0.1, 0.9, 0.5]]))  # ρ = 1, 5, 0.556, 1
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    w, keep, stats = rollout_correction(old, rollout, mask, 0.5, 2.0, 0.2, 4.0, None)
    assert w[0, :3].tolist() == pytest.approx([1.0, 2.0, 0.5 / 0.9])
    assert keep.tolist() == [[1.0, 0.0, 1.0, 0.0]]  # ρ = 5 > 4 masked; the padding stays 0
    assert stats["tis_truncated_tokens"].item() == 1
    _, keep_v, stats_v = rollout_correction(old, torch.log(torch.tensor([[0.5, 0.5, 0.99999, 0.5]])) +
                                            torch.tensor([[0.0, 0.0, 0.0, 0.0]]), mask, veto=0.6)
    assert keep_v.sum() == 0 and stats_v["vetoed_sequences"].item() == 1


def test_the_veto_drops_a_sample_not_the_row_it_is_packed_into():
    """A packed row holds samples end to end: one sample's tiny ρ vetoes that sample only (once a row's)."""
    old = torch.log(torch.full((2, 6), 0.5))
    rollout = old.clone()
    rollout[0, 4] = torch.log(torch.tensor(0.99999))  # ρ ≈ 0.5 < veto 0.6, in row 0's second sample
    mask = torch.tensor([[0.0, 1.0, 1.0, 0.0, 1.0, 1.0], [0.0, 1.0, 1.0, 1.0, 1.0, 0.0]])
    samples = torch.tensor([[0, 0, 0, 1, 1, 1], [2, 2, 2, 2, 2, -1]])
    _, keep, stats = rollout_correction(old, rollout, mask, veto=0.6, mask_low=None, mask_high=None,
                                        samples=samples)
    assert keep.tolist() == [[0.0, 1.0, 1.0, 0.0, 0.0, 0.0], [0.0, 1.0, 1.0, 1.0, 1.0, 0.0]]
    assert stats["vetoed_sequences"].item() == 1
    _, keep_row, _ = rollout_correction(old, rollout, mask, veto=0.6, mask_low=None, mask_high=None)
    assert keep_row[0].sum() == 0  # without sample ids the row is one sequence
    # across ranks: another rank's part of sample 2 vetoes it here too
    _, keep_any, _ = rollout_correction(old, rollout, mask, veto=0.6, mask_low=None, mask_high=None,
                                        samples=samples, any_rank=lambda v: v | torch.tensor([False, False, True]))
    assert keep_any[1].sum() == 0 and keep_any[0, 1:3].tolist() == [1.0, 1.0]


def test_masked_whiten():
    x = torch.tensor([1.0, 2.0, 3.0, 100.0])
    m = torch.tensor([1.0, 1.0, 1.0, 0.0])
    y = masked_whiten(x, m)
    assert y[:3].mean().abs() < 1e-6 and y[3] == 0


def test_decoupled_ppo_corrects_stale_tokens_by_hand():
    """Tokens sampled by a stale behaviour policy μ (trainer.max_staleness > 0); the proximal policy π_old is
    the policy at the start of the update. Per token ρ^μ = π_old/μ = 2, 0.5, 1, 8: weights clamp(ρ^μ, 0.5, 2) =
    2, 0.5, 1, 2 and the last token (ρ^μ > 5) masked. At π = π_old the PPO ratio is 1, so the loss is Σ −A·w over
    the kept tokens and its gradient with respect to log π is −A·w there, 0 on the masked one."""
    old = torch.log(torch.tensor([[0.5, 0.2, 0.1, 0.4]]))
    behaviour = torch.log(torch.tensor([[0.25, 0.4, 0.1, 0.05]]))
    adv = torch.tensor([[1.0, -1.0, 2.0, 1.0]])
    mask = torch.ones(1, 4)
    weights, keep, stats = rollout_correction(old, behaviour, mask, 0.5, 2.0, 0.2, 5.0, None)
    assert torch.allclose(weights, torch.tensor([[2.0, 0.5, 1.0, 2.0]]))
    assert keep.tolist() == [[1.0, 1.0, 1.0, 0.0]] and float(stats["mismatch_masked_tokens"]) == 1.0
    logp = old.clone().requires_grad_()
    pg, _ = ppo_policy_loss(logp, old, adv, mask, 0.2, 0.28, 3.0)
    loss = masked_sum(pg * weights, mask * keep)
    loss.backward()
    assert abs(float(loss) - (-2.0 + 0.5 - 2.0)) < 1e-6
    assert torch.allclose(logp.grad, torch.tensor([[-2.0, 0.5, -2.0, 0.0]]))
    # A later optimiser step: π moved up by 50% on token 0 (A > 0): the ratio 1.5 is past 1 + 0.28, clipped,
    # and that token's gradient is zero while the others keep theirs (scaled by their ratio, here 1).
    moved = (old + torch.log(torch.tensor([[1.5, 1.0, 1.0, 1.0]]))).requires_grad_()
    pg, _ = ppo_policy_loss(moved, old, adv, mask, 0.2, 0.28, 3.0)
    masked_sum(pg * weights, mask * keep).backward()
    assert torch.allclose(moved.grad, torch.tensor([[0.0, 0.5, -2.0, 0.0]]))
