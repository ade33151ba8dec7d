"""Our GLM-5.2 on its own terms: KV cache, streaming chunks, replay (train = rollout), gradients and
checkpointing, the RL entry points (policy_logprobs, value model), DSA warm-up loss, MTP, bf16."""

import copy

import pytest
import torch

from models import policy_logprobs, token_values
from models.glm5 import Glm5Cache, Glm5Config, Glm5ForValue
from models.glm5.indexer import Indexer
from models.glm5.mtp import mtp_hidden_states
from models.glm5.tiny import REFERENCE_CONFIG, build_random

pytestmark = pytest.mark.usefixtures("one_thread")

CFG = Glm5Config(**dict(REFERENCE_CONFIG, initializer_range=0.05))  # F F F S S S F S, dense 0-1, top-k 16


@pytest.fixture(scope="module")
def model():
    return build_random(CFG, seed=3).eval()


def ids_of(b, s, seed=0, vocab=CFG.vocab_size):
    return torch.randint(0, vocab, (b, s), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("cache_kind", ["ours", "transformers"])
def test_incremental_decode_equals_full_forward(model, cache_kind):
    from transformers import DynamicCache

    ids = ids_of(2, 64)
    with torch.no_grad():
        full = model(input_ids=ids, use_cache=False).logits
        cache = Glm5Cache() if cache_kind == "ours" else DynamicCache()
        steps = [model(input_ids=ids[:, :48], cache=cache, use_cache=True).logits]
        for i in range(48, 64):
            steps.append(model(input_ids=ids[:, i:i + 1], cache=cache, use_cache=True).logits)
        assert cache.get_seq_length() == 64
        assert (torch.cat(steps, 1) - full).abs().max() < 2e-5
        cache = Glm5Cache()  # chunked prefill 40 + 24
        chunked = torch.cat([model(input_ids=ids[:, :40], past_key_values=cache).logits,
                             model(input_ids=ids[:, 40:], past_key_values=cache).logits], 1)
        assert (chunked - full).abs().max() < 2e-5


def test_the_engines_indexer_selection_equals_the_trainers(model):
    """Indexer consistency on the CPU (the LocalEngine's path against the trainer's): the DSA top-k of every full
    layer, chosen while decoding token by token from the KV cache, is the set the trainer's whole-sequence forward
    chooses for the same positions, exactly, past the 16 keys where selection begins. (Against SGLang on the GPU
    the sets share 99.1-99.6% of keys: docs/BENCHMARKS.md.)"""
    ids = ids_of(2, 64, seed=4)
    with torch.no_grad():
        whole = model(input_ids=ids, use_cache=False, return_routing=True).indexer_topk
        cache = Glm5Cache()
        steps = [model(input_ids=ids[:, :40], cache=cache, use_cache=True, return_routing=True).indexer_topk]
        for i in range(40, 64):
            steps.append(model(input_ids=ids[:, i:i + 1], cache=cache, use_cache=True,
                               return_routing=True).indexer_topk)
    assert sorted(whole) == [0, 1, 2, 6]  # IndexShare: the full layers
    for layer, chosen in whole.items():
        decoded = torch.cat([step[layer] for step in steps], 1)  # [B, 64, 16]
        assert decoded.shape == chosen.shape
        selected = chosen[:, 16:] >= 0
        assert bool(selected.all())  # past the top-k, every slot holds a key
        assert torch.equal(decoded[:, 16:].sort(-1).values, chosen[:, 16:].sort(-1).values), layer


def test_left_padded_batch_decode_equals_unpadded(model):
    """What LocalEngine does: left padding, positions from the mask, DynamicCache(), logits_to_keep=1."""
    from transformers import DynamicCache

    ids = ids_of(2, 38, seed=1)
    prompt, new = ids[:, :30].clone(), ids[:, 30:]
    mask = torch.ones_like(prompt)
    mask[1, :10] = 0
    prompt[1, :10] = 0
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        cache = DynamicCache()
        out = [model(input_ids=prompt, attention_mask=mask, position_ids=pos, use_cache=True, logits_to_keep=1,
                     cache=cache).logits]
        for j in range(8):
            mask = torch.cat([mask, torch.ones(2, 1, dtype=mask.dtype)], 1)
            pos = pos[:, -1:] + 1
            out.append(model(input_ids=new[:, j:j + 1], attention_mask=mask, position_ids=pos, use_cache=True,
                             cache=cache).logits)
        out = torch.cat(out, 1)
        row0 = model(input_ids=ids[:1]).logits[0, 29:]
        row1 = model(input_ids=ids[1:, 10:]).logits[0, 19:]
    assert (out[0] - row0).abs().max() < 2e-5 and (out[1] - row1).abs().max() < 2e-5


def test_streaming_chunk_sizes_do_not_change_results(model):
    small = build_random(CFG.replace(indexer_query_chunk=5, indexer_key_block=7, attn_query_chunk=3), seed=0).eval()
    small.load_state_dict(model.state_dict())
    ids = ids_of(2, 64, seed=2)
    with torch.no_grad():
        a = model(input_ids=ids, return_routing=True)
        b = small(input_ids=ids, return_routing=True)
    assert (a.logits - b.logits).abs().max() < 1e-5
    for i in CFG.full_indexer_layers:
        assert torch.equal(a.indexer_topk[i].sort(-1).values, b.indexer_topk[i].sort(-1).values)


def test_replaying_own_choices_gives_identical_logits(model):
    ids = ids_of(2, 64, seed=4)
    with torch.no_grad():
        out = model(input_ids=ids, return_routing=True)
        again = model(input_ids=ids, indexer_topk=out.indexer_topk, routed_experts=out.routed_experts,
                      return_routing=True)
    assert sorted(out.indexer_topk) == CFG.full_indexer_layers and sorted(out.routed_experts) == CFG.moe_layers
    assert out.indexer_topk[0].shape == (2, 64, CFG.index_topk)
    assert out.routed_experts[2].shape == (2, 64, CFG.num_experts_per_tok)
    assert torch.equal(again.logits, out.logits)
    for i in CFG.full_indexer_layers:
        assert torch.equal(again.indexer_topk[i], out.indexer_topk[i])


def test_replaying_other_topk_changes_exactly_the_later_positions(model):
    ids = ids_of(1, 64, seed=5)
    with torch.no_grad():
        out = model(input_ids=ids, return_routing=True)
        # every causal key at every full layer → the dense model (top-k ≥ S), shared layers following suit
        dense = build_random(CFG.replace(index_topk=64), seed=0).eval()
        dense.load_state_dict(model.state_dict())
        everything = {i: torch.arange(64).expand(1, 64, 64) for i in CFG.full_indexer_layers}
        assert (model(input_ids=ids, indexer_topk=everything).logits - dense(input_ids=ids).logits).abs().max() < 1e-5
        # change layer 2's selection for queries ≥ 40 only (its shared layers 3-5 reuse it): earlier logits keep
        changed = dict(out.indexer_topk)
        sel = changed[2].clone()
        sel[:, 40:] = torch.stack([torch.randperm(t + 1)[:CFG.index_topk] for t in range(40, 64)])
        changed[2] = sel
        logits = model(input_ids=ids, indexer_topk=changed).logits
    # (to fp32 rounding: the MoE batches different token sets per expert)
    assert (logits[:, :40] - out.logits[:, :40]).abs().max() < 1e-5
    assert (logits[:, 40:] - out.logits[:, 40:]).abs().amax(-1).min() > 1e-4


def test_replaying_experts_equals_routing_to_them(model):
    """Replayed ids replace the selection; gates still come from σ (the bias never weighs)."""
    ids = ids_of(1, 24, seed=6)
    forced = copy.deepcopy(model)
    forced.model.layers[3].mlp.gate.e_score_correction_bias[[5, 1]] += 100.0  # the router now picks {1, 5}
    with torch.no_grad():
        want = forced(input_ids=ids, return_routing=True)
        assert set(want.routed_experts[3].unique().tolist()) == {1, 5}
        got = model(input_ids=ids, routed_experts={3: want.routed_experts[3]}).logits
        base = model(input_ids=ids).logits
    assert (got - want.logits).abs().max() < 1e-6
    assert (got - base).abs().max() > 1e-3


def test_backward_frozen_indexer_and_checkpointing_replays(model):
    ids = ids_of(2, 40, seed=7)
    grads = []
    for ckpt in (False, True):
        m = copy.deepcopy(model).train()
        if ckpt:
            m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        lp, _ = policy_logprobs(m, ids, torch.ones_like(ids), chunk_size=7)
        lp.sum().backward()
        indexer_params = [p for mod in m.modules() if isinstance(mod, Indexer) for p in mod.parameters()]
        assert indexer_params and all(not p.requires_grad and p.grad is None for p in indexer_params)
        named = {n: p.grad for n, p in m.named_parameters() if p.requires_grad and ".layers.8." not in n}
        assert all(g is not None for g in named.values())  # every non-MTP trainable parameter gets a gradient
        grads.append(named)
    for name in grads[0]:
        assert torch.allclose(grads[0][name], grads[1][name], atol=1e-6, rtol=1e-5), name


def test_policy_logprobs_and_labels_loss_match_full_logits(model):
    ids = ids_of(2, 30, seed=8)
    mask = torch.ones_like(ids)
    mask[1, 22:] = 0
    only = torch.zeros_like(ids)
    only[:, 10:] = 1
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask).logits
        ref = torch.log_softmax(logits, -1)[:, :-1].gather(-1, ids[:, 1:, None])[..., 0]
        lp, _ = policy_logprobs(model, ids, mask, chunk_size=4, only=only)
        assert torch.allclose(lp[0, 10:], ref[0, 9:], atol=1e-5)
        assert torch.allclose(lp[1, 10:22], ref[1, 9:21], atol=1e-5) and torch.all(lp[:, :10] == 0)
        labels = ids.masked_fill(mask == 0, -100)
        loss = model(input_ids=ids, attention_mask=mask, labels=labels, logits_to_keep=None, loss_chunk_rows=5)
        assert loss.logits is None
        ce = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten())
        assert torch.allclose(loss.loss, ce, atol=1e-5)


