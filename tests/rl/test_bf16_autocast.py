"""trainer.bf16_autocast: the workers' forward passes under bf16 autocast, the weights, the optimizer and the LM
head in fp32. Checked against the same worker without autocast and against the head computed by hand."""

import math

import pytest
import torch

from critic.worker import CriticWorker
from models.batching import split_per_sample
from models.deepspeed_worker import OptimConfig
from models.logprobs import policy_logprobs
from rl.actor import ActorWorker
from rl.config import AlgorithmConfig
from tests.rl.test_workers import batch, value_losses


def actor(tiny_path, bf16_autocast):
    return ActorWorker(tiny_path, OptimConfig(learning_rate=1e-3, micro_batch_tokens=80, bf16_autocast=bf16_autocast),
                       AlgorithmConfig(use_reference=False), temperature=1.0)


def test_autocast_moves_the_logprobs_by_bf16_rounding_only_and_trains_fp32_weights(tiny_path):
    samples = batch()
    mask = torch.cat([torch.tensor(s["loss_mask"]) for s in samples]) > 0
    plain, auto = actor(tiny_path, False), actor(tiny_path, True)
    exact = plain.compute_logprobs(samples)["old_logprobs"]
    rounded = auto.compute_logprobs(samples)["old_logprobs"]
    diff = (rounded - exact).abs()[mask]
    # the flag took effect (bf16 matmuls round), and by bf16's error only (its 8-bit mantissa: ~0.4% a matmul)
    assert 0 < float(diff.max()) < 0.05 and rounded.dtype == torch.float32
    for s, old in zip(samples, split_per_sample(samples, rounded)):
        s.update(old_logprobs=old, rollout_logprobs=old.clone(), advantages=list(s["loss_mask"]))
    before = {n: p.detach().clone() for n, p in auto.module.named_parameters()}
    metrics = auto.train_step(samples)
    assert math.isfinite(metrics["actor/grad_norm"]) and metrics["actor/grad_norm"] > 0
    moved = [n for n, p in auto.module.named_parameters() if not torch.equal(p, before[n])]
    assert moved and all(p.dtype == torch.float32 for p in auto.module.parameters())
    # a step of lr 1e-3 along the advantage raises the action tokens' logprobs, as without autocast
    after = auto.compute_logprobs(samples)["old_logprobs"]
    assert float(after[mask].mean()) > float(rounded[mask].mean())


def test_under_autocast_the_head_and_its_log_softmax_stay_fp32(tiny_path):
    """The backbone under autocast, then the LM head in fp32 by hand: policy_logprobs gives exactly that, and
    not what a bf16 head gives."""
    model = actor(tiny_path, False).module.eval()
    s = batch(1)[0]
    ids = torch.tensor([s["token_ids"]])
    attention = torch.ones_like(ids)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        got, _ = policy_logprobs(model, ids, attention)
        hidden = model.get_decoder()(input_ids=ids, attention_mask=attention).last_hidden_state[:, :-1]
        bf16_head = model.get_output_embeddings()(hidden).float()
    with torch.no_grad():
        fp32_logits = model.get_output_embeddings()(hidden.float())
    want = torch.log_softmax(fp32_logits, -1).gather(-1, ids[:, 1:, None])[..., 0]
    assert torch.allclose(got[:, 1:], want, atol=1e-5)
    rounded = torch.log_softmax(bf16_head, -1).gather(-1, ids[:, 1:, None])[..., 0]
    assert float((rounded - want).abs().max()) > 10 * float((got[:, 1:] - want).abs().max())


def test_the_critic_trains_under_autocast(tiny_path):
    critic = CriticWorker(tiny_path, OptimConfig(learning_rate=1e-3, bf16_autocast=True), value_clip=None)
    losses = value_losses(critic, batch(), 6)
    assert losses[-1] < 0.6 * losses[0]
    assert all(p.dtype == torch.float32 for p in critic.module.parameters())


def test_trainer_bf16_autocast_reaches_both_models_optimizer_settings():
    from rl.cluster import _optim
    from rl.config import TrainerConfig

    assert OptimConfig(**_optim(TrainerConfig(bf16_autocast=True))).bf16_autocast
    assert not OptimConfig(**_optim(TrainerConfig())).bf16_autocast  # off by default: the CPU suite stays fp32


def test_autocast_over_weights_that_are_not_fp32_is_refused():
    from rl.config import Config, validate

    cfg = Config()
    cfg.trainer.bf16_autocast, cfg.model.dtype = True, "bfloat16"
    with pytest.raises(ValueError, match="trainer.bf16_autocast with model.dtype=bfloat16"):
        validate(cfg)


def test_autocast_of_a_glm52_model_is_refused_by_name():
    from models import resolve_model_path

    with pytest.raises(ValueError, match="trainer.bf16_autocast is for transformers' models"):
        ActorWorker(str(resolve_model_path("glm52-tiny")), OptimConfig(bf16_autocast=True),
                    AlgorithmConfig(use_reference=False), temperature=1.0)
