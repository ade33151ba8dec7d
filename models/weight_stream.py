"""A trainer's weights as a stream of buckets, gathered from the ZeRO shards one bucket at a time.

Weight sync (to the engines) and the HF export read a model that ZeRO-3 has split over the ranks. Gathering the
whole model on one rank needs the whole model's memory there, which is what ZeRO-3 exists to avoid; so the
parameters are planned into buckets of about `bucket_mb` MB from their shapes alone (no communication), and
each bucket is all-gathered when it is reached, copied out, and released before the next. Every rank must walk
the stream in the same order (each gather is a collective); under ZeRO-0..2 every rank already holds the full
parameters and no communication happens at all.

Who keeps a bucket's copy is `owner(index)`: rank 0 for a sender that is one process (an SGLang transport), or
bucket i → rank i mod N when every rank sends its own share (the object-store path to the LocalEngines).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from torch import nn


def _full_numel(p: torch.Tensor) -> int:
    return int(getattr(p, "ds_numel", p.numel()))  # ZeRO-3 keeps the full size on the partitioned parameter


def hf_names(module: nn.Module) -> dict[str, list[str]]:
    """Every local parameter name → the model's (HF) names it stands for: itself, or under expert parallelism, for
    a local expert's weight, that weight of each expert of its expert group (models/glm5/expert_parallel.py)."""
    if any(getattr(m, "expert_parallel", False) for m in module.modules()):
        from models.glm5.expert_parallel import global_parameter_names

        return global_parameter_names(module)
    return {n: [n] for n, _ in module.named_parameters()}


def full_shapes(module: nn.Module) -> dict[str, tuple[int, ...]]:
    """Every parameter's unpartitioned shape (ZeRO-3 keeps it as `ds_shape`) under its HF name, without
    gathering."""
    names = hf_names(module)
    return {full: tuple(getattr(p, "ds_shape", p.shape)) for n, p in module.named_parameters() for full in names[n]}


def plan_buckets(module: nn.Module, bucket_mb: float, names: list[str] | None = None,
                 full: dict[str, list[str]] | None = None) -> list[list[str]]:
    """Local parameter names (all, or those standing for any of the HF `names`) in buckets of about `bucket_mb`
    MB (a bucket closes once it reaches the size), in `named_parameters` order, from the parameters' full sizes
    (ZeRO-3's, and every rank's experts under expert parallelism) without gathering."""
    limit = bucket_mb * 2**20
    buckets, current, size = [], [], 0
    wanted = set(names) if names is not None else None
    full = full if full is not None else hf_names(module)  # (`hf_names(module)`, if the caller has it)
    for name, p in module.named_parameters():
        if wanted is not None and wanted.isdisjoint(full[name]):
            continue
        current.append(name)
        size += _full_numel(p) * p.element_size() * len(full[name])
        if size >= limit:
            buckets.append(current)
            current, size = [], 0
    if current:
        buckets.append(current)
    return buckets


