import pytest
import torch

from models import GLM52_TINY, TINY, load_model, policy_logprobs, resolve_model_path, token_values
from models.batching import TokenBatch, make_micro_batches, unbatch
from models.loading import supports_packed_sequences


def test_default_policy_is_smollm2_from_the_wheel():
    from transformers import AutoConfig

    path = resolve_model_path("smollm2-135m-instruct")
    config = AutoConfig.from_pretrained(path)
    assert config.model_type == "llama" and config.num_hidden_layers == 30 and config.vocab_size == 49152
    assert (path / "model.safetensors").exists() and (path / "tokenizer.json").exists()


def test_unknown_model_is_a_clear_error():
    with pytest.raises(FileNotFoundError, match="not a built-in name"):
        resolve_model_path("/nowhere/model")


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_chunked_logprobs_equal_plain_log_softmax(tiny_model, temperature):
    ids = torch.randint(0, 49152, (2, 23), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, 17:] = 0  # right padding
    with torch.no_grad():
        logits = tiny_model(input_ids=ids, attention_mask=mask).logits.float() / temperature
        ref = torch.log_softmax(logits, -1)[:, :-1].gather(-1, ids[:, 1:, None])[..., 0]
        lp, ent = policy_logprobs(tiny_model, ids, mask, temperature, chunk_size=4, with_entropy=True)
    assert lp.shape == ids.shape and torch.all(lp[:, 0] == 0)
    assert torch.allclose(lp[0, 1:], ref[0], atol=1e-5) and torch.allclose(lp[1, 1:17], ref[1, :16], atol=1e-5)
    probs = torch.softmax(logits, -1)[:, :-1]
    assert torch.allclose(ent[0, 1:], -(probs[0] * probs[0].log()).sum(-1), atol=1e-4)


def test_chunking_keeps_gradients_exact(tiny_path):
    ids = torch.randint(0, 49152, (2, 19), generator=torch.Generator().manual_seed(1))
    grads = []
    for chunk in (3, 1000):
        model = load_model(tiny_path)
        lp, _ = policy_logprobs(model, ids, torch.ones_like(ids), 1.0, chunk_size=chunk)
        lp.sum().backward()
        grads.append(model.model.layers[0].mlp.up_proj.weight.grad.clone())
    assert torch.allclose(grads[0], grads[1], atol=1e-6)


def test_value_model_starts_at_zero_and_saves_in_hf_format(tiny_path, tmp_path):
    from transformers import AutoModelForTokenClassification

    critic = load_model(tiny_path, role="value")
    ids = torch.randint(0, 49152, (1, 9))
    assert torch.all(token_values(critic, ids, torch.ones_like(ids)) == 0)
    with torch.no_grad():
        critic.score.weight.normal_()
    critic.save_pretrained(tmp_path)
    again = load_model(str(tmp_path), role="value")  # a critic checkpoint keeps its trained head
    assert torch.equal(again.score.weight, critic.score.weight)
    assert isinstance(AutoModelForTokenClassification.from_pretrained(tmp_path), torch.nn.Module)
    values = token_values(again, ids, torch.ones_like(ids))
    assert values[0, 0] == 0 and values[0, 1:].abs().sum() > 0