def test_value_model_starts_at_zero():
    critic = Glm5ForValue(CFG)
    ids = ids_of(1, 20, seed=9)
    assert torch.all(token_values(critic, ids, torch.ones_like(ids)) == 0)
    assert not hasattr(critic, "lm_head") and len(critic.model.layers) == CFG.num_hidden_layers  # no MTP


@pytest.mark.parametrize("mode", ["dense", "sparse"])
def test_indexer_warmup_loss_trains_only_the_indexer(model, mode):
    m = copy.deepcopy(model).train()
    m.set_indexer_trainable(True)
    ids = ids_of(2, 48, seed=10)
    indexer_params = [p for mod in m.modules() if isinstance(mod, Indexer) for p in mod.parameters()]
    opt = torch.optim.Adam(indexer_params, lr=3e-3)
    losses = []
    for _ in range(6):
        out = m(input_ids=ids, indexer_loss=mode, logits_to_keep=None)
        opt.zero_grad()
        out.indexer_loss.backward()
        losses.append(out.indexer_loss.item())
        grads = {n: p.grad for n, p in m.named_parameters() if p.grad is not None}
        assert grads and all(".indexer." in n for n in grads)  # the LM never hears of it
        opt.step()
    assert losses[0] > 0 and losses[-1] < losses[0]


