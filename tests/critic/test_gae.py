import pytest
import torch

from critic.gae import adaptive_lambda, compute_gae
from critic.reference import gae_naive


def test_hand_computed_skip_observation():
    # tokens:  a0  obs  a1  obs  a2        (a = action, obs = observation)
    # values:  1   9    2   9    3         (values on observation tokens must be ignored)
    # reward 1 on a2; γ = 0.5, λ = 0.5
    v = torch.tensor([[1.0, 9.0, 2.0, 9.0, 3.0]])
    r = torch.tensor([[0.0, 0.0, 0.0, 0.0, 1.0]])
    m = torch.tensor([[1, 0, 1, 0, 1]])
    adv, ret = compute_gae(r, v, m, gamma=0.5, lam=0.5)
    d2 = 1 + 0.5 * 0 - 3          # -2
    d1 = 0 + 0.5 * 3 - 2          # -0.5
    d0 = 0 + 0.5 * 2 - 1          # 0
    a2 = d2
    a1 = d1 + 0.25 * a2           # -1.0
    a0 = d0 + 0.25 * a1           # -0.25
    assert adv.tolist() == [[a0, 0.0, a1, 0.0, a2]]
    assert ret.tolist() == [[a0 + 1, 0.0, a1 + 2, 0.0, a2 + 3]]


def test_gamma_lambda_one_is_return_minus_value():
    v = torch.tensor([[0.5, 0.1, 0.2, 0.7]])
    r = torch.tensor([[0.0, 0.0, 0.0, 1.0]])
    m = torch.ones(1, 4)
    adv, ret = compute_gae(r, v, m, 1.0, 1.0)
    assert torch.allclose(adv, 1.0 - v)
    assert torch.allclose(ret, torch.ones(1, 4))


def test_reward_on_observation_moves_to_previous_action():
    v = torch.zeros(1, 4)
    m = torch.tensor([[1, 1, 0, 0]])
    r_obs = torch.tensor([[0.0, 0.0, 0.0, 2.0]])
    r_act = torch.tensor([[0.0, 2.0, 0.0, 0.0]])
    assert torch.equal(compute_gae(r_obs, v, m, 0.9, 0.8)[0], compute_gae(r_act, v, m, 0.9, 0.8)[0])
    with pytest.raises(ValueError):
        compute_gae(torch.tensor([[1.0, 0.0]]), torch.zeros(1, 2), torch.tensor([[0, 1]]))


@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (0.99, 0.95), (1.0, 0.9), (0.9, 0.0), (0.5, 1.0)])
@pytest.mark.parametrize("shape", [(1, 1), (3, 17), (8, 300), (5, 1000)])
def test_matches_naive_loop(gamma, lam, shape):
    g = torch.Generator().manual_seed(hash((gamma, lam, shape)) % 2**31)
    b, t = shape
    m = torch.rand(b, t, generator=g) < 0.5
    v = torch.randn(b, t, generator=g, dtype=torch.float64)
    r = torch.randn(b, t, generator=g, dtype=torch.float64) * m  # rewards on action tokens (KL shaping style)
    adv, ret = compute_gae(r, v, m, gamma, lam, chunk=16)
    ref_adv, ref_ret = gae_naive(r, v, m, gamma, lam)
    assert torch.allclose(adv, ref_adv, atol=1e-9)
    assert torch.allclose(ret, ref_ret, atol=1e-9)


def test_per_row_lambda_and_empty_rows():
    g = torch.Generator().manual_seed(0)
    m = torch.rand(4, 50, generator=g) < 0.6
    m[2] = False  # a row with no action token
    v = torch.randn(4, 50, generator=g, dtype=torch.float64)
    r = torch.randn(4, 50, generator=g, dtype=torch.float64) * m
    lams = torch.tensor([1.0, 0.9, 0.5, 0.0])
    adv, _ = compute_gae(r, v, m, 0.97, lams)
    for row in range(4):
        ref, _ = gae_naive(r[row:row + 1], v[row:row + 1], m[row:row + 1], 0.97, float(lams[row]))
        assert torch.allclose(adv[row:row + 1], ref, atol=1e-9)
    assert adv[2].abs().sum() == 0


def test_chained_segments_bootstrap_from_next_segment():
    # Two segments of one trajectory, concatenated in time order: the last action of segment 1 bootstraps from
    # the first action of segment 2, across segment 2's (masked) rebuilt-context prompt.
    seg1_v, seg1_m = [0.2, 0.0, 0.4], [1, 0, 1]
    seg2_v, seg2_m = [7.0, 7.0, 0.6, 0.8], [0, 0, 1, 1]  # 7.0: prompt tokens of the rebuilt context
    v = torch.tensor([seg1_v + seg2_v], dtype=torch.float64)
    m = torch.tensor([seg1_m + seg2_m])
    r = torch.zeros_like(v)
    r[0, -1] = 1.0
    adv, _ = compute_gae(r, v, m, 1.0, 0.5)
    # by hand over actions [0.2, 0.4, 0.6, 0.8], reward 1 at the end
    deltas = [0.4 - 0.2, 0.6 - 0.4, 0.8 - 0.6, 1.0 - 0.8]
    a = [0.0] * 4
    for j in reversed(range(4)):
        a[j] = deltas[j] + 0.5 * (a[j + 1] if j + 1 < 4 else 0.0)
    got = adv[0][m[0].bool()].tolist()
    assert got == pytest.approx(a, abs=1e-12)


def test_adaptive_lambda():
    lam = adaptive_lambda(torch.tensor([1, 10, 1000]), alpha=0.05)
    assert lam.tolist() == pytest.approx([0.0, 0.0, 1 - 1 / 50])
