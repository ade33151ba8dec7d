"""Our GLM-5.2 against transformers' GlmMoeDsaForCausalLM (≥ 5.13, the numerics reference), fp32, random weights
with randomised norm gains / LayerNorm biases / router biases (docs/GLM52.md §9A): logits and indexer top-k sets."""

import pytest
import torch

from models.glm5 import Glm5Config
from models.glm5.tiny import REFERENCE_CONFIG, build_random

pytestmark = pytest.mark.usefixtures("one_thread")

TOL = 1e-4

# §9A: dense layers 0-1, MoE 2-7, IndexShare F F F S S S F S (freq 4 / offset 3), S = 64 > top-k = 16
CONFIG_A = dict(REFERENCE_CONFIG, initializer_range=0.05)
# group-limited routing, no gate renormalisation, an explicit F/S pattern, 1 dense layer, top-k 8
CONFIG_B = dict(REFERENCE_CONFIG, initializer_range=0.05, num_hidden_layers=4, first_k_dense_replace=1,
                index_topk_pattern="FSFS", index_topk=8, n_group=2, topk_group=1, norm_topk_prob=False,
                routed_scaling_factor=1.5, n_shared_experts=2, attention_bias=False)


def _pair(tmp_path_factory, name, cfg):
    from transformers import GlmMoeDsaForCausalLM

    ours = build_random(Glm5Config(**cfg), seed=3).eval()
    folder = tmp_path_factory.mktemp(name)
    ours.save_pretrained(folder)
    hf, info = GlmMoeDsaForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager",
                                                    output_loading_info=True)
    assert not info["missing_keys"] and not info["mismatched_keys"]
    return ours, hf.eval()


@pytest.fixture(scope="module")
def pair_a(tmp_path_factory):
    return _pair(tmp_path_factory, "a", CONFIG_A)


@pytest.fixture(scope="module")
def pair_b(tmp_path_factory):
    return _pair(tmp_path_factory, "b", CONFIG_B)


def _hf_topk(hf, ids, mask=None):
    """Per full layer, the top-k index tensors transformers' indexers return (forward hooks)."""
    got, hooks = {}, []
    for i, layer in enumerate(hf.model.layers):
        if layer.self_attn.indexer is not None:
            hooks.append(layer.self_attn.indexer.register_forward_hook(
                lambda mod, args, out, i=i: got.__setitem__(i, out.long())))
    try:
        with torch.no_grad():
            logits = hf(input_ids=ids, attention_mask=mask).logits
    finally:
        for h in hooks:
            h.remove()
    return logits, got


def _membership(idx, num_keys, valid_upto):
    """[B, S, T] bool: key s selected by query t (only s ≤ t counts; transformers pads short rows with −inf picks)."""
    b, s, _ = idx.shape
    member = torch.zeros(b, s, num_keys + 1, dtype=torch.bool)
    member.scatter_(-1, torch.where(idx >= 0, idx, num_keys), True)
    member = member[..., :num_keys]
    causal = torch.arange(num_keys)[None, :] <= valid_upto[:, None]
    return member & causal


