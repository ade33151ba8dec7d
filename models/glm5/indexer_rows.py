"""A partial indexer replay, kept sparse: the few query rows whose key selection is replayed.

A margin-gated replay (rollout/indexer_replay.py) ships the engine's DSA selection only for the rows whose
choice the trainer could make differently, a few percent of them. Made dense for the model, as `indexer_topk`
{full layer: [B, S, k]} with −1 rows everywhere else, those rows cost what a full replay costs: at GLM-5.2's
k = 2,048 and 21 full layers, 172 KB a position in int32, 11 GB for a micro-batch of 64K positions. Kept
sparse, they cost their own size, and each layer writes its rows into the selection it computed anyway:

    selection[batch[r], query[r]] = keys[r]     for every row r of that layer

which is what the dense partial replay means (the replayed rows' keys, the layer's own choice elsewhere).
`Glm5Model.forward(indexer_topk=...)` takes either form.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F


@dataclass
class LayerRows:
    """One layer's replayed rows: query (batch[r], query[r]) attends to keys[r] (key indices, −1 empty)."""

    batch: torch.Tensor  # [n] long
    query: torch.Tensor  # [n] long, on the forward's query axis
    keys: torch.Tensor  # [n, k] long, on the forward's key axis

    def scatter(self, own: torch.Tensor) -> torch.Tensor:
        """The layer's own selection [B, S, k'] with the replayed rows' keys written over their rows (the
        narrower of the two padded with −1)."""
        width = max(own.shape[-1], self.keys.shape[-1])
        out = F.pad(own, (0, width - own.shape[-1]), value=-1)  # a new tensor: the caller's stays as it was
        out[self.batch, self.query] = F.pad(self.keys, (0, width - self.keys.shape[-1]), value=-1).to(out.dtype)
        return out


@dataclass
class IndexerRows:
    """Replayed indexer rows of a forward, every full layer's together (row r: layer layers[r])."""

    batch: torch.Tensor  # [n] long
    query: torch.Tensor  # [n] long
    layers: torch.Tensor  # [n] long
    keys: torch.Tensor  # [n, k] int32 (int64 once on the model's device)

    @classmethod
    def from_samples(cls, samples_rows: list, starts: list[tuple[int, int]]) -> "IndexerRows | None":
        """Samples' shipped rows (rollout/indexer_replay.py: positions, layers, keys on the sample's own positions;
        None: none shipped) placed where each sample begins in the forward, (row, column) → one IndexerRows, or
        None when no sample has a row. A row with no key at all replays nothing and is left out."""
        parts = []
        for rows, (row, column) in zip(samples_rows, starts):
            if rows is None or not len(rows["positions"]):
                continue
            keys = torch.as_tensor(np.asarray(rows["keys"]), dtype=torch.int32)
            keep = (keys >= 0).any(-1)
            keys = torch.where(keys >= 0, keys + column, -1)[keep]
            query = torch.as_tensor(np.asarray(rows["positions"]), dtype=torch.long)[keep] + column
            layers = torch.as_tensor(np.asarray(rows["layers"]), dtype=torch.long)[keep]
            parts.append((torch.full_like(query, row), query, layers, keys))
        if not parts:
            return None
        k = max(p[3].shape[1] for p in parts)
        keys = torch.cat([F.pad(p[3], (0, k - p[3].shape[1]), value=-1) for p in parts])
        return cls(torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts]),
                   torch.cat([p[2] for p in parts]), keys)

    def __len__(self) -> int:
        return int(self.query.numel())

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.batch, self.query, self.layers, self.keys))

    def to(self, device) -> "IndexerRows":
        return IndexerRows(self.batch.to(device), self.query.to(device), self.layers.to(device),
                           self.keys.to(device))

    def layer(self, layer: int) -> LayerRows | None:
        """This full layer's rows (key indices as int64, for gathers), or None if it has none. The rows are split
        by layer once (one host sync a forward, not one a layer)."""
        if not hasattr(self, "_by_layer"):
            self._by_layer = {}
            for i in self.layers.unique().tolist():
                mine = self.layers == i
                self._by_layer[i] = LayerRows(self.batch[mine], self.query[mine], self.keys[mine].long())
        return self._by_layer.get(layer)

    def local(self, lo: int, hi: int) -> "IndexerRows":
        """The rows of queries lo ≤ query < hi, on a forward of those queries only (a sequence-parallel chunk:
        the query axis is the chunk's, the key axis stays the whole sequence's)."""
        mine = (self.query >= lo) & (self.query < hi)
        return IndexerRows(self.batch[mine], self.query[mine] - lo, self.layers[mine], self.keys[mine])
