"""How GLM-5.2 is parallelised for training (torchtitan's split: model.py builds it, checkpoint.py converts it,
this file shards it).

Data parallelism with ZeRO-3 (DeepSpeed) is the trainer's layout on one node: every rank holds 1/N of each
parameter, gradient and Adam moment and all-gathers a module's parameters right before its forward. That is
generic except for one thing the MoE layer has to do: ranks route their tokens to different experts, and an
expert that no token of a rank picked would be skipped on that rank only, so the ranks would disagree on which
all-gathers (and which gradient reductions) come next and hang. `prepare_for_zero3` makes every rank run every
expert in expert order, on zero rows where it has no tokens (the weights still get their all-gather, a zero
gradient, and their reduction). The same holds for every data-dependent call count: the ranks must also see
the same shapes (sequence lengths, so that the indexer runs or not alike and chunked heads loop alike): a
multi-rank trainer pads every rank's micro-batch to one length (`DeepSpeedWorker.micro_batches` does, under
ZeRO-3 with several ranks; bench/zero3_glm5.py uses equal shapes). And ZeRO-3 gathers a module's parameters when
that module's forward runs: MLA reads two weights directly in its own forward (the absorbed `kv_b_proj.weight`
and the indexer's fp32 `weights_proj.weight`), so they are registered as its external parameters here. With
that, GLM-5.2 with its indexer trains under ZeRO-3 like one rank without ZeRO (tests/rl/test_trainer_ranks.py).
(An earlier reading that its ZeRO-3 gradients differed from ZeRO-0's had another cause: the trainer's forwards
bypassed engine.forward, where ZeRO-3 counts micro-steps, so only the last micro-batch's gradient survived;
models/deepspeed_worker.py's `accumulate_and_step` now does that bookkeeping.) Expert parallelism (each rank owning
whole experts) is SGLang's serving layout (docs/SCALING.md); the trainer's is its own issue.
"""

from __future__ import annotations

from torch import nn

from models.glm5.attention import MLA
from models.glm5.moe import MoE


def prepare_for_zero3(model: nn.Module, world_size: int) -> int:
    """Make `model` safe to shard with ZeRO-3 over `world_size` data-parallel ranks; returns the MoE layers
    changed (none for one rank, where a skipped expert costs no collective). Also tells ZeRO-3 which weights each
    MLA layer's forward reads directly rather than through their own module's forward (the absorbed
    `kv_b_proj.weight`, and the DSA indexer's `weights_proj.weight`, applied in fp32), so that they are gathered
    there."""
    import deepspeed

    for m in model.modules():
        if isinstance(m, MLA):
            deepspeed.zero.register_external_parameter(m, m.kv_b_proj.weight)
            if m.indexer is not None:
                deepspeed.zero.register_external_parameter(m, m.indexer.weights_proj.weight)
    layers = [m for m in model.modules() if isinstance(m, MoE)]
    for m in layers:
        m.run_idle_experts = world_size > 1
    return len(layers) if world_size > 1 else 0