def test_mtp_loss_causality_sharing_and_tv(model):
    m = copy.deepcopy(model).train()
    ids = ids_of(2, 40, seed=11)
    out = m(input_ids=ids, mtp_steps=3, mtp_tv_weight=1.0, logits_to_keep=None)
    mtp = out.mtp
    assert len(mtp.ce) == 3 and all(torch.isfinite(c) and c > 0 for c in mtp.ce)
    assert all(0 <= t <= 1 for t in mtp.tv) and 0 < mtp.accept_length <= 3
    mtp.loss.backward()
    n = CFG.num_hidden_layers
    assert m.model.layers[n].eh_proj.weight.grad is not None and m.lm_head.weight.grad is not None
    assert m.model.layers[n].self_attn.kv_b_proj.weight.grad.abs().sum() > 0
    # step j at anchor i reads tokens ≤ i + j only (and the target's hidden states ≤ i)
    m.eval()
    with torch.no_grad():
        def steps(tokens):
            h = m.model(input_ids=tokens).last_hidden_state
            return mtp_hidden_states(m.model, h, tokens, None, torch.arange(40).expand(2, 40), 3)
        base = steps(ids)
        other = ids.clone()
        other[:, 30] = (other[:, 30] + 1) % CFG.vocab_size
        moved = steps(other)
        # without MTP index sharing, steps ≥ 2 run the MTP indexer on their own queries (over step 1's keys)
        m.config.index_share_for_mtp_iteration = False
        own = steps(ids)
    for j, (a, b) in enumerate(zip(base, moved), start=1):
        assert (a[:, :30 - j] - b[:, :30 - j]).abs().max() < 1e-5
        assert (a[:, 30 - j] - b[:, 30 - j]).abs().max() > 1e-4
    k = CFG.index_topk
    assert torch.equal(own[0], base[0]) and (own[1][:, :k] - base[1][:, :k]).abs().max() < 1e-5
    assert (own[1][:, k + 1:] - base[1][:, k + 1:]).abs().max() > 1e-3


