import asyncio

import pytest
import torch

from models import load_model, policy_logprobs
from rollout.engine import Engine
from rollout.local_engine import LocalEngine
from rollout.types import SamplingParams


@pytest.fixture(scope="module")
def engine(tiny_path):
    eng = LocalEngine(load_model(tiny_path), None, max_batch_size=8)
    from models import load_tokenizer

    eng.tokenizer = load_tokenizer(tiny_path)
    yield eng
    eng.close()


def run(coro):
    return asyncio.run(coro)


def test_is_an_engine(engine):
    assert isinstance(engine, Engine)


def test_logprobs_equal_an_independent_forward(engine, tiny_path):
    """μ returned by the engine (batched, KV cache, left padding) = log-softmax of a plain full forward."""
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(tiny_path).eval()
    prompts = [[1, 2, 3, 4, 5], [7, 8], list(range(100, 140))]

    async def go():
        return await asyncio.gather(*[engine.generate(p, SamplingParams(temperature=0.8, max_new_tokens=12, seed=i))
                                      for i, p in enumerate(prompts)])
    for prompt, res in zip(prompts, run(go())):
        assert len(res.output_ids) == 12 and res.finish_reason == "length"
        ids = torch.tensor([prompt + res.output_ids])
        with torch.no_grad():
            logits = reference(ids).logits[0].float() / 0.8
        ref = torch.log_softmax(logits, -1)[len(prompt) - 1:-1].gather(-1, torch.tensor(res.output_ids)[:, None])
        assert torch.allclose(torch.tensor(res.output_logprobs), ref[:, 0], atol=1e-4)
        # and the trainer's chunked computation agrees too
        lp, _ = policy_logprobs(reference, ids, torch.ones_like(ids), 0.8, chunk_size=5)
        assert torch.allclose(lp[0, len(prompt):], torch.tensor(res.output_logprobs), atol=1e-4)


def test_seed_reproducible_and_batch_independent(engine):
    sp = SamplingParams(temperature=1.0, max_new_tokens=10, seed=123)
    alone = run(engine.generate([5, 6, 7], sp))

    async def crowded():  # queued while paused: one batch, however slow the machine
        await engine.pause()
        tasks = [asyncio.create_task(engine.generate([5, 6, 7], sp))]
        tasks += [asyncio.create_task(engine.generate(list(range(20 + i, 40 + i)),
                                                      SamplingParams(max_new_tokens=15, seed=i))) for i in range(5)]
        await asyncio.sleep(0)
        await engine.resume()
        return (await asyncio.gather(*tasks))[0]
    together = run(crowded())
    assert alone.output_ids == together.output_ids
    assert together.meta["batch_size"] == 6


def test_stop_tokens_and_strings(engine):
    free = run(engine.generate([1, 2, 3], SamplingParams(temperature=0.0, max_new_tokens=8)))
    stop_tok = free.output_ids[3]
    first = free.output_ids.index(stop_tok)
    res = run(engine.generate([1, 2, 3], SamplingParams(temperature=0.0, max_new_tokens=8,
                                                        stop_token_ids=(stop_tok,))))
    assert res.finish_reason == "stop" and res.output_ids == free.output_ids[:first + 1]
    text = engine.tokenizer.decode(free.output_ids[:4])
    res2 = run(engine.generate([1, 2, 3], SamplingParams(temperature=0.0, max_new_tokens=8,
                                                         stop_strings=(text[-3:],))))
    assert res2.finish_reason == "stop" and len(res2.output_ids) <= 4


def test_update_weights_and_version(engine, tiny_path):
    sp = SamplingParams(temperature=1.0, max_new_tokens=6, seed=3)
    before = run(engine.generate([3, 4, 5], sp))
    other = load_model("tiny-random:1")
    original = {k: v.clone() for k, v in engine.model.state_dict().items()}
    run(engine.update_weights(dict(other.named_parameters()), version=7))
    after = run(engine.generate([3, 4, 5], sp))
    assert after.meta["weight_version"] == 7 and after.output_logprobs != before.output_logprobs
    assert torch.equal(engine.model.lm_head.weight, other.model.embed_tokens.weight)  # tied weights follow
    with pytest.raises(KeyError):
        engine.load_weights({"no.such.weight": torch.zeros(1)})
    with pytest.raises(ValueError, match="shape"):
        engine.load_weights({"lm_head.weight": torch.zeros(3, 3)})
    engine.load_weights(original, version=0)
    again = run(engine.generate([3, 4, 5], sp))
    assert again.output_ids == before.output_ids and again.output_logprobs == before.output_logprobs


