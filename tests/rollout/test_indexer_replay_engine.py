"""Margin-gated indexer replay from the LocalEngine (glm52-tiny, fp32): the engine records the indexer rows whose
margin is under τ, on each sequence's own positions (left padding and the KV cache's columns removed); a trainer
whose indexer differs slightly recomputes the engine's logprobs exactly when it replays just those rows."""

import asyncio
import copy

import numpy as np
import pytest
import torch

from rollout import indexer_replay
from rollout.local_engine import LocalEngine
from rollout.types import SamplingParams

TAU = 1e-4


def generate(model, prompts: list[list[int]], new_tokens: int = 20, speculative_steps: int = 0):
    engine = LocalEngine(model, max_batch_size=8, gather_window_s=0.2, indexer_replay_margin=TAU,
                         speculative_steps=speculative_steps)

    async def all_of_them():
        return await asyncio.gather(*(engine.generate(p, SamplingParams(max_new_tokens=new_tokens, seed=i,
                                                                        ignore_eos=True))
                                      for i, p in enumerate(prompts)))
    try:
        return asyncio.run(all_of_them())
    finally:
        engine.close()


def trainer_logprobs(model, prompt: list[int], result, replay: bool) -> torch.Tensor:
    """log π of the generated tokens from one full forward (no cache), replaying the engine's rows or not."""
    seq = prompt + result.output_ids
    topk = indexer_replay.model_replay(result.meta["indexer_replay"]) if replay else None
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([seq]), use_cache=False, indexer_topk=topk).logits[0].float()
    logp = torch.log_softmax(logits, -1)
    at = torch.arange(len(prompt) - 1, len(seq) - 1)
    return logp[at, torch.tensor(result.output_ids)]


@pytest.mark.parametrize("speculative_steps", [0, 3])
def test_the_trainer_recomputes_the_engines_logprobs_when_it_replays_the_rows_under_the_margin(glm52_policy,
                                                                                             speculative_steps):
    """Plain decoding, and speculative decoding (MTP drafts verified in one forward: the rejected drafts leave
    holes in the cache, so its slots are not the sequence's positions)."""
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(100, 4000, (n,), generator=g).tolist() for n in (28, 41, 35)]  # left padding
    results = generate(glm52_policy, prompts, speculative_steps=speculative_steps)
    if speculative_steps:  # some drafts were rejected: their slots became holes
        assert sum(r.meta["speculative_accepted"] for r in results) < 3 * sum(r.meta["speculative_rounds"]
                                                                            for r in results)
    k = glm52_policy.config.index_topk
    trainer = copy.deepcopy(glm52_policy)  # an indexer off by 0.1%, as another implementation's rounding may be
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in trainer.named_parameters():
            if ".indexer." in name and "norm" not in name:
                p.mul_(1 + 1e-3 * torch.randn(p.shape, generator=g))
    worst_own, worst_replayed, rows, queries = 0.0, 0.0, 0, 0
    for prompt, result in zip(prompts, results):
        rec = result.meta["indexer_replay"]
        ran = len(prompt) + len(result.output_ids) - 1
        assert rec["keys"].shape[1] == k and rec["keys"].dtype == np.int32 and rec["positions"].dtype == np.int32
        assert set(rec["layers"].tolist()) <= set(glm52_policy.config.full_indexer_layers)
        assert ((rec["positions"] >= k) & (rec["positions"] < ran)).all()  # only rows with a choice to make
        assert ((rec["keys"] <= rec["positions"][:, None]) & (rec["keys"] >= -1)).all()  # causal, own positions
        assert ((rec["keys"] >= 0).sum(1) == k).all()
        engine_lp = torch.tensor(result.output_logprobs)
        # the same weights: the full forward replaying the engine's rows is the engine's (cache vs none aside)
        assert (trainer_logprobs(glm52_policy, prompt, result, True) - engine_lp).abs().max() < 1e-5
        worst_own = max(worst_own, float((trainer_logprobs(trainer, prompt, result, False) - engine_lp).abs().max()))
        worst_replayed = max(worst_replayed,
                             float((trainer_logprobs(trainer, prompt, result, True) - engine_lp).abs().max()))
        rows += len(rec["positions"])
        queries += (ran - k) * len(glm52_policy.config.full_indexer_layers)
    assert worst_own > 1e-3, "the perturbed indexer chose like the engine everywhere: the test shows nothing"
    assert worst_replayed < 1e-5
    assert 0 < rows < 0.25 * queries, (rows, queries)  # a few rows of those with a choice, not all of them


def test_an_engine_without_an_indexer_refuses_the_margin():
    from transformers import AutoConfig, AutoModelForCausalLM

    dense = AutoModelForCausalLM.from_config(AutoConfig.for_model("llama", vocab_size=64, hidden_size=16,
                                                                  intermediate_size=32, num_hidden_layers=1,
                                                                  num_attention_heads=2, num_key_value_heads=2))
    with pytest.raises(ValueError, match="no sparse-attention indexer"):
        LocalEngine(dense, indexer_replay_margin=TAU)
