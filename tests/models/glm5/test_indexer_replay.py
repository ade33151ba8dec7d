"""Partial indexer replay: the indexer's top-k margins, rows of −1 that select for themselves, and the margin gate
(replay only the rows whose choice another implementation could make differently) against a perturbed indexer."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from models.glm5.config import Glm5Config
from models.glm5.indexer import Indexer
from models.glm5.indexer_rows import IndexerRows


def test_margins_are_the_gap_between_the_kth_and_the_next_score_and_leave_the_selection_alone():
    d = Glm5Config().qk_rope_head_dim
    indexer = Indexer(Glm5Config(index_topk=4, index_n_heads=2, index_head_dim=d))
    g = torch.Generator().manual_seed(0)
    b, s = 2, 11
    q, w, k = torch.randn(b, s, 2, d, generator=g), torch.rand(b, s, 2, generator=g), torch.randn(b, s, d, generator=g)
    query_index = torch.arange(s).expand(b, s)
    key_mask = torch.ones(b, s, dtype=torch.long)
    key_mask[1, :3] = 0  # left padding: three keys nobody may see
    plain = indexer.select(q, w, k, query_index, key_mask)
    chosen, margin = indexer.select(q, w, k, query_index, key_mask, margins=True)
    assert torch.equal(plain, chosen)
    scores = indexer.scores(q, w, k)  # the naive side: every score, sorted per query
    checked = 0
    for r in range(b):
        for t in range(s):
            visible = [j for j in range(t + 1) if key_mask[r, j]]
            if len(visible) <= 4:
                assert margin[r, t] == float("inf")  # every visible key fits: no choice was made
                continue
            ranked = scores[r, t, visible].sort(descending=True).values
            assert margin[r, t] == pytest.approx(float(ranked[3] - ranked[4]), abs=1e-6)
            if margin[r, t] > 0:  # a tie at the k-th place (ReLU scores of 0) may go either way: margin 0 says so
                assert set(chosen[r, t].tolist()) == {visible[i] for i in scores[r, t, visible].topk(4).indices.tolist()}
                checked += 1
    assert checked > 5


def test_a_row_of_minus_ones_selects_for_itself(glm52_policy):
    ids = torch.randint(100, 4000, (2, 48), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        own = glm52_policy(input_ids=ids, use_cache=False, return_routing=True)
    other = {layer: sel.roll(1, dims=1) for layer, sel in own.indexer_topk.items()}  # another query's keys
    rows = torch.zeros(2, 48, dtype=torch.bool)
    rows[:, 30::3] = True  # some late rows replayed (their shifted keys are all visible to them)
    partial = {layer: torch.where(rows[..., None], other[layer], -1) for layer in other}
    with torch.no_grad():
        mixed = glm52_policy(input_ids=ids, use_cache=False, indexer_topk=partial, return_routing=True)
    assert (mixed.logits - own.logits).abs().max() > 1e-3  # the replayed rows changed the output
    first = min(other)  # the first full layer sees the same input either way: its other rows are its own choice
    assert torch.equal(mixed.indexer_topk[first][~rows].sort(-1).values, own.indexer_topk[first][~rows].sort(-1).values)
    for layer in other:  # every layer: the replayed rows hold the replay
        assert torch.equal(mixed.indexer_topk[layer][rows].sort(-1).values, other[layer][rows].sort(-1).values)
    with torch.no_grad():  # and the merged selections, replayed whole, are that forward exactly
        again = glm52_policy(input_ids=ids, use_cache=False, indexer_topk=mixed.indexer_topk)
    assert torch.equal(again.logits, mixed.logits)
    nothing = {layer: torch.full_like(sel, -1) for layer, sel in own.indexer_topk.items()}
    with torch.no_grad():
        assert torch.equal(glm52_policy(input_ids=ids, use_cache=False, indexer_topk=nothing).logits, own.logits)


def test_replaying_the_rows_under_the_margin_makes_a_perturbed_indexer_agree(glm52_policy):
    """The trainer's indexer weights differ from the engine's by 0.1% (as precision differs between two
    implementations): two rows choose other keys and the logits move by ~1e-1. Replaying only the rows whose
    margin is under τ (a few percent of the rows) gives the engine's logits back."""
    ids = torch.randint(100, 4000, (2, 48), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        engine = glm52_policy(input_ids=ids, use_cache=False, return_routing=True, indexer_margins=True)
    trainer = copy.deepcopy(glm52_policy)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in trainer.named_parameters():
            if ".indexer." in name and "norm" not in name:
                p.mul_(1 + 1e-3 * torch.randn(p.shape, generator=g))
        own = trainer(input_ids=ids, use_cache=False, return_routing=True)
    flipped = sum(int((own.indexer_topk[i].sort(-1).values != engine.indexer_topk[i].sort(-1).values).any(-1).sum())
                  for i in engine.indexer_topk)
    assert flipped > 0 and (own.logits - engine.logits).abs().max() > 1e-2
    tau = 1e-4
    fragile = {i: engine.indexer_margins[i] < tau for i in engine.indexer_topk}
    replay = {i: torch.where(fragile[i][..., None], engine.indexer_topk[i], -1) for i in engine.indexer_topk}
    with torch.no_grad():
        replayed = trainer(input_ids=ids, use_cache=False, indexer_topk=replay)
    assert (replayed.logits - engine.logits).abs().max() < 1e-5
    share = sum(int(f.sum()) for f in fragile.values()) / sum(f.numel() for f in fragile.values())
    assert 0 < share < 0.2, share


def dense_of(rows: IndexerRows, batch: int, queries: int) -> dict[int, torch.Tensor]:
    """The dense partial replay {layer: [batch, queries, k]} that sparse rows stand for (−1 rows elsewhere)."""
    out = {}
    for layer in sorted(set(rows.layers.tolist())):
        mine = rows.layer(layer)
        t = torch.full((batch, queries, rows.keys.shape[1]), -1, dtype=torch.int32)
        t[mine.batch, mine.query] = mine.keys.to(torch.int32)
        out[layer] = t
    return out


def sparse_of(dense: dict[int, torch.Tensor]) -> IndexerRows:
    """A dense partial replay's replayed rows (any key ≥ 0) as each batch row's shipped rows, then placed."""
    per_row = []
    for r in range(next(iter(dense.values())).shape[0]):
        parts = [(torch.nonzero((t[r] >= 0).any(-1)).flatten(), layer, t[r]) for layer, t in sorted(dense.items())]
        per_row.append({"positions": np.concatenate([q.numpy() for q, _, _ in parts]).astype(np.int32),
                        "layers": np.concatenate([np.full(len(q), layer, np.int16) for q, layer, _ in parts]),
                        "keys": np.concatenate([t[q].numpy() for q, _, t in parts]).astype(np.int32)})
    return IndexerRows.from_samples(per_row, [(r, 0) for r in range(len(per_row))])


def test_sparse_rows_are_the_dense_partial_replay_forward_and_backward(glm52_policy):
    """The trainer's form (IndexerRows: only the replayed rows, written over each layer's own selection) gives the
    dense partial replay's logits and gradients exactly, under gradient checkpointing too; its sequence chunks
    are the dense replay's column slices."""
    ids = torch.randint(100, 4000, (2, 48), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        own = glm52_policy(input_ids=ids, use_cache=False, return_routing=True)
    rows = torch.zeros(2, 48, dtype=torch.bool)
    rows[0, 30::3] = True
    rows[1, 41] = True
    partial = {layer: torch.where(rows[..., None], sel.roll(1, dims=1), -1) for layer, sel in own.indexer_topk.items()}
    sparse = sparse_of(partial)
    assert len(sparse) == int(rows.sum()) * len(partial)
    assert {i: t.tolist() for i, t in dense_of(sparse, 2, 48).items()} == {i: t.tolist() for i, t in partial.items()}
    for lo, hi in ((0, 24), (24, 48), (40, 44)):
        chunk = sparse.local(lo, hi)
        assert len(chunk) == int(rows[:, lo:hi].sum()) * len(partial)
        local = dense_of(chunk, 2, hi - lo)
        for layer, t in partial.items():
            assert torch.equal(local.get(layer, torch.full_like(t[:, lo:hi], -1)), t[:, lo:hi])
    model = copy.deepcopy(glm52_policy).train()
    model.gradient_checkpointing_enable()
    grads, logits = [], []
    for replay in (partial, sparse):
        model.zero_grad()
        out = model(input_ids=ids, use_cache=False, indexer_topk=replay).logits
        out.float().pow(2).mean().backward()
        logits.append(out.detach())
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    assert (logits[0] - own.logits).abs().max() > 1e-3  # the replay changed the output
    assert torch.equal(logits[0], logits[1])
    assert grads[0].keys() == grads[1].keys() and all(torch.equal(grads[0][n], grads[1][n]) for n in grads[0])