class WeightBuckets:
    """Iterating yields one {name: full tensor} per planned bucket (an empty dict where this rank is not the
    bucket's owner); `len()` is known before the first gather, which the SGLang transports need (the last bucket
    carries the new version). It is walked once: a second `iter()` goes on where the first stopped, so that
    `finish()` can take part in the gathers a failed consumer left (the other ranks are waiting in them)."""

    def __init__(self, module: nn.Module, bucket_mb: float, zero3: bool, rank: int = 0,
                 owner: Callable[[int], int] = lambda i: 0, on_device: bool = False, names: list[str] | None = None):
        self.module, self.zero3, self.rank, self.owner, self.on_device = module, zero3, rank, owner, on_device
        self.hf_names = hf_names(module)
        self.plan = plan_buckets(module, bucket_mb, names, self.hf_names)
        self.params = dict(module.named_parameters())
        self.wanted = set(names) if names is not None else None
        self._walk = None

    def __len__(self) -> int:
        return len(self.plan)

    def _copy(self, names: list[str], mine: bool) -> dict[str, torch.Tensor]:
        out = {}
        for n in names:
            full, tensor = self.hf_names[n], self.params[n].detach()
            # a local expert's weight: every rank of its expert group takes part in the gather (a collective)
            parts = [tensor] if len(full) == 1 else self._expert_shard(n).gather(tensor)
            if mine:
                out.update({k: v.clone() if self.on_device else v.cpu().clone() for k, v in zip(full, parts)
                            if self.wanted is None or k in self.wanted})
        return out

    def _expert_shard(self, name: str):
        from models.glm5.expert_parallel import shard_of

        return shard_of(self.module, name)

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        if self._walk is None:
            self._walk = self._buckets()
        return self._walk

    def finish(self) -> None:
        """Walk the buckets not yet walked (their collectives), keeping nothing: what a rank whose consumer failed
        mid-stream does, so that the ranks still walking are not left waiting in a gather."""
        self.wanted = set()  # copy nothing
        for _ in self:
            pass

    def _buckets(self) -> Iterator[dict[str, torch.Tensor]]:
        for index, names in enumerate(self.plan):
            mine = self.owner(index) == self.rank
            if self.zero3:  # collective: every rank gathers this bucket, the owner copies it out
                import deepspeed

                with deepspeed.zero.GatheredParameters([self.params[n] for n in names], modifier_rank=None):
                    yield self._copy(names, mine)
            else:
                yield self._copy(names, mine)


def write_hf_streamed(module: nn.Module, buckets: WeightBuckets, folder: str | Path, write: bool) -> int:
    """An HF-format folder (config.json, one safetensors shard per bucket and the index, or one model.safetensors)
    written bucket by bucket, so that no rank ever holds more than one bucket of the gathered model. Every rank
    calls it (the gathers are collective); `write` says which one writes (the buckets' owner). Persistent buffers
    (unpartitioned) go into the last shard. Returns the bytes written (0 on the other ranks). Loads in
    transformers and our engines as a `save_pretrained` folder does."""
    from safetensors.torch import save_file

    folder = Path(folder)
    total, weight_map = 0, {}
    count = len(buckets)
    if write:
        folder.mkdir(parents=True, exist_ok=True)
        for old in list(folder.glob("*.safetensors")) + [folder / "model.safetensors.index.json"]:
            old.unlink(missing_ok=True)
    for index, bucket in enumerate(buckets):
        if not write:
            continue
        if index == count - 1:  # persistent buffers (e.g. GLM-5.2's fp32 router bias) are not ZeRO-partitioned
            persistent = set(module.state_dict())
            bucket.update({k: v.detach().cpu() for k, v in module.named_buffers() if k in persistent})
        fname = "model.safetensors" if count == 1 else f"model-{index + 1:05d}-of-{count:05d}.safetensors"
        save_file({k: v.contiguous() for k, v in bucket.items()}, str(folder / fname), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(bucket, fname))
        total += sum(v.numel() * v.element_size() for v in bucket.values())
    if not write:
        return 0
    if count > 1:  # one shard is a plain model.safetensors, as save_pretrained writes it
        (folder / "model.safetensors.index.json").write_text(json.dumps(
            {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2, sort_keys=True) + "\n")
    _write_config(module, folder)
    return total


def _write_config(module: nn.Module, folder: Path) -> None:
    """config.json as `save_pretrained` writes it: the architecture and the weights' dtype."""
    dtype = next(module.parameters()).dtype
    if hasattr(module.config, "to_hf"):  # GLM-5.2 (models/glm5): its own HF config writer
        from models.glm5.checkpoint import hf_config

        (folder / "config.json").write_text(json.dumps(hf_config(module), indent=2, sort_keys=True) + "\n")
        return
    import copy

    config = copy.deepcopy(module.config)
    config.architectures = [type(module).__name__]
    config.dtype = dtype
    config.save_pretrained(folder)
    generation = getattr(module, "generation_config", None)
    if generation is not None:
        generation.save_pretrained(folder)
