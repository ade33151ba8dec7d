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
ZeRO-3 with several ranks; bench/zero3_glm5.py uses equal shapes). Not yet supported under ZeRO-3: a model whose
indexer runs in training (`Indexer.head_weights` reads `weights_proj.weight` directly, which ZeRO-3 has not
gathered there unless ZeRO's prefetch happened to fetch it; registering it as an external parameter made the
forward run but the actor's gradients then differed from ZeRO-0's). The RL trainer's workers refuse that
combination at start (`DeepSpeedWorker`); ZeRO-0 to 2 train it like one rank (tests/rl/test_trainer_ranks.py). Expert parallelism (each rank owning whole experts) is SGLang's serving layout
(docs/SCALING.md); the trainer of a 744B model would add it through Megatron-style EP, not here.
"""

from __future__ import annotations

from torch import nn

from models.glm5.moe import MoE


def prepare_for_zero3(model: nn.Module, world_size: int) -> int:
    """Make `model` safe to shard with ZeRO-3 over `world_size` data-parallel ranks; returns the MoE layers
    changed (none for one rank, where a skipped expert costs no collective)."""
    layers = [m for m in model.modules() if isinstance(m, MoE)]
    for m in layers:
        m.run_idle_experts = world_size > 1
    return len(layers) if world_size > 1 else 0
