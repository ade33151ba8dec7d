"""Variable-length samples → right-padded micro-batches under a token budget, and back."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class MicroBatch:
    indices: list[int]  # positions of its samples in the input list
    lengths: list[int]
    tensors: dict[str, torch.Tensor]  # input_ids, attention_mask and the requested per-token fields, [b, L]


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
    whole batch). A step never gets zero samples: `mini_batches` is capped at the number of samples."""
    if mini_batches < 1 or epochs < 1:
        raise ValueError(f"ppo_mini_batches: mini_batches={mini_batches} and epochs={epochs} must be >= 1")
    if mini_batches == 1 and epochs == 1:
        yield 0, samples
        return
    groups = min(mini_batches, len(samples))
    generator = torch.Generator().manual_seed(seed)
    for epoch in range(epochs):
        order = torch.randperm(len(samples), generator=generator).tolist() if groups > 1 else range(len(samples))
        order = list(order)
        for g in range(groups):
            yield epoch, [samples[i] for i in order[g::groups]]
