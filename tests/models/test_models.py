import pytest
import torch

from models import load_model, policy_logprobs, resolve_model_path, token_values
from models.batching import make_micro_batches, unbatch


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


def test_micro_batches_respect_the_budget_and_roundtrip():
    samples = [{"token_ids": list(range(n)), "f": [float(i) for i in range(n)]} for n in (5, 30, 12, 7, 30)]
    batches = make_micro_batches(samples, ("f",), max_tokens=40)
    for mb in batches:
        rows, width = mb.tensors["input_ids"].shape
        assert rows * width <= 40 or rows == 1
    assert sorted(i for mb in batches for i in mb.indices) == list(range(5))
    back = unbatch(batches, [mb.tensors["f"] for mb in batches], len(samples))
    assert back == [s["f"] for s in samples]
