"""Margin-gated indexer replay: ship the engine's DSA key selection only for the rows whose choice the trainer
could make differently.

Replaying the indexer whole costs k key indices per token and full layer (GLM-5.2: 2,048 × 4 bytes, ~87 KB a
token over its full layers, and SGLang's generation 8-11× slower when it returns them). But two implementations
of the same indexer on the same weights and tokens differ only by their scores' rounding (precision of q, k and
the head gates, accumulation order) and by how they break ties. If each score is off by at most ε, a query
whose k-th best score exceeds the best key left out by more than 2ε, its *margin* I_(k) − I_(k+1)
(`Indexer.select(margins=True)`), selects the same keys on both sides. So the engine records only the rows with
margin < τ (τ ≥ 2ε, chosen from a measured ε), and the trainer replays those rows and selects the rest itself
(a partial replay, kept sparse all the way into the model: models/glm5/indexer_rows.py).

Format, per generation (`meta["indexer_replay"]`), on the sequence's own positions (the engine's left padding
and cache offsets removed), as compact numpy arrays:

    positions  int32 [n]     the query's position in prompt + output
    layers     int16 [n]     the full indexer layer
    keys       int32 [n, k]  its selected keys' positions, −1 for an empty slot
"""

from __future__ import annotations

import numpy as np
import torch

from models.glm5.indexer_rows import IndexerRows

FIELDS = ("positions", "layers", "keys")


def empty_rows(k: int) -> dict[str, np.ndarray]:
    return {"positions": np.zeros(0, np.int32), "layers": np.zeros(0, np.int16), "keys": np.zeros((0, k), np.int32)}


def fragile_rows(topk: dict[int, torch.Tensor], margins: dict[int, torch.Tensor], tau: float,
                 query_positions: torch.Tensor, key_positions: torch.Tensor) -> list[dict[str, np.ndarray]]:
    """The rows of one forward under the margin τ, one dict per batch row. `topk` {layer: [B, S, k]} on the cache
    axis (−1 empty), `margins` {layer: [B, S]} (the layers that ran their indexer), `query_positions` [B, S] each
    query's sequence position (−1: a query not to record: padding, a rejected draft), `key_positions` [B, T] the
    sequence position of each cache slot (−1: left padding, a rejected draft's hole)."""
    b = query_positions.shape[0]
    k = max((t.shape[-1] for t in topk.values()), default=0)
    parts: list[list[tuple]] = [[] for _ in range(b)]
    for layer, margin in sorted(margins.items()):
        rows, cols = torch.nonzero((margin < tau) & (query_positions >= 0), as_tuple=True)
        if rows.numel() == 0:
            continue
        sel = topk[layer][rows, cols]
        keys = torch.where(sel >= 0, key_positions[rows[:, None], sel.clamp(min=0)], -1)
        keys = torch.nn.functional.pad(keys, (0, k - keys.shape[-1]), value=-1).to(torch.int32).cpu().numpy()
        pos = query_positions[rows, cols].to(torch.int32).cpu().numpy()
        rows = rows.cpu().numpy()  # one transfer, not one per batch row
        for r in range(b):
            mine = rows == r
            if mine.any():
                parts[r].append((pos[mine], np.full(int(mine.sum()), layer, np.int16), keys[mine]))
    return [concat([{"positions": p, "layers": l, "keys": kk} for p, l, kk in row], k) for row in parts]


def concat(parts: list[dict[str, np.ndarray]], k: int, below: int | None = None) -> dict[str, np.ndarray]:
    """One dict of several (a generation's forwards), keeping the rows at positions < `below` if given."""
    parts = [p for p in parts if len(p["positions"])]
    if not parts:
        return empty_rows(k)
    out = {f: np.concatenate([p[f] for p in parts]) for f in FIELDS}
    if below is not None:
        keep = out["positions"] < below
        out = {f: v[keep] for f, v in out.items()}
    return out


def model_replay(rows: dict[str, np.ndarray]) -> IndexerRows | None:
    """The model's `indexer_topk` for one sequence: its recorded rows, sparse (the other rows select for
    themselves); None when it has none. (The trainer's micro-batches place many samples at once: MicroBatch.)"""
    return IndexerRows.from_samples([rows], [(0, 0)])


def nbytes(rows: dict[str, np.ndarray]) -> int:
    return sum(int(rows[f].nbytes) for f in FIELDS)
