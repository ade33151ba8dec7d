"""Variable-length samples → micro-batches under a token budget, and back.

A step's per-token data moves between the driver and the trainer ranks as a `TokenBatch`: one flat tensor per
field (every sample's tokens one after another) and the samples' lengths. Ray's object store carries tensors as
raw buffers; Python lists of floats cost ~10x the bytes and a Python object per token to (de)serialise.

A rank turns its `TokenBatch` into micro-batches of at most `max_tokens` positions each, one of two layouts:

- **packed** (the default where the model supports it): rows as wide as the micro-batch's longest sample, each
  holding several samples end to end, each sample with its own RoPE positions from 0 and no attention mask;
  transformers' models see the position resets and attend within each sample only (a block-diagonal causal
  mask), and GLM-5.2 bounds each query's keys below by its sample's first token (models/glm5/model.py). The
  short samples fill what would be padding, so a step needs fewer rows.
- **padded**: one sample a row, right-padded to the micro-batch's longest sample, with an attention mask (models
  that cannot take packed rows, or `trainer.pack_micro_batches=false`).

Both take the samples longest first, and a micro-batch's width is its longest sample's length, so a packed
micro-batch never holds more positions than the padded one would, and attention (quadratic in the row width
with a dense mask, as SDPA computes it without a varlen kernel) costs no more per row. First-fit decreasing fills
the packed rows.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

import torch

from models.glm5.indexer_rows import IndexerRows

# Integer per-token fields and their dtypes; every other per-token field travels as float32. `routed_experts`
# ([tokens, layers, k] expert ids the rollout engine chose, −1 where it ran no position: the model's own routing)
# keeps its trailing axes; the other fields are 1-D.
_INT_FIELDS = {"token_ids": torch.long, "routed_experts": torch.int16}
_FILL = {"routed_experts": -1}  # the value of positions a field does not cover (padding, tails)
# Per-sample fields: not one row per token but one object per sample, placed in the micro-batch there.
# `indexer_replay` (rollout/indexer_replay.py: the few indexer rows an engine shipped) stays sparse: the
# micro-batch's `indexer_rows` (models/glm5/indexer_rows.py), its queries and keys moved to the sample's place.
SAMPLE_FIELDS = ("indexer_replay",)


def field_dtype(name: str) -> torch.dtype:
    return _INT_FIELDS.get(name, torch.float32)


@dataclass
class TokenBatch:
    """Samples as flat tensors: `fields[name][offsets[i]:offsets[i] + lengths[i]]` is sample i's `name`."""

    lengths: list[int]
    fields: dict[str, torch.Tensor] = field(default_factory=dict)
    per_sample: dict[str, list] = field(default_factory=dict)  # SAMPLE_FIELDS: one object (or None) a sample

    @classmethod
    def from_samples(cls, samples: list[dict], names: tuple[str, ...] = ()) -> "TokenBatch":
        """`token_ids` and the per-token fields `names` of every sample (lists or 1-D tensors)."""
        lengths = [len(s["token_ids"]) for s in samples]
        fields = {}
        per_sample = {name: [s.get(name) for s in samples] for name in names if name in SAMPLE_FIELDS}
        for name in ("token_ids", *(n for n in names if n not in SAMPLE_FIELDS)):
            dtype = field_dtype(name)
            parts = [torch.as_tensor(s[name], dtype=dtype) for s in samples]
            parts = [p if p.dim() > 1 else p.reshape(-1) for p in parts]
            for p, n in zip(parts, lengths):
                if p.shape[0] != n:
                    raise ValueError(f"sample field {name!r} has {p.shape[0]} rows for {n} tokens")
            fields[name] = torch.cat(parts) if parts else torch.zeros(0, dtype=dtype)
        return cls(lengths, fields, per_sample)

    def __len__(self) -> int:
        return len(self.lengths)

    @cached_property
    def offsets(self) -> list[int]:
        out, total = [], 0
        for n in self.lengths:
            out.append(total)
            total += n
        return out

    @property
    def num_tokens(self) -> int:
        return sum(self.lengths)

    def has(self, name: str) -> bool:
        return name in self.fields or any(v is not None for v in self.per_sample.get(name, ()))

    def sample(self, i: int, name: str) -> torch.Tensor:
        start = self.offsets[i]
        return self.fields[name][start:start + self.lengths[i]]

    def select(self, indices: list[int]) -> "TokenBatch":
        """The samples at `indices`, in that order."""
        offsets = self.offsets
        fields = {}
        for name, t in self.fields.items():
            parts = [t[offsets[i]:offsets[i] + self.lengths[i]] for i in indices]
            fields[name] = torch.cat(parts) if parts else t[:0]
        per_sample = {name: [v[i] for i in indices] for name, v in self.per_sample.items()}
        return TokenBatch([self.lengths[i] for i in indices], fields, per_sample)

    def split(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """A flat per-token tensor (this batch's layout) → one tensor per sample."""
        return list(torch.split(flat, self.lengths)) if self.lengths else []


def as_token_batch(samples, names: tuple[str, ...]) -> TokenBatch:
    """A `TokenBatch` as it is, or samples (dicts) turned into one with the fields `names` that they all have; a
    replay field that only some have is filled in the others (−1: the model routes those itself)."""
    if isinstance(samples, TokenBatch):
        return samples
    for name in _FILL:
        having = [s[name] for s in samples if name in s] if name in names else []
        if having and len(having) < len(samples):
            trailing = torch.as_tensor(having[0]).shape[1:]
            samples = [s if name in s else {**s, name: torch.full((len(s["token_ids"]), *trailing), _FILL[name],
                                                                   dtype=field_dtype(name))} for s in samples]
    present = tuple(n for n in names if samples and (all(n in s for s in samples)
                                                     or (n in SAMPLE_FIELDS and any(n in s for s in samples))))
    return TokenBatch.from_samples(samples, present)


@dataclass
class MicroBatch:
    indices: list[int]  # positions of its samples in the TokenBatch
    lengths: list[int]
    tensors: dict[str, torch.Tensor]  # input_ids, attention_mask (1 = a real token) and per-token fields, [b, L]
    packed: bool = False  # rows of samples end to end; tensors["position_ids"] restarts at each sample
    starts: list[tuple[int, int]] = field(default_factory=list)  # (row, column) where each sample begins
    # sequence parallelism: this rank's chunk of the positions (models/glm5/sequence_parallel.SequenceShard)
    sequence: object | None = None
    indexer_rows: IndexerRows | None = None  # the samples' shipped indexer rows, placed (None: none shipped)

    def indexer_topk(self) -> IndexerRows | None:
        """The model's `indexer_topk` replay (sparse), or None where no sample shipped rows."""
        return self.indexer_rows

    @property
    def position_ids(self) -> torch.Tensor | None:
        """A packed row's RoPE positions (restarting at 0 for each sample); None for padded rows, whose positions
        the model derives from the attention mask."""
        return self.tensors.get("position_ids")

    def widened(self, width: int) -> "MicroBatch":
        """The same samples in rows `width` positions wide (attention mask 0 and fields 0 in the extra ones; in a
        packed row the extra positions form one more sequence of their own, positions from 0)."""
        extra = width - self.tensors["input_ids"].shape[1]
        if extra <= 0:
            return self
        tensors = {k: torch.nn.functional.pad(v, (0, 0) * (v.dim() - 2) + (0, extra), value=_FILL.get(k, 0))
                   for k, v in self.tensors.items()}
        if self.packed:
            tensors["position_ids"][:, -extra:] = torch.arange(extra, device=tensors["position_ids"].device)
        return MicroBatch(self.indices, self.lengths, tensors, self.packed, self.starts,
                          indexer_rows=self.indexer_rows)

    def sample_ids(self) -> torch.Tensor:
        """[b, L] which of its samples each position belongs to (0.., in `indices` order; −1: padding), so that a
        decision about a whole sample (the mismatch veto) does not take a packed row's other samples with it."""
        shape = self.tensors["input_ids"].shape
        ids = torch.full(shape, -1, dtype=torch.long)
        for j, (n, (row, col)) in enumerate(zip(self.lengths, self.starts)):
            ids[row, col:col + n] = j
        return ids.to(self.tensors["input_ids"].device)

    @property
    def padding(self) -> bool:
        """An empty micro-batch that keeps a rank's forward/backward count equal to the other ranks'."""
        return not self.indices


def padding_micro_batch(fields: tuple[str, ...] = (), device: str | torch.device = "cpu",
                        packed: bool = False) -> MicroBatch:
    """One row of two tokens, every per-token field 0; its loss is multiplied by 0 (gradients of 0 everywhere).
    Replay fields are left out: the model routes the padding row itself."""
    tensors = {"input_ids": torch.zeros(1, 2, dtype=torch.long), "attention_mask": torch.ones(1, 2, dtype=torch.long),
               **{name: torch.zeros(1, 2) for name in fields if name not in _FILL and name not in SAMPLE_FIELDS}}
    if packed:
        tensors["position_ids"] = torch.arange(2).unsqueeze(0)
    return MicroBatch([], [], {k: v.to(device) for k, v in tensors.items()}, packed)


def shard_by_tokens(samples, ranks: int) -> list[list[int]]:
    """Indices of `samples` (dicts or a TokenBatch) for each of `ranks` ranks, balanced by token count: longest
    first, each to the rank with the fewest tokens so far (ties to the lower rank). A rank may get none when
    there are fewer samples."""
    lengths = samples.lengths if isinstance(samples, TokenBatch) else [len(s["token_ids"]) for s in samples]
    shards: list[list[int]] = [[] for _ in range(ranks)]
    load = [0] * ranks
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        r = min(range(ranks), key=lambda k: (load[k], k))
        shards[r].append(i)
        load[r] += lengths[i]
    return [sorted(s) for s in shards]


def _pack_groups(lengths: list[int], max_tokens: int) -> list[list[list[int]]]:
    """Micro-batches of rows of sample indices. Each micro-batch opens with the longest sample left, whose length
    is its width W, and has at most max(1, max_tokens // W) rows; the samples left, longest first, go into the
    first of its rows with room (first-fit decreasing) until none fits."""
    left = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    out = []
    while left:
        width = lengths[left[0]]
        room = max(1, max_tokens // max(width, 1))
        rows: list[list[int]] = []
        used: list[int] = []
        rest = []
        for i in left:
            for r, u in enumerate(used):
                if u + lengths[i] <= width:
                    rows[r].append(i)
                    used[r] += lengths[i]
                    break
            else:
                if len(rows) < room:
                    rows.append([i])
                    used.append(lengths[i])
                else:
                    rest.append(i)
        out.append(rows)
        left = rest
    return out


def _pad_groups(lengths: list[int], max_tokens: int) -> list[list[int]]:
    """Longest first, a group grows while (rows × its longest row) ≤ max_tokens."""
    groups: list[list[int]] = []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        if groups and (len(groups[-1]) + 1) * lengths[groups[-1][0]] <= max_tokens:
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


def make_micro_batches(samples, fields: tuple[str, ...] = (), max_tokens: int = 4096,
                       device: str | torch.device = "cpu", packed: bool = False) -> list[MicroBatch]:
    """Micro-batches of `samples` (a TokenBatch, or dicts with "token_ids" and the per-token fields `fields`),
    each holding at most `max_tokens` positions (rows × width; a sample longer than that gets a micro-batch of
    its own), packed or padded (module docstring)."""
    batch = as_token_batch(samples, fields)
    sparse = [n for n in fields if n in SAMPLE_FIELDS and batch.has(n)]
    fields = tuple(n for n in fields if n not in SAMPLE_FIELDS)
    lengths, offsets = batch.lengths, batch.offsets
    # each micro-batch as rows of sample indices: several a row when packed, one when padded
    layouts = (_pack_groups(lengths, max_tokens) if packed
               else [[[i] for i in group] for group in _pad_groups(lengths, max_tokens)])
    out = []
    for rows_of in layouts:
        width = max(sum(lengths[i] for i in row) for row in rows_of)
        rows = len(rows_of)
        ids = torch.zeros(rows, width, dtype=torch.long)
        attn = torch.zeros(rows, width, dtype=torch.long)
        tensors = {name: torch.full((rows, width, *batch.fields[name].shape[1:]), _FILL.get(name, 0),
                                    dtype=field_dtype(name)) for name in fields}
        positions = torch.zeros(rows, width, dtype=torch.long) if packed else None
        indices, sizes, starts = [], [], []
        for r, row in enumerate(rows_of):
            column = 0
            for i in row:
                n = lengths[i]
                span = slice(offsets[i], offsets[i] + n)
                ids[r, column:column + n] = batch.fields["token_ids"][span]
                attn[r, column:column + n] = 1
                for name in fields:
                    tensors[name][r, column:column + n] = batch.fields[name][span]
                if packed:
                    positions[r, column:column + n] = torch.arange(n)
                indices.append(i)
                sizes.append(n)
                starts.append((r, column))
                column += n
            if packed and column < width:  # the row's tail: one more sequence of its own, never read
                positions[r, column:] = torch.arange(width - column)
        tensors = {"input_ids": ids, "attention_mask": attn, **tensors}
        if packed:
            tensors["position_ids"] = positions
        indexer_rows = None
        if "indexer_replay" in sparse:
            indexer_rows = IndexerRows.from_samples([batch.per_sample["indexer_replay"][i] for i in indices], starts)
        out.append(MicroBatch(indices, sizes, {k: v.to(device) for k, v in tensors.items()}, packed, starts,
                              indexer_rows=indexer_rows.to(device) if indexer_rows is not None else None))
    return out


def unbatch(batches: list[MicroBatch], outputs: list[torch.Tensor], batch: TokenBatch) -> torch.Tensor:
    """Per-micro-batch [b, L] outputs → one flat float32 tensor on the CPU in `batch`'s layout (split it with
    `batch.split`). Position 0 of every sample has no prediction and is 0 (in a packed row the position before a
    sample's first token is the previous sample's last, whose output means nothing for it)."""
    flat = torch.zeros(batch.num_tokens, dtype=torch.float32)
    offsets = batch.offsets
    for mb, out in zip(batches, outputs):
        out = out.detach().float().cpu()
        for i, n, (row, col) in zip(mb.indices, mb.lengths, mb.starts):
            flat[offsets[i] + 1:offsets[i] + n] = out[row, col + 1:col + n]
    return flat


def ppo_mini_batches(samples, mini_batches: int = 1, epochs: int = 1, seed: int = 0):
    """The optimiser steps of a PPO update: `epochs` passes over the samples, each pass a fresh random split into
    `mini_batches` groups of near-equal size (one optimiser step each). Yields (epoch, samples of the step):
    a list of dicts, or a TokenBatch when given one.

    With one epoch and one mini-batch it yields the samples as they are, in their order (one step over the
    whole batch). `mini_batches` is capped at the number of samples, so that no step is empty, except for no
    samples at all (a rank with an empty shard still takes every step, with nothing of its own)."""
    if mini_batches < 1 or epochs < 1:
        raise ValueError(f"ppo_mini_batches: mini_batches={mini_batches} and epochs={epochs} must be >= 1")
    if mini_batches == 1 and epochs == 1:
        yield 0, samples
        return
    pick = samples.select if isinstance(samples, TokenBatch) else (lambda idx: [samples[i] for i in idx])
    groups = min(mini_batches, len(samples)) if len(samples) else mini_batches
    generator = torch.Generator().manual_seed(seed)
    for epoch in range(epochs):
        order = torch.randperm(len(samples), generator=generator).tolist() if groups > 1 else range(len(samples))
        order = list(order)
        for g in range(groups):
            yield epoch, pick(order[g::groups])


def split_per_sample(samples: list[dict], flat: torch.Tensor) -> list[torch.Tensor]:
    """A worker's flat per-token result for `samples` (dicts, in their order) → one tensor per sample."""
    return TokenBatch([len(s["token_ids"]) for s in samples]).split(flat)
