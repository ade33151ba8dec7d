"""SparseMLA's hand-written backward, and the fused Triton kernels, against autograd through a naive per-query,
per-head loop. The Triton kernels run under Triton's interpreter on the CPU (in a subprocess: the interpreter is
chosen when the kernels are defined) and natively on a GPU."""

import math

import pytest
import torch

from models.glm5.sparse_mla import sparse_mla
from tests.models.glm5.triton_interpreter import run_interpreted


def naive(q, kv, sel, query_index, key_mask, scale, d_c):
    """o[b, t, h] = Σ_slots softmax(scale · q·kv[s]) kv[s, :d_c] over the valid slots, one query at a time."""
    b_n, c, h_n, _ = q.shape
    out = torch.zeros(b_n, c, h_n, d_c, dtype=q.dtype)
    for b in range(b_n):
        for t in range(c):
            slots = [int(s) for s in sel[b, t] if 0 <= s <= query_index[b, t]
                     and (key_mask is None or key_mask[b, s] == 1)]
            if not slots:
                continue
            keys = kv[b, slots]  # duplicates count twice, as in the gather
            for h in range(h_n):
                w = torch.softmax(keys @ q[b, t, h] * scale, dim=0)
                out[b, t, h] = w @ keys[:, :d_c]
    return out


def case(seed=0, b=2, c=5, t=9, h=3, d_c=4, d_r=2, k=6, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, c, h, d_c + d_r, generator=g, dtype=dtype, requires_grad=True)
    kv = torch.randn(b, t, d_c + d_r, generator=g, dtype=dtype, requires_grad=True)
    sel = torch.randint(-1, t, (b, c, k), generator=g)
    sel[0, 0] = 0  # a key picked twice by one query, and by several queries
    sel[1, 2] = -1  # a query with no valid slot: zero output, zero gradient
    query_index = torch.arange(t - c, t).expand(b, c).clone()
    key_mask = torch.ones(b, t, dtype=torch.long)
    key_mask[1, :2] = 0  # left padding
    return q, kv, sel, query_index, key_mask, 1 / math.sqrt(d_c + d_r), d_c