@pytest.mark.parametrize("which", ["a", "b"])
def test_logits_and_topk_sets_equal_transformers(which, pair_a, pair_b):
    ours, hf = pair_a if which == "a" else pair_b
    cfg = ours.config
    s = 64 if which == "a" else 40
    ids = torch.randint(0, cfg.vocab_size, (2, s), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        out = ours(input_ids=ids, return_routing=True)
    ref, ref_topk = _hf_topk(hf, ids)
    err = (out.logits - ref).abs().max().item()
    print(f"config {which}: max |Δlogits| = {err:.3g} (logit std {ref.std():.3g})")
    assert err < TOL
    assert sorted(ref_topk) == sorted(out.indexer_topk) == cfg.full_indexer_layers
    t = torch.arange(s)
    for i in cfg.full_indexer_layers:
        assert torch.equal(_membership(out.indexer_topk[i], s, t), _membership(ref_topk[i], s, t)), f"layer {i}"
        # sparsity is real: late queries select exactly top-k of their > top-k visible keys
        assert (out.indexer_topk[i][:, -1] >= 0).sum(-1).tolist() == [cfg.index_topk] * 2


def test_sparsity_changes_the_logits(pair_a):
    """The test above is sensitive to the selection: with every key kept (top-k ≥ S) positions past top-k differ,
    positions within it do not (docs/GLM52.md §4.4)."""
    ours, hf = pair_a
    ids = torch.randint(0, 1024, (2, 64), generator=torch.Generator().manual_seed(7))
    dense = build_random(ours.config.replace(index_topk=64), seed=3).eval()
    dense.load_state_dict(ours.state_dict())
    with torch.no_grad():
        sparse_logits, dense_logits = ours(input_ids=ids).logits, dense(input_ids=ids).logits
    k = ours.config.index_topk
    assert (sparse_logits[:, :k] - dense_logits[:, :k]).abs().max() < 1e-5
    assert (sparse_logits[:, k:] - dense_logits[:, k:]).abs().max() > 100 * TOL


def test_right_padding_equals_transformers(pair_a):
    ours, hf = pair_a
    ids = torch.randint(0, 1024, (2, 48), generator=torch.Generator().manual_seed(8))
    mask = torch.ones_like(ids)
    mask[1, 30:] = 0
    with torch.no_grad():
        a = ours(input_ids=ids, attention_mask=mask).logits
        b = hf(input_ids=ids, attention_mask=mask).logits
    assert (a[0] - b[0]).abs().max() < TOL and (a[1, :30] - b[1, :30]).abs().max() < TOL


def test_incremental_decode_equals_transformers_decode(pair_a):
    """48-token prefill + 16 single-token steps with each implementation's cache, against each other."""
    from transformers import DynamicCache

    ours, hf = pair_a
    ids = torch.randint(0, 1024, (1, 64), generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        cache_a, cache_b = DynamicCache(), DynamicCache(config=hf.config)
        a = [ours(input_ids=ids[:, :48], cache=cache_a, use_cache=True).logits]
        b = [hf(input_ids=ids[:, :48], cache=cache_b, use_cache=True).logits]
        for i in range(48, 64):
            a.append(ours(input_ids=ids[:, i:i + 1], cache=cache_a, use_cache=True).logits)
            b.append(hf(input_ids=ids[:, i:i + 1], cache=cache_b, use_cache=True).logits)
    assert (torch.cat(a, 1) - torch.cat(b, 1)).abs().max() < TOL


def test_gradients_equal_transformers(pair_a):
    """The backward too (our SparseMLA by hand, transformers' dense masked attention by autograd): every
    parameter's gradient of the next-token loss, fp32, with sparse selection active (S = 64 > top-k = 16). The
    indexer is frozen on both sides; MTP (not in transformers' forward) is left out."""
    ours, hf = pair_a
    ids = torch.randint(0, ours.config.vocab_size, (2, 64), generator=torch.Generator().manual_seed(11))
    ours.train(), hf.train()
    try:
        ours.zero_grad(), hf.zero_grad()
        ours(input_ids=ids, labels=ids, logits_to_keep=None).loss.backward()
        hf(input_ids=ids, labels=ids).loss.backward()
        theirs = {n: p.grad for n, p in hf.named_parameters()}
        for n in [n for n in theirs if n.endswith("experts.gate_up_proj")]:  # fused [E, 2I, D] → per expert
            stem, (gate, up) = n[:-len("gate_up_proj")], theirs[n].chunk(2, dim=1)
            for e in range(gate.shape[0]):
                theirs[f"{stem}{e}.gate_proj.weight"], theirs[f"{stem}{e}.up_proj.weight"] = gate[e], up[e]
                theirs[f"{stem}{e}.down_proj.weight"] = theirs[f"{stem}down_proj"][e]
        compared = 0
        for name, p in ours.named_parameters():
            if p.grad is None or ".layers.8." in name:
                continue
            ref = theirs[name]
            scale = ref.abs().max().item() or 1.0
            assert (p.grad - ref).abs().max().item() <= 1e-4 * max(scale, 1.0), name
            compared += 1
        assert compared > 50 and any("kv_a_proj" in n for n, p in ours.named_parameters() if p.grad is not None)
    finally:
        ours.eval(), hf.eval()
        ours.zero_grad(), hf.zero_grad()
