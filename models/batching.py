"""Variable-length samples → right-padded micro-batches under a token budget, and back."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class MicroBatch:
    indices: list[int]  # positions of its samples in the input list
    lengths: list[int]
    tensors: dict[str, torch.Tensor]  # input_ids, attention_mask and the requested per-token fields, [b, L]

    def widened(self, width: int) -> "MicroBatch":
        """The same rows right-padded to `width` positions (attention mask 0, fields 0 there)."""
        extra = width - self.tensors["input_ids"].shape[1]
        if extra <= 0:
            return self
        return MicroBatch(self.indices, self.lengths,
                          {k: torch.nn.functional.pad(v, (0, extra)) for k, v in self.tensors.items()})

    @property
    def padding(self) -> bool:
        """An empty micro-batch that keeps a rank's forward/backward count equal to the other ranks'."""
        return not self.indices


def padding_micro_batch(fields: tuple[str, ...] = (), device: str | torch.device = "cpu") -> MicroBatch:
    """One row of two tokens, every per-token field 0; its loss is multiplied by 0 (gradients of 0 everywhere)."""
    tensors = {"input_ids": torch.zeros(1, 2, dtype=torch.long), "attention_mask": torch.ones(1, 2, dtype=torch.long),
               **{name: torch.zeros(1, 2) for name in fields}}
    return MicroBatch([], [], {k: v.to(device) for k, v in tensors.items()})


def shard_by_tokens(samples: list[dict], ranks: int) -> list[list[int]]:
    """Indices of `samples` for each of `ranks` ranks, balanced by token count: longest first, each to the rank
    with the fewest tokens so far (ties to the lower rank). A rank may get none when there are fewer samples."""
    shards: list[list[int]] = [[] for _ in range(ranks)]
    load = [0] * ranks
    for i in sorted(range(len(samples)), key=lambda i: (-len(samples[i]["token_ids"]), i)):
        r = min(range(ranks), key=lambda k: (load[k], k))
        shards[r].append(i)
        load[r] += len(samples[i]["token_ids"])
    return [sorted(s) for s in shards]


def make_micro_batches(samples: list[dict], fields: tuple[str, ...] = (), max_tokens: int = 4096,
                       device: str | torch.device = "cpu") -> list[MicroBatch]:
    """Group samples (each with "token_ids" and per-token lists named in `fields`) so that
    (rows × longest row) ≤ max_tokens; longest first, so padding stays small. A sample longer than the budget
    gets a micro-batch of its own."""
    order = sorted(range(len(samples)), key=lambda i: -len(samples[i]["token_ids"]))
    groups: list[list[int]] = []
    for i in order:
        if groups and (len(groups[-1]) + 1) * len(samples[groups[-1][0]]["token_ids"]) <= max_tokens:
            groups[-1].append(i)
        else:
            groups.append([i])
    batches = []
    for group in groups:
        lengths = [len(samples[i]["token_ids"]) for i in group]
        width = max(lengths)
        ids = torch.zeros(len(group), width, dtype=torch.long)
        attn = torch.zeros(len(group), width, dtype=torch.long)
        tensors = {name: torch.zeros(len(group), width, dtype=torch.float32) for name in fields}
        for row, (i, n) in enumerate(zip(group, lengths)):
            ids[row, :n] = torch.tensor(samples[i]["token_ids"])
            attn[row, :n] = 1
            for name in fields:
                tensors[name][row, :n] = torch.tensor(samples[i][name], dtype=torch.float32)
        tensors = {"input_ids": ids, "attention_mask": attn, **tensors}
        batches.append(MicroBatch(group, lengths, {k: v.to(device) for k, v in tensors.items()}))
    return batches


def unbatch(batches: list[MicroBatch], outputs: list[torch.Tensor], count: int) -> list[list[float]]:
    """Per-sample lists from per-micro-batch [b, L] outputs, in the original sample order."""
    result: list[list[float]] = [[] for _ in range(count)]
    for mb, out in zip(batches, outputs):
        out = out.detach().float().cpu()
        for row, (i, n) in enumerate(zip(mb.indices, mb.lengths)):
            result[i] = out[row, :n].tolist()
    return result


def ppo_mini_batches(samples: list[dict], mini_batches: int = 1, epochs: int = 1, seed: int = 0):
    """The optimiser steps of a PPO update: `epochs` passes over the samples, each pass a fresh random split into
    `mini_batches` groups of near-equal size (one optimiser step each). Yields (epoch, samples of the step).

    With one epoch and one mini-batch it yields the samples as they are, in their order (one step over the
    whole batch). `mini_batches` is capped at the number of samples, so that no step is empty, except for no
    samples at all (a rank with an empty shard still takes every step, with nothing of its own)."""
    if mini_batches < 1 or epochs < 1:
        raise ValueError(f"ppo_mini_batches: mini_batches={mini_batches} and epochs={epochs} must be >= 1")
    if mini_batches == 1 and epochs == 1:
        yield 0, samples
        return
    groups = min(mini_batches, len(samples)) if samples else mini_batches
    generator = torch.Generator().manual_seed(seed)
    for epoch in range(epochs):
        order = torch.randperm(len(samples), generator=generator).tolist() if groups > 1 else range(len(samples))
        order = list(order)
        for g in range(groups):
            yield epoch, [samples[i] for i in order[g::groups]]