@pytest.mark.parametrize("masked", [True, False])
def test_forward_and_gradients_match_a_naive_loop(masked):
    q, kv, sel, qi, key_mask, scale, d_c = case()
    key_mask = key_mask if masked else None
    out = sparse_mla(q, kv, sel, qi, key_mask, scale, d_c)
    ref = naive(q, kv, sel, qi, key_mask, scale, d_c)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-12)
    grad_out = torch.randn_like(out)
    dq, dkv = torch.autograd.grad(out, (q, kv), grad_out)
    rq, rkv = torch.autograd.grad(ref, (q, kv), grad_out)
    torch.testing.assert_close(dq, rq, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(dkv, rkv, rtol=1e-9, atol=1e-12)
    assert dq[1, 2].abs().max() == 0  # the query that sees nothing


def test_gradcheck():
    q, kv, sel, qi, key_mask, scale, d_c = case(seed=1, b=2, c=3, t=5, h=2, k=4)
    assert torch.autograd.gradcheck(lambda a, b: sparse_mla(a, b, sel, qi, key_mask, scale, d_c), (q, kv))


def test_bfloat16_close_to_float64():
    q, kv, sel, qi, key_mask, scale, d_c = case(seed=2, c=16, t=40, h=4, d_c=32, d_r=8, k=12)
    ref = sparse_mla(q, kv, sel, qi, key_mask, scale, d_c)
    dq_ref, dkv_ref = torch.autograd.grad(ref.sum(), (q, kv))
    qb, kvb = q.detach().bfloat16().requires_grad_(), kv.detach().bfloat16().requires_grad_()
    out = sparse_mla(qb, kvb, sel, qi, key_mask, scale, d_c)
    dq, dkv = torch.autograd.grad(out.float().sum(), (qb, kvb))
    assert out.dtype == torch.bfloat16 and dkv.dtype == torch.bfloat16
    for got, want in ((out, ref), (dq, dq_ref), (dkv, dkv_ref)):
        assert (got.double() - want).abs().max() < 0.05 * want.abs().max()


def check_triton_against_naive(dtype: torch.dtype, device: str) -> None:
    """The fused kernels' output and both gradients against the naive loop (fp64): padded heads (5 → 16), a
    rope width that is not a block size, slots spanning several key blocks with a partial last one, duplicates,
    −1, causally later and padded slots, and a query that sees nothing; then a whole tiny GLM-5.2 model
    (sequence > top-k, so its sparse layers run) with the kernel, and on a GPU with MLA's masked path: each
    against the chunked torch path in fp32, allowed twice the torch path's own error in the same dtype (in bf16
    the paths round at different points, and that adds up over eight layers) or twice the tolerance."""
    from models.glm5.kernels import usable
    from models.glm5.kernels.sparse_mla import sparse_mla_fused

    q, kv, sel, qi, key_mask, scale, d_c = case(seed=3, b=2, c=7, t=90, h=5, d_c=32, d_r=8, k=70)
    assert usable(q.to(device, dtype))
    ref = naive(q, kv, sel, qi, key_mask, scale, d_c)
    grad_out = torch.randn_like(ref)
    want = (ref, *torch.autograd.grad(ref, (q, kv), grad_out))
    qd, kvd = (x.detach().to(device, dtype).requires_grad_() for x in (q, kv))
    out = sparse_mla_fused(qd, kvd, sel.to(device), qi.to(device), key_mask.to(device), scale, d_c)
    got = (out, *torch.autograd.grad(out, (qd, kvd), grad_out.to(device, dtype)))
    tol = 1e-5 if dtype == torch.float32 else 0.02
    for name, g, w in zip(("o", "dq", "dkv"), got, want):
        err = (g.double().cpu() - w).abs().max() / w.abs().max()
        assert err < tol, f"{name}: relative error {err:.2e}"
    assert got[1][1, 2].abs().max() == 0  # the query that sees nothing

    from models.glm5.config import Glm5Config
    from models.glm5.tiny import TINY_CONFIG, build_random

    ids = torch.randint(0, 512, (2, 40), generator=torch.Generator().manual_seed(0)).to(device)
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    errors, routing, reference = {}, {}, None
    paths = {"torch": dict(sparse_attn_kernel="torch"), "kernel": dict(masked_attn_max_keys=0)}
    if device == "cuda":  # MLA's masked path (SDPA) is what "auto" runs at this length on a GPU
        paths["masked"] = {}
    for name, knobs in {"fp32": dict(sparse_attn_kernel="torch"), **paths}.items():
        cfg = Glm5Config(**dict(TINY_CONFIG, vocab_size=512, pad_token_id=None, bos_token_id=None,
                                eos_token_id=None, **knobs))
        model = build_random(cfg).to(device, torch.float32 if name == "fp32" else dtype)
        out = model(input_ids=ids, attention_mask=mask, return_routing=True, **routing)
        routing = dict(indexer_topk=out.indexer_topk, routed_experts=out.routed_experts)  # replayed by the rest
        (out.logits.float() * mask[..., None]).square().mean().backward()
        tensors = [out.logits.detach()] + [p.grad for p in model.parameters() if p.grad is not None]
        if reference is None:
            reference = [t.float() for t in tensors]
        errors[name] = [((g.float() - w).abs().max() / w.abs().max().clamp(min=1e-6)).item()
                        for g, w in zip(tensors, reference)]
    for name in list(paths)[1:]:  # as close to fp32 as the torch path in the same dtype is, or within 2 · tol
        for i, (err, own) in enumerate(zip(errors[name], errors["torch"])):
            assert err <= max(2 * own, 2 * tol), \
                f"{name}: model tensor {i} (0 = logits, then gradients): error {err:.2e} (torch path: {own:.2e})"


def test_triton_kernels_match_a_naive_loop_in_the_interpreter():
    run_interpreted("tests.models.glm5.test_sparse_mla", "check_triton_against_naive")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_triton_kernels_match_a_naive_loop_on_the_gpu():
    pytest.importorskip("triton")
    check_triton_against_naive(torch.bfloat16, "cuda")
