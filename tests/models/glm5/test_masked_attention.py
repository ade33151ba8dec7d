"""MLA's masked path (un-absorbed SDPA, the selection as a boolean mask: the GPU path at short contexts) against
the gathered sparse path (absorbed, SparseMLA) on the CPU in float64: outputs and the gradients of every input,
over selections with empty and out-of-range slots, padding, a query that sees nothing, several query chunks and
queries that start after cached keys; and the dense case (selection None) against the causal chunk path."""

import pytest
import torch

from models.glm5 import attention
from models.glm5.attention import MLA, allowed_keys
from models.glm5.config import Glm5Config
from models.glm5.tiny import REFERENCE_CONFIG


def layer(seed=0):
    torch.manual_seed(seed)
    mla = MLA(Glm5Config(**dict(REFERENCE_CONFIG, sparse_attn_kernel="torch")), layer_idx=2, has_indexer=False)
    for p in mla.parameters():
        torch.nn.init.normal_(p, std=0.2)
    return mla.double()


def inputs(mla, b=2, s=11, t=14, k=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(b, s, 256, generator=g, dtype=torch.float64)
    pos = torch.arange(t - s, t, dtype=torch.float64)[None, :, None] * torch.linspace(0.1, 1.0, 8, dtype=torch.float64)
    cos, sin = pos.cos().expand(b, -1, -1), pos.sin().expand(b, -1, -1)
    queries = mla.queries(x, cos, sin)
    latents = torch.randn(b, t, mla.d_c + mla.d_rope, generator=g, dtype=torch.float64, requires_grad=True)
    query_index = torch.arange(t - s, t).expand(b, s).clone()  # the first t − s keys are "cached"
    key_mask = torch.ones(b, t, dtype=torch.long)
    key_mask[1, :4] = 0  # left padding
    sel = torch.randint(-1, t, (b, s, k), generator=g)
    sel[0, 3] = torch.tensor([0, 2, 5, -1, 13, 1])  # 13 > its query index: not visible
    sel[1, 0] = torch.tensor([0, 1, 2, 3, -1, -1])  # only padding keys: the query sees nothing
    for bb in range(b):  # the top-k never picks a key twice (a repeat counts once here, twice when gathered)
        for tt in range(s):
            seen = set()
            for j in range(k):
                if int(sel[bb, tt, j]) in seen:
                    sel[bb, tt, j] = -1
                seen.add(int(sel[bb, tt, j]))
    return queries, latents, sel, query_index, key_mask


@pytest.mark.parametrize("dense", [False, True])
def test_masked_path_matches_the_gathered_path(monkeypatch, dense):
    monkeypatch.setattr(attention, "MASKED_QUERY_CHUNK", 4)  # three chunks with different key bounds
    mla = layer()
    queries, latents, sel, qi, key_mask = inputs(mla)
    sel = None if dense else sel
    ref = mla.attend(mla.absorb(queries), latents, sel, qi, key_mask)
    out = mla.attend_masked(queries, latents, sel, qi, key_mask)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-12)
    assert not dense or ref.abs().max() > 0
    grad = torch.randn_like(out)
    wrt = (queries.nope, queries.rope, latents, mla.kv_b_proj.weight)
    for got, want in zip(torch.autograd.grad(out, wrt, grad, retain_graph=True),
                         torch.autograd.grad(ref, wrt, grad)):
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-11)
    if not dense:
        assert out[1, 0].abs().max() == 0  # sees nothing: zero output, as the gathered path gives


def test_allowed_keys_against_a_loop():
    mla = layer()
    _, _, sel, qi, key_mask = inputs(mla, seed=1)
    got = allowed_keys(sel, qi, key_mask, 14)
    for b in range(sel.shape[0]):
        for t in range(sel.shape[1]):
            want = {int(s) for s in sel[b, t] if 0 <= s <= qi[b, t] and key_mask[b, s] == 1}
            assert set(got[b, t].nonzero().flatten().tolist()) == want


def test_prefixes_gradients_equal_slicing():
    from models.glm5.attention import prefixes

    g = torch.Generator().manual_seed(2)
    x = torch.randn(2, 3, 10, 4, generator=g, dtype=torch.float64, requires_grad=True)
    w = [torch.randn(2, 3, e, 4, generator=g, dtype=torch.float64) for e in (3, 7, 10)]
    parts = prefixes(x, [3, 7, 10])
    assert all(p.shape[2] == e for p, e in zip(parts, (3, 7, 10)))
    got, = torch.autograd.grad((parts[0] * w[0]).sum() + (parts[2] * w[2]).sum(), x)  # the middle one unused
    want, = torch.autograd.grad((x[:, :, :3] * w[0]).sum() + (x[:, :, :10] * w[2]).sum(), x)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
