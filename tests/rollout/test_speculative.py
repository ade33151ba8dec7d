"""Speculative decoding with GLM-5.2's MTP layer in the LocalEngine (models/glm5/speculative.py) and the
acceptance rule (rollout/sampling.verify_drafts), checked against plain decoding and against the target
distribution itself."""

from __future__ import annotations

import asyncio

import pytest
import torch

from models import load_model, resolve_model_path
from rollout.local_engine import LocalEngine
from rollout.sampling import verify_drafts
from rollout.types import SamplingParams

PROMPTS = [[5, 17, 300, 42, 9], [11, 12], list(range(100, 130)), [7, 8, 9, 10, 11, 12, 13]]


@pytest.fixture(scope="module")
def model():
    return load_model(str(resolve_model_path("glm52-tiny")), "policy")


def generate(engine: LocalEngine, sampling: SamplingParams):
    """Every prompt in one batch, row i = PROMPTS[i] (queued while the engine is paused, however slow the
    machine: a gathering window alone could split them)."""
    async def go():
        await engine.pause()
        tasks = [asyncio.create_task(engine.generate(p, sampling.replace(seed=i))) for i, p in enumerate(PROMPTS)]
        await asyncio.sleep(0)  # each task queues its request before its first wait
        await engine.resume()
        results = await asyncio.gather(*tasks)
        assert all(r.meta["batch_size"] == len(PROMPTS) for r in results)
        return results
    try:
        return asyncio.run(go())
    finally:
        engine.close()


def plain_greedy(model, max_new: int = 24):
    return generate(LocalEngine(model, max_batch_size=8), SamplingParams(temperature=0.0, max_new_tokens=max_new))


@pytest.mark.parametrize("steps", [1, 3])
def test_greedy_speculative_decoding_emits_exactly_what_plain_decoding_does(model, steps):
    want = plain_greedy(model)
    got = generate(LocalEngine(model, max_batch_size=8, speculative_steps=steps),
                   SamplingParams(temperature=0.0, max_new_tokens=24))
    for w, g in zip(want, got):
        assert g.output_ids == w.output_ids and g.finish_reason == w.finish_reason
        assert max(abs(a - b) for a, b in zip(w.output_logprobs, g.output_logprobs)) < 1e-4
        assert g.meta["speculative_rounds"] >= 1


def test_accepted_drafts_and_holes_keep_the_output_exact(model):
    """A drafter that proposes the true greedy continuation in some rows and wrong tokens in others: rows accept
    different counts each round (rejected slots become holes in the shared cache), and the MTP cache is
    extended over accepted slots. The output must still be plain greedy decoding, in fewer rounds."""
    want = [w.output_ids for w in plain_greedy(model)]
    engine = LocalEngine(model, max_batch_size=8, speculative_steps=3)
    real_draft = engine._drafter.draft
    calls = []

    def oracle_draft(cache, h1, selection, row, anchor, position, key_mask, steps, sample_fn):
        drafts, logq = real_draft(cache, h1, selection, row, anchor, position, key_mask, steps, sample_fn)
        rnd = len(calls)
        calls.append(1)
        for i in range(drafts.shape[0]):
            done = int(position[i]) - len(PROMPTS[i]) + 2  # tokens emitted so far (the anchor's RoPE position)
            truth = want[i][done:done + steps]
            good = (i + rnd) % 3  # row- and round-dependent: 0, 1 or 2 correct drafts, then a wrong one
            for j, tok in enumerate(truth[:steps]):
                drafts[i, j] = tok if j < good else (tok + 1) % logq.shape[-1]
        # greedy acceptance only compares with the target's argmax; q is irrelevant here
        return drafts, logq

    engine._drafter.draft = oracle_draft
    got = generate(engine, SamplingParams(temperature=0.0, max_new_tokens=24))
    for w, g in zip(want, got):
        assert g.output_ids == w
        rounds, accepted = g.meta["speculative_rounds"], g.meta["speculative_accepted"]
        assert accepted > 0 and rounds < 23
        # per row: the prefill's token, then per round its kept drafts and one more (unless max_new cut it)
        assert len(g.output_ids) - 1 - accepted in (rounds, rounds - 1)
    stats = engine.speculative_metrics()
    assert stats["engine/speculative_accepted"] == sum(g.meta["speculative_accepted"] for g in got)


def test_verify_drafts_samples_the_target_distribution():
    """Whatever the draft distribution q, the first emitted token (kept draft or residual draw) is distributed
    as the target μ: the rejection-sampling identity, checked empirically on a 5-token vocabulary."""
    mu = torch.tensor([0.05, 0.4, 0.25, 0.2, 0.1])
    q = torch.tensor([0.3, 0.1, 0.1, 0.4, 0.1])
    n = 20000
    gen = torch.Generator().manual_seed(0)
    drafts = torch.multinomial(q, n, replacement=True, generator=gen).view(n, 1)
    target = mu.log().expand(n, 2, 5).clone()
    draft = q.log().expand(n, 1, 5).clone()
    kept, following = verify_drafts(target, draft, drafts, torch.zeros(n, dtype=torch.bool), [gen] * n)
    first = torch.tensor([int(drafts[i, 0]) if kept[i] else following[i] for i in range(n)])
    freq = torch.bincount(first, minlength=5).float() / n
    assert (freq - mu).abs().max() < 0.015  # 3.5 standard errors at n = 20,000
    expected_accept = torch.minimum(mu, q).sum()  # P(keep) = Σ_v min(μ_v, q_v)
    assert abs(sum(kept) / n - float(expected_accept)) < 0.015


def test_a_model_without_mtp_is_refused(tiny_path):
    with pytest.raises(ValueError, match="MTP"):
        LocalEngine(load_model(tiny_path), speculative_steps=2)