def test_bf16_keeps_router_bias_fp32(model):
    m = copy.deepcopy(model).to(torch.bfloat16)
    gate = m.model.layers[2].mlp.gate
    assert gate.e_score_correction_bias.dtype == torch.float32 and gate.weight.dtype == torch.bfloat16
    ids = ids_of(1, 32, seed=12)
    with torch.no_grad():
        lo = m(input_ids=ids).logits.float()
        hi = model(input_ids=ids).logits
    # bf16 flips some near-tied expert / key selections (transformers' bf16 moves as much): compare on average
    print(f"bf16 vs fp32: mean |Δ| {(lo - hi).abs().mean():.3g}")
    assert torch.isfinite(lo).all() and (lo - hi).abs().mean() < 0.15  # transformers bf16: 0.09 here


def _moe_outputs_and_grads(impl: str, device: str, dtype: torch.dtype, replay=None):
    model = build_random(CFG.replace(moe_impl=impl), seed=3).to(device, dtype).train()
    ids = ids_of(2, 48, seed=11).to(device)
    out = model(input_ids=ids, routed_experts=replay, return_routing=True)
    out.logits.float().square().mean().backward()
    return out, {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU"))])
def test_grouped_experts_equal_the_loop_over_experts(device):
    """The grouped-GEMM dispatch (the GPU default) against the per-expert loop (checked against transformers in
    glm5/test_numerics.py): same logits, same gradient for every parameter — each expert's weights included, the
    idle ones' staying None in both — under the same routing."""
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    loop, loop_grads = _moe_outputs_and_grads("loop", device, dtype)
    grouped, grouped_grads = _moe_outputs_and_grads("grouped", device, dtype, replay=loop.routed_experts)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert (grouped.logits - loop.logits).abs().max() <= tol * loop.logits.abs().max()
    idle = grouped_grads.keys() - loop_grads.keys()
    assert all(".experts." in n and grouped_grads[n].abs().max() == 0 for n in idle)
    for name, want in loop_grads.items():
        got = grouped_grads[name]
        assert (got - want).abs().max() <= tol * max(want.abs().max().item(), 1e-12), name


def test_grouped_experts_step_aside_under_zero3():
    """ZeRO-3 gathers an expert's weights in that module's forward hook (any world size): the grouped path,
    which reads the weights without calling the modules, must not run on DeepSpeed-partitioned parameters."""
    moe = next(m for m in build_random(CFG.replace(moe_impl="grouped")).modules() if hasattr(m, "use_grouped"))
    x = torch.zeros(2, CFG.hidden_size)
    assert moe.use_grouped(x)
    moe.experts[0].gate_proj.weight.ds_id = 0  # what deepspeed.zero.Init / ZeRO-3 set on every parameter
    assert not moe.use_grouped(x)
