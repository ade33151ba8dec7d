"""Fused GPU kernels (Triton) for the two sparse-attention hot spots; the torch code they replace stays the
reference and the CPU path.

- `sparse_mla`: the attention core over each query's top-k latents, forward and backward, without gathering;
- `indexer`: the lightning indexer's scores, ReLU and head-weighted sum in one pass, without the per-head
  [queries, heads, keys] intermediate.

Both run for 16-bit inputs on a CUDA device, and for any input under Triton's interpreter (`TRITON_INTERPRET=1`,
set before the import), which is how the CPU suite tests them.
"""

from __future__ import annotations

import os

import torch

try:
    import triton  # noqa: F401
except ImportError:  # a CPU install without Triton: the torch paths are used
    triton = None


def interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def usable(x: torch.Tensor) -> bool:
    """Whether the kernels run for this input: bf16/fp16 on CUDA (in fp32 Triton's dots would round to TF32, below
    what the fp32 paths promise), or anything under the interpreter."""
    if triton is None:
        return False
    return interpreted() or (x.is_cuda and x.dtype in (torch.bfloat16, torch.float16))


def launch(table: dict, kind: str) -> dict:
    """A kernel's launch options from its tuning table (the interpreter takes no num_warps or num_stages)."""
    cfg = dict(table[kind])
    if interpreted():
        cfg.pop("num_warps", None)
        cfg.pop("num_stages", None)
    return cfg