def test_a_weight_update_mid_generation_continues_on_the_new_weights(engine, tiny_path):
    """A partial rollout: the running batch parks between two decode steps, the weights change, and it goes on
    with them. No token is lost, each says which version sampled it, and its logprob is the one it was sampled
    with: the old weights' for the tokens before the update (equal to an independent forward of the old model)."""
    original = {k: v.clone() for k, v in engine.model.state_dict().items()}
    other = load_model("tiny-random:1")
    prompt, sp = [3, 4, 5], SamplingParams(temperature=1.0, max_new_tokens=300, seed=11, ignore_eos=True)

    async def go():
        steps, parked = engine.stats["decode_steps"], engine.stats["parked_batches"]
        request = asyncio.create_task(engine.generate(prompt, sp))
        while engine.stats["decode_steps"] < steps + 20:
            await asyncio.sleep(0.005)
        await engine.pause()
        await engine.update_weights(dict(other.named_parameters()), version=5)
        await engine.resume()
        return await request, engine.stats["parked_batches"] - parked

    try:
        result, parked = run(go())
    finally:
        engine.load_weights(original, version=0)
    versions = result.versions()
    assert parked == 1 and len(result.output_ids) == 300 and versions == sorted(versions)
    before = versions.count(0)
    assert 20 <= before < 300 and set(versions) == {0, 5}
    ids = torch.tensor([prompt + result.output_ids])
    with torch.no_grad():  # logprobs aligned with the tokens: position t holds log π(ids[t] | ids[:t])
        old = policy_logprobs(engine.model, ids, torch.ones_like(ids), 1.0)[0][0, len(prompt):]
    sampled = torch.tensor(result.output_logprobs)
    assert torch.allclose(sampled[:before], old[:before], atol=1e-4)
    assert not torch.allclose(sampled[before:], old[before:], atol=1e-2)  # the new weights'


def test_abort_and_health(engine):
    async def go():
        await engine.pause()
        task = asyncio.ensure_future(engine.generate([1, 2], SamplingParams(max_new_tokens=50), request_id="x"))
        await asyncio.sleep(0.05)
        await engine.abort(["x"])
        await engine.resume()
        return await task, await engine.health()
    res, health = run(go())
    assert res.finish_reason == "abort" and health["ok"]


def test_a_failed_serving_loop_is_restarted_and_serves_what_was_queued(tiny_model):
    """Fault injection: the serving loop fails outside a batch (where no caller would hear of it). It restarts in
    place, with the model as it was, and the requests go on being served; a loop that keeps failing closes the
    engine and fails its requests instead of hanging them."""
    import rollout.local_engine as le

    failures = []
    engine = LocalEngine(tiny_model, max_batch_size=4)
    real_pause = engine._gather_pause

    def failing_pause():
        if not failures:
            failures.append(True)
            raise RuntimeError("injected: the serving loop dies")
        real_pause()

    engine._gather_pause = failing_pause  # read by the serving thread when the first request comes
    try:
        async def go():
            return await asyncio.gather(*(engine.generate([1, 2, 3 + i], SamplingParams(max_new_tokens=5, seed=i))
                                          for i in range(3)))

        results = asyncio.run(asyncio.wait_for(go(), 120))
        assert failures and engine.stats["restarts"] == 1 and engine._thread.is_alive()
        assert all(len(r.output_ids) == 5 for r in results)
    finally:
        engine.close()

    broken = LocalEngine(tiny_model, max_batch_size=4)
    broken._gather_pause = lambda: (_ for _ in ()).throw(RuntimeError("always fails"))
    with pytest.raises(RuntimeError):
        asyncio.run(asyncio.wait_for(broken.generate([1, 2, 3], SamplingParams(max_new_tokens=3)), 60))
    assert broken.stats["restarts"] == le.SERVE_RESTARTS and broken.failed
    broken.close()
