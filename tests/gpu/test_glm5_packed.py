"""GLM-5.2 in packed rows on a GPU, through the GPU attention paths: the masked SDPA path (short keys) and the
fused Triton sparse-MLA and indexer kernels (`masked_attn_max_keys=0` forces the sparse path). Packed rows give the
padded rows' logprobs and gradients. Skipped without a CUDA GPU; the CPU suite checks the torch paths
(tests/models/test_models.py)."""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.mark.parametrize("masked_max_keys", [12288, 0])
def test_packed_equals_padded_on_the_gpu_kernels(masked_max_keys):
    from models import policy_logprobs
    from models.batching import TokenBatch, make_micro_batches, unbatch
    from models.glm5.config import Glm5Config
    from models.glm5.tiny import KERNEL_CONFIG, build_random

    config = Glm5Config(**{**KERNEL_CONFIG, "num_hidden_layers": 4, "vocab_size": 4096,
                           "masked_attn_max_keys": masked_max_keys})
    model = build_random(config, 0).to("cuda", torch.bfloat16)
    g = torch.Generator().manual_seed(0)
    # longer than top-64, so the indexer selects; several per row once packed
    samples = [{"token_ids": torch.randint(2, 4096, (n,), generator=g),
                "loss_mask": torch.tensor([0.0] * 8 + [1.0] * (n - 8))} for n in (300, 90, 200, 70, 150, 40, 100)]
    batch = TokenBatch.from_samples(samples, ("loss_mask",))

    def run(packed: bool):
        model.zero_grad()
        outs = []
        for mb in make_micro_batches(batch, ("loss_mask",), 900, "cuda", packed=packed):
            t = mb.tensors
            out = policy_logprobs(model, t["input_ids"], t["attention_mask"], only=t["loss_mask"],
                                  position_ids=mb.position_ids)[0]
            (out * t["loss_mask"]).sum().backward()
            outs.append((mb, out.detach()))
        grad = torch.cat([p.grad.float().flatten() for p in model.parameters() if p.grad is not None])
        return unbatch([m for m, _ in outs], [o for _, o in outs], batch), grad

    (padded, g_padded), (packed, g_packed) = run(False), run(True)
    mask = batch.fields["loss_mask"] > 0
    diff = (packed - padded)[mask].abs()
    assert float(diff.mean()) < 0.02 and float(diff.max()) < 0.3  # bf16 kernels, other batch shapes
    cos = torch.nn.functional.cosine_similarity(g_packed, g_padded, dim=0)
    assert float(cos) > 0.99
