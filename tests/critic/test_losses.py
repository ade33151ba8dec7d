import math

import pytest
import torch

from critic.losses import explained_variance, masked_mean, value_loss


def test_value_loss_hand_computed():
    v = torch.tensor([1.0, 0.0, 0.5])
    old = torch.tensor([0.5, 0.0, 0.5])
    ret = torch.tensor([0.0, 1.0, 0.5])
    loss, clipped = value_loss(v, old, ret, clip=0.2)
    # token 0: plain (1-0)^2 = 1; clipped value 0.7 → 0.49; max = 1 (plain)
    # token 1: plain 1; clipped value 0 → 1; equal → not counted as clipped
    # token 2: 0
    assert loss.tolist() == [0.5, 0.5, 0.0]
    assert clipped.tolist() == [0.0, 0.0, 0.0]
    v2 = torch.tensor([0.0])
    loss2, clipped2 = value_loss(v2, torch.tensor([0.5]), torch.tensor([0.0]), clip=0.2)
    # plain 0; clipped value 0.3 → 0.09: the clipped branch wins (the update moved too far)
    assert math.isclose(float(loss2), 0.5 * 0.09, rel_tol=1e-6) and clipped2.item() == 1.0


def test_explained_variance():
    g = torch.tensor([0.0, 1.0, 2.0, 3.0])
    m = torch.ones(4)
    assert explained_variance(g, g, m) == 1.0
    assert abs(explained_variance(torch.full((4,), 1.5), g, m)) < 1e-12
    assert masked_mean(g, torch.tensor([1.0, 1.0, 0.0, 0.0])) == 0.5


def test_explained_variance_from_sums_equals_the_tensor_form():
    from critic.losses import explained_variance_from_sums

    g = torch.Generator().manual_seed(0)
    returns, values = torch.randn(50, generator=g, dtype=torch.float64), torch.randn(50, generator=g, dtype=torch.float64)
    mask = (torch.rand(50, generator=g) > 0.3).double()
    m = mask.bool()
    gr, d = returns[m], returns[m] - values[m]
    sums = (float(m.sum()), float(gr.sum()), float((gr * gr).sum()), float(d.sum()), float((d * d).sum()))
    assert explained_variance_from_sums(*sums) == pytest.approx(explained_variance(values, returns, mask), rel=1e-12)
    assert math.isnan(explained_variance_from_sums(1, 1.0, 1.0, 0.0, 0.0))  # one token: undefined