@pytest.mark.parametrize("packed", [False, True])
def test_micro_batches_respect_the_budget_and_roundtrip(packed):
    samples = [{"token_ids": list(range(n)), "f": [float(i) for i in range(n)]} for n in (5, 30, 12, 7, 30, 45, 18)]
    batch = TokenBatch.from_samples(samples, ("f",))
    assert batch.fields["token_ids"].dtype == torch.long and batch.fields["f"].dtype == torch.float32
    batches = make_micro_batches(batch, ("f",), max_tokens=64, packed=packed)
    for mb in batches:
        rows, width = mb.tensors["input_ids"].shape
        assert rows * width <= 64 or len(mb.indices) == 1  # a sample over the budget gets a micro-batch of its own
        assert width == max(mb.lengths)  # as wide as its longest sample, packed or not
        if packed:  # positions restart at each sample and in each row's unused tail
            for r in range(rows):
                row = [(n, c) for n, (rr, c) in zip(mb.lengths, mb.starts) if rr == r]
                want = [p for n, _ in row for p in range(n)]
                want += list(range(width - len(want)))
                assert mb.position_ids[r].tolist() == want
    assert sorted(i for mb in batches for i in mb.indices) == list(range(7))
    positions = sum(mb.tensors["input_ids"].numel() for mb in batches)
    if packed:  # 45 | 30, 30 | 18, 12+5, 7 (rows of 18): 3 micro-batches; padded needs 4 (5 alone at the end)
        assert [sorted(len(r) for r in _rows(mb)) for mb in batches] == [[1], [1, 1], [1, 1, 2]]
        assert positions == 45 + 2 * 30 + 3 * 18
    else:
        assert len(batches) == 4 and positions == 45 + 2 * 30 + 3 * 18 + 5
    back = batch.split(unbatch(batches, [mb.tensors["f"] for mb in batches], batch))
    assert [t.tolist() for t in back] == [s["f"] for s in samples]  # (position 0 is 0 by construction)
    # a TokenBatch's selection and split keep each sample's values
    picked = batch.select([4, 0])
    assert picked.lengths == [30, 5] and picked.sample(1, "f").tolist() == samples[0]["f"]


def _rows(mb) -> list[list[int]]:
    rows: dict[int, list[int]] = {}
    for i, (r, _) in zip(mb.indices, mb.starts):
        rows.setdefault(r, []).append(i)
    return list(rows.values())


def test_packing_never_needs_more_positions_than_padding():
    g = torch.Generator().manual_seed(3)
    for budget in (64, 512, 4096):
        lengths = torch.randint(1, 700, (40,), generator=g).tolist()
        batch = TokenBatch.from_samples([{"token_ids": [0] * n} for n in lengths])
        cost = {p: sum(mb.tensors["input_ids"].numel() for mb in make_micro_batches(batch, (), budget, packed=p))
                for p in (False, True)}
        assert sum(lengths) <= cost[True] <= cost[False]


@pytest.mark.parametrize("name", [TINY, GLM52_TINY])
def test_packed_rows_equal_padded_rows(name):
    """Packing changes nothing but the layout: logprobs, values and gradients of every sample equal the padded
    rows' (tiny-random: the default policy's Llama architecture; glm52-tiny: GLM-5.2 with top-16 sparse attention,
    so samples longer than 16 tokens go through the indexer and the sparse path, IndexShare layers included)."""
    g = torch.Generator().manual_seed(0)
    samples = [{"token_ids": torch.randint(100, 4000, (n,), generator=g),
                "loss_mask": torch.tensor([0.0] * 3 + [1.0] * (n - 3))} for n in (20, 45, 7, 50, 12, 33, 9)]
    batch = TokenBatch.from_samples(samples, ("loss_mask",))

    def run(model, packed, role):
        model.zero_grad()
        mbs = make_micro_batches(batch, ("loss_mask",), 128, packed=packed)
        outs = []
        for mb in mbs:
            t = mb.tensors
            out = (policy_logprobs(model, t["input_ids"], t["attention_mask"], only=t["loss_mask"],
                                   position_ids=mb.position_ids)[0] if role == "policy" else
                   token_values(model, t["input_ids"], t["attention_mask"], mb.position_ids))
            (out * t["loss_mask"]).sum().backward()
            outs.append(out.detach())
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        return unbatch(mbs, outs, batch), sum(mb.tensors["input_ids"].numel() for mb in mbs), grads

    for role in ("policy", "value"):
        model = load_model(name, role)
        if role == "value":
            torch.manual_seed(0)
            model.score.weight.data.normal_()
        assert supports_packed_sequences(model)
        (padded, n_padded, g_padded), (packed, n_packed, g_packed) = run(model, False, role), run(model, True, role)
        assert n_packed < n_padded  # positions computed: the short samples filled the padding
        assert padded.abs().max() > 0.1
        torch.testing.assert_close(packed, padded, atol=2e-5, rtol=1e-5)
        assert g_padded.keys() == g_packed.keys() and len(g_padded) > 10
        for k in g_padded:
            scale = float(g_padded[k].abs().max()) + 1e-12
            assert float((g_packed[k] - g_padded[k]).abs().max()) <= 1e-4 * scale, k
