"""HF interop (sharded safetensors with GLM-5.2 tensor names, both directions with transformers), critic
checkpoints, block-FP8 loading, and the framework hooks: load_model, the glm52-tiny built-in, LocalEngine."""

import asyncio
import json
import logging
import re

import pytest
import torch

from models import load_model, load_tokenizer, policy_logprobs, resolve_model_path
from models.glm5 import Glm5Config, Glm5ForCausalLM, Glm5ForValue, load_hf
from models.glm5.checkpoint import INDEX_FILE
from models.glm5.tiny import REFERENCE_CONFIG, build_random, randomise_for_testing

pytestmark = pytest.mark.usefixtures("one_thread")

CFG = Glm5Config(**dict(REFERENCE_CONFIG, initializer_range=0.05))
N = CFG.num_hidden_layers
ATTN = r"self_attn\.(q_a_proj|q_a_layernorm|q_b_proj|kv_a_proj_with_mqa|kv_a_layernorm|kv_b_proj|o_proj)\.weight"
INDEXER = r"self_attn\.indexer\.(wq_b\.weight|wk\.weight|k_norm\.weight|k_norm\.bias|weights_proj\.weight)"
DENSE = r"mlp\.(gate_proj|up_proj|down_proj)\.weight"
MOE = (r"mlp\.(gate\.weight|gate\.e_score_correction_bias|shared_experts\.(gate|up|down)_proj\.weight|"
       r"experts\.\d+\.(gate|up|down)_proj\.weight)")
LAYER = rf"(input_layernorm\.weight|post_attention_layernorm\.weight|{ATTN}|{INDEXER}|{DENSE}|{MOE})"
MTP_EXTRA = r"(enorm\.weight|hnorm\.weight|eh_proj\.weight|shared_head\.norm\.weight)"


@pytest.fixture(scope="module")
def model():
    return build_random(CFG, seed=5).eval()


def ids_of(b, s, seed=0, vocab=CFG.vocab_size):
    return torch.randint(0, vocab, (b, s), generator=torch.Generator().manual_seed(seed))


