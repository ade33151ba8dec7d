"""Partial indexer replay: the indexer's top-k margins, rows of −1 that select for themselves, and the margin gate
(replay only the rows whose choice another implementation could make differently) against a perturbed indexer."""

from __future__ import annotations

import copy

import pytest
import torch

from models.glm5.config import Glm5Config
from models.glm5.indexer import Indexer


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
