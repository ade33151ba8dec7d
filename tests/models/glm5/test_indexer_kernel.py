"""The fused indexer-score kernel against a per-head loop in fp64, and the top-k it leads to. Runs under
Triton's interpreter on the CPU and natively on a GPU (bf16)."""

import pytest
import torch

from tests.models.glm5.triton_interpreter import run_interpreted


def reference_scores(q, w, k, scale):
    """I[b, t, s] = Σ_j w[b, t, j] · ReLU(scale · q[b, t, j] · k[b, s]), one head at a time, fp64."""
    q, w, k = q.double(), w.double(), k.double()
    out = torch.zeros(q.shape[0], q.shape[1], k.shape[1], dtype=torch.float64)
    for j in range(q.shape[2]):
        out += w[:, :, j, None] * torch.relu(scale * q[:, :, j] @ k.transpose(1, 2))
    return out


def check_index_scores(dtype: torch.dtype, device: str) -> None:
    from models.glm5 import kernels
    from models.glm5.config import Glm5Config
    from models.glm5.indexer import Indexer
    from models.glm5.kernels.indexer import index_scores_fused
    from models.glm5.tiny import TINY_CONFIG

    g = torch.Generator().manual_seed(0)
    # query and key counts that leave partial blocks; q a strided slice (as Indexer.select passes its chunks)
    q_full = torch.randn(2, 100, 12, 32, generator=g)
    q, w, k = q_full[:, 10:80], torch.randn(2, 70, 12, generator=g), torch.randn(2, 90, 32, generator=g)
    q_dev, k_dev = q.to(device, dtype), k.to(device, dtype)
    assert kernels.usable(q_dev)
    got = index_scores_fused(q_dev, w.to(device), k_dev, 32 ** -0.5).cpu()
    want = reference_scores(q_dev.cpu(), w, k_dev.cpu(), 32 ** -0.5)  # the inputs as the kernel saw them
    assert got.dtype == torch.float32 and got.shape == (2, 70, 90)
    assert (got.double() - want).abs().max() < 1e-5 * want.abs().max()

    # through Indexer.select (several query chunks and key blocks): the streamed top-k equals the top-k of the
    # reference scores (fp32: no ties)
    cfg = Glm5Config(**dict(TINY_CONFIG, vocab_size=64, indexer_fused_key_block=32, indexer_fused_query_chunk=16))
    indexer = Indexer(cfg).to(device, dtype)
    x = torch.randn(1, 50, cfg.hidden_size, generator=g).to(device, dtype)
    c_q = torch.randn(1, 50, cfg.q_lora_rank, generator=g).to(device, dtype)
    cos, sin = (t.to(device) for t in (torch.ones(1, 50, cfg.qk_rope_head_dim // 2),
                                       torch.zeros(1, 50, cfg.qk_rope_head_dim // 2)))
    with torch.no_grad():
        iq, iw, ik = indexer.queries(c_q, cos, sin), indexer.head_weights(x), indexer.keys(x, cos, sin)
        sel = indexer.select(iq, iw, ik, torch.arange(50, device=device)[None], None).cpu()
    scores = reference_scores(iq.cpu(), iw.cpu(), ik.cpu(), cfg.index_head_dim ** -0.5)
    scores = scores.masked_fill(torch.ones(50, 50).triu(1).bool(), float("-inf"))
    top = scores.topk(cfg.index_topk, dim=-1)
    want_sel = torch.where(top.values > float("-inf"), top.indices, -1)
    if dtype == torch.float32:
        assert torch.equal(sel.sort(-1).values, want_sel.sort(-1).values)
    else:  # bf16 rounding may swap near-tied keys at the boundary: compare the selected sets on average
        sets = [(set(a.tolist()) - {-1}, set(b.tolist()) - {-1}) for a, b in zip(sel[0], want_sel[0])]
        assert all(len(a) == len(b) for a, b in sets)
        assert sum(len(a & b) / len(b) for a, b in sets) / len(sets) > 0.95


def test_index_scores_kernel_in_the_interpreter():
    run_interpreted("tests.models.glm5.test_indexer_kernel", "check_index_scores")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_index_scores_kernel_on_the_gpu():
    pytest.importorskip("triton")
    check_index_scores(torch.bfloat16, "cuda")