def test_sharded_save_has_glm52_names_and_transformers_loads_it(model, tmp_path):
    from transformers import GlmMoeDsaForCausalLM

    model.save_pretrained(tmp_path, max_shard_size="1MB")
    index = json.loads((tmp_path / INDEX_FILE).read_text())
    names = set(index["weight_map"])
    assert len(set(index["weight_map"].values())) > 3 and all((tmp_path / f).exists()
                                                              for f in index["weight_map"].values())
    for name in names:
        assert re.fullmatch(rf"model\.embed_tokens\.weight|model\.norm\.weight|lm_head\.weight|"
                            rf"model\.layers\.\d+\.{LAYER}|model\.layers\.{N}\.{MTP_EXTRA}", name), name
    for i in range(N + 1):
        has_indexer = any(n.startswith(f"model.layers.{i}.self_attn.indexer.") for n in names)
        assert has_indexer == (i == N or CFG.indexer_types[i] == "full"), i  # shared layers carry no indexer
        assert any(n.startswith(f"model.layers.{i}.mlp.experts.") for n in names) == (i == N or i >= 2)
    hf, info = GlmMoeDsaForCausalLM.from_pretrained(tmp_path, dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["mismatched_keys"]
    assert info["unexpected_keys"] and all(k.startswith(f"model.layers.{N}.") for k in info["unexpected_keys"])
    ids = ids_of(2, 40)
    with torch.no_grad():
        assert (hf.eval()(input_ids=ids).logits - model(input_ids=ids).logits).abs().max() < 1e-4


def test_transformers_checkpoint_loads_into_ours(tmp_path, caplog):
    from transformers import GlmMoeDsaConfig, GlmMoeDsaForCausalLM

    torch.manual_seed(0)
    hf = GlmMoeDsaForCausalLM(GlmMoeDsaConfig(**CFG.to_hf())).eval()
    randomise_for_testing(hf, seed=1)
    hf.save_pretrained(tmp_path)
    with caplog.at_level(logging.WARNING):
        ours = load_hf(tmp_path).eval()  # strict: only the MTP layer (transformers drops it) may be missing
    assert "no MTP layer" in caplog.text
    ids = ids_of(2, 40, seed=1)
    with torch.no_grad():
        assert (hf(input_ids=ids).logits - ours(input_ids=ids).logits).abs().max() < 1e-4
    assert torch.all(ours.model.layers[N].enorm.weight == 1)  # the fresh MTP layer is initialised, not empty


def test_round_trip_is_exact_and_bf16_keeps_the_router_bias_fp32(model, tmp_path):
    state = {k: v.clone() for k, v in model.named_parameters()}
    model.save_pretrained(tmp_path / "fp32", state_dict=state, safe_serialization=True)  # DeepSpeedWorker's call
    again = load_hf(tmp_path / "fp32")
    assert again.state_dict().keys() == model.state_dict().keys()
    assert all(torch.equal(a, b) for a, b in zip(again.state_dict().values(), model.state_dict().values()))
    load_hf(tmp_path / "fp32", dtype="bfloat16").save_pretrained(tmp_path / "bf16")
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["dtype"] == "bfloat16"
    from safetensors import safe_open

    with safe_open(str(tmp_path / "bf16" / "model.safetensors"), framework="pt") as f:
        assert f.get_tensor("model.layers.2.mlp.gate.e_score_correction_bias").dtype == torch.float32
        assert f.get_tensor("model.layers.2.mlp.gate.weight").dtype == torch.bfloat16


def test_critic_checkpoints(model, tmp_path):
    model.save_pretrained(tmp_path / "policy")
    critic = load_hf(tmp_path / "policy", role="value")  # lm_head and MTP dropped, fresh zero head
    assert isinstance(critic, Glm5ForValue) and torch.all(critic.score.weight == 0)
    kv_b = "model.layers.3.self_attn.kv_b_proj.weight"
    assert torch.equal(critic.state_dict()[kv_b], model.state_dict()[kv_b])
    with torch.no_grad():
        critic.score.weight.normal_()
        critic.score.bias.fill_(0.5)
    critic.save_pretrained(tmp_path / "critic")
    assert json.loads((tmp_path / "critic" / "config.json").read_text())["architectures"] == [
        "GlmMoeDsaForTokenClassification"]
    again = load_model(str(tmp_path / "critic"), role="value")
    assert torch.equal(again.score.weight, critic.score.weight) and torch.equal(again.score.bias, critic.score.bias)
    with pytest.raises(ValueError, match="critic checkpoint"):
        load_hf(tmp_path / "critic", role="policy")


def test_block_fp8_checkpoint_is_dequantised(model, tmp_path):
    from safetensors.torch import load_file, save_file

    model.save_pretrained(tmp_path)
    state = load_file(str(tmp_path / "model.safetensors"))
    name = "model.layers.3.self_attn.q_b_proj.weight"  # [256, 128]: 2 × 1 blocks of 128 × 128
    w = state[name]
    blocks = w.view(2, 128, 1, 128).abs().amax(dim=(1, 3)) / 448.0  # e4m3 max
    scale = blocks.repeat_interleave(128, 0).repeat_interleave(128, 1)
    state[name] = (w / scale).to(torch.float8_e4m3fn)
    state[name + "_scale_inv"] = blocks
    save_file(state, str(tmp_path / "model.safetensors"))
    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}
    (tmp_path / "config.json").write_text(json.dumps(config))
    loaded = load_hf(tmp_path)
    expected = state[name].float() * scale
    assert torch.equal(loaded.model.layers[3].self_attn.q_b_proj.weight, expected)
    assert (expected - w).abs().max() <= w.abs().max() / 8  # e4m3 keeps 3 mantissa bits


