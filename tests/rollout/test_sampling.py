import math

import pytest
import torch

from rollout.sampling import processed_logprobs, sample


def reference_logprobs(logits, temperature, top_k, top_p):
    """Row by row, from the definition: scale, keep top-k, keep the smallest prefix with mass ≥ p."""
    out = []
    for row, t, k, p in zip(logits.tolist(), temperature, top_k, top_p):
        scaled = [x / (t if t > 0 else 1.0) for x in row]
        order = sorted(range(len(row)), key=lambda i: -scaled[i])
        keep = order[:k] if (k > 0 and t > 0) else order
        z = sum(math.exp(scaled[i]) for i in keep)
        if t > 0 and p < 1.0:
            kept, mass = [], 0.0
            for i in keep:
                if mass >= p:
                    break
                kept.append(i)
                mass += math.exp(scaled[i]) / z
            keep = kept
        z = sum(math.exp(scaled[i]) for i in keep)
        out.append([scaled[i] - math.log(z) if i in keep else -math.inf for i in range(len(row))])
    return torch.tensor(out)


@pytest.mark.parametrize("t,k,p", [(1.0, 0, 1.0), (0.7, 0, 1.0), (1.0, 3, 1.0), (0.8, 0, 0.6), (1.3, 4, 0.9),
                                   (0.0, 3, 0.5)])
def test_processed_logprobs_match_definition(t, k, p):
    logits = torch.randn(3, 10, generator=torch.Generator().manual_seed(0))
    got = processed_logprobs(logits, torch.full((3,), t), torch.full((3,), k, dtype=torch.long), torch.full((3,), p))
    ref = reference_logprobs(logits, [t] * 3, [k] * 3, [p] * 3)
    finite = torch.isfinite(ref)
    assert torch.equal(torch.isfinite(got), finite)
    assert torch.allclose(got[finite], ref[finite], atol=1e-5)


def test_sampling_seeded_and_greedy():
    logp = torch.log_softmax(torch.randn(2, 50, generator=torch.Generator().manual_seed(1)), -1)
    a, lp_a = sample(logp, torch.tensor([False, True]), [torch.Generator().manual_seed(5), None])
    b, _ = sample(logp, torch.tensor([False, True]), [torch.Generator().manual_seed(5), None])
    assert torch.equal(a, b)
    assert int(a[1]) == int(logp[1].argmax())
    assert lp_a[0] == logp[0, a[0]]


def test_sampled_frequencies_follow_mu():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    logp = processed_logprobs(logits, torch.tensor([1.0]), torch.tensor([2]), torch.tensor([1.0]))
    gen = torch.Generator().manual_seed(0)
    counts = torch.zeros(4)
    for _ in range(2000):
        tok, _ = sample(logp, torch.tensor([False]), [gen])
        counts[tok] += 1
    assert counts[2:].sum() == 0  # outside the top-2: never sampled
    assert abs(counts[0] / 2000 - math.exp(logp[0, 0])) < 0.04