def test_load_model_routes_glm_folders_and_the_builtin(model, tmp_path):
    model.save_pretrained(tmp_path)
    assert isinstance(load_model(str(tmp_path)), Glm5ForCausalLM)
    assert isinstance(load_model(str(tmp_path), role="value"), Glm5ForValue)
    path = resolve_model_path("glm52-tiny")
    config = Glm5Config.from_hf(path)
    assert config.vocab_size == len(load_tokenizer("glm52-tiny")) and config.indexer_types == CFG.indexer_types
    policy = load_model("glm52-tiny")
    assert isinstance(policy, Glm5ForCausalLM) and policy.config.use_cache is False
    assert not torch.equal(load_model("glm52-tiny:1").lm_head.weight, policy.lm_head.weight)
    ids = ids_of(1, 24, vocab=config.vocab_size)
    lp, _ = policy_logprobs(policy, ids, torch.ones_like(ids))
    assert lp.shape == ids.shape and torch.isfinite(lp).all()


def test_local_engine_serves_glm52_tiny():
    """The rollout engine (left padding, DynamicCache, logits_to_keep=1) returns the logprobs of a full forward,
    prompts shorter and longer than top-k (16)."""
    from rollout.local_engine import LocalEngine
    from rollout.types import SamplingParams

    engine = LocalEngine.from_pretrained("glm52-tiny", max_batch_size=4)
    try:
        prompts = [[1, 2, 3, 4, 5], list(range(100, 130)), [7, 8]]

        async def go():
            return await asyncio.gather(*[engine.generate(p, SamplingParams(temperature=0.8, max_new_tokens=8,
                                                                               seed=i))
                                          for i, p in enumerate(prompts)])
        results = asyncio.run(go())
    finally:
        engine.close()
    reference = load_model("glm52-tiny").eval()
    for prompt, res in zip(prompts, results):
        assert len(res.output_ids) == 8
        ids = torch.tensor([prompt + res.output_ids])
        with torch.no_grad():
            logits = reference(input_ids=ids).logits[0] / 0.8
        ref = torch.log_softmax(logits, -1)[len(prompt) - 1:-1].gather(-1, torch.tensor(res.output_ids)[:, None])
        assert torch.allclose(torch.tensor(res.output_logprobs), ref[:, 0], atol=1e-4)


def test_a_sharded_load_reads_only_the_ranks_routed_experts(monkeypatch):
    """expert_shard=(r, E): the experts of expert-parallel rank r are read and equal a full load; no other
    routed expert is read from the files or allocated (what lets a GLM-5.2 rank load at all)."""
    import safetensors

    from models.glm5.checkpoint import AbsentExpert

    full = load_model("glm52-tiny")
    read = []
    real_open = safetensors.safe_open

    class Spy:
        def __init__(self, *args, **kwargs):
            self.handle = real_open(*args, **kwargs)

        def __enter__(self):
            self.handle.__enter__()
            return self

        def __exit__(self, *exc):
            return self.handle.__exit__(*exc)

        def get_tensor(self, name):
            read.append(name)
            return self.handle.get_tensor(name)

        def __getattr__(self, attr):  # keys(), metadata(): the index, not the tensors
            return getattr(self.handle, attr)

    monkeypatch.setattr(safetensors, "safe_open", Spy)
    part = load_model("glm52-tiny", expert_shard=(1, 4))  # glm52-tiny: 8 routed experts a layer → 2 and 3
    experts = {int(m.group(1)) for name in read if (m := re.search(r"\.experts\.(\d+)\.", name))}
    assert experts == {2, 3} and read
    whole, kept = full.state_dict(), part.state_dict()
    assert all(torch.equal(whole[k], v) for k, v in kept.items())
    assert set(whole) - set(kept) == {k for k in whole if (m := re.search(r"\.experts\.(\d+)\.", k))
                                      and int(m.group(1)) not in (2, 3)}
    layer = part.model.layers[2].mlp.experts
    assert [isinstance(e, AbsentExpert) for e in layer] == [i not in (2, 3) for i in range(8)]
    assert not list(layer[0].parameters())
    with pytest.raises(ValueError, match="cannot be split 3 ways"):
        load_model("glm52-tiny", expert_shard=(0, 3))
