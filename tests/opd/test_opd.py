"""OPD pieces against hand-computed cases and real models: the advantage, routing checks, teacher scoring."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from opd.advantages import opd_advantages
from opd.config import DistillConfig, OPDConfig, TeacherConfig, validate_opd


def test_advantage_is_minus_lambda_times_the_clipped_reverse_kl():
    samples = [{"domain": "a", "loss_mask": [0, 1, 1, 1], "rollout_logprobs": [0.0, -1.0, -0.5, -3.0],
                "teacher_logprobs": [0.0, -2.0, -0.25, -0.5]},
               {"domain": "b", "loss_mask": [1, 0], "rollout_logprobs": [-0.1, 0.0], "teacher_logprobs": [-0.1, 9.0]}]
    m = opd_advantages(samples, kl_coef=0.5, kl_clip=2.0)
    # d̂ = μ − teacher: [1.0, -0.25, -2.5 → clipped to -2.0] and [0.0]
    assert samples[0]["advantages"].tolist() == [0.0, -0.5, 0.125, 1.0]
    assert samples[1]["advantages"].tolist() == [0.0, 0.0]
    assert m["opd/reverse_kl/a"] == pytest.approx((1.0 - 0.25 - 2.5) / 3)  # the unclipped estimate is logged
    assert m["opd/reverse_kl/b"] == 0.0 and m["opd/clipped_frac"] == pytest.approx(1 / 4) and m["opd/tokens"] == 4


def test_advantage_adds_to_ppo_advantages_in_ppo_opd():
    samples = [{"domain": "a", "loss_mask": [1, 1], "rollout_logprobs": [-1.0, -1.0],
                "teacher_logprobs": [-1.5, -0.5], "advantages": [0.3, 0.3]}]
    opd_advantages(samples, kl_coef=1.0, kl_clip=10.0, add_to_existing=True)
    assert samples[0]["advantages"].tolist() == pytest.approx([0.3 - 0.5, 0.3 + 0.5])


def _cfg(*teachers, mode="opd"):
    return DistillConfig(opd=OPDConfig(teachers=list(teachers), mode=mode))


def test_routing_needs_one_teacher_per_domain():
    owner = validate_opd(_cfg(TeacherConfig("f", "p", ["function"]), TeacherConfig("b", "q", ["bugfix"])),
                         {"function", "bugfix"})
    assert owner["function"].name == "f" and owner["bugfix"].name == "b"
    with pytest.raises(ValueError, match=r"task domains \['bugfix'\] have no teacher"):
        validate_opd(_cfg(TeacherConfig("f", "p", ["function"])), {"function", "bugfix"})
    with pytest.raises(ValueError, match="two teachers"):
        validate_opd(_cfg(TeacherConfig("f", "p", ["function"]), TeacherConfig("g", "q", ["function"])), {"function"})
    with pytest.raises(ValueError, match="needs name, path and domains"):
        validate_opd(_cfg(TeacherConfig("f", "", ["function"])), {"function"})
    with pytest.raises(ValueError, match="opd.mode"):
        validate_opd(_cfg(TeacherConfig("f", "p", ["function"]), mode="sft"), {"function"})


def test_a_teacher_with_another_tokenizer_is_refused(tiny_path, tmp_path):
    from transformers import AutoTokenizer

    from opd.teacher import check_same_tokenizer

    check_same_tokenizer(tiny_path, {"same": tiny_path})
    tok = AutoTokenizer.from_pretrained(tiny_path)
    tok.add_tokens(["<extra_teacher_token>"])
    other = tmp_path / "other"
    tok.save_pretrained(other)
    (other / "config.json").write_text((__import__("pathlib").Path(tiny_path) / "config.json").read_text())
    with pytest.raises(ValueError, match="different tokenizer"):
        check_same_tokenizer(tiny_path, {"odd": str(other)})


@pytest.mark.parametrize("engine", ["local", "sglang"])
def test_teacher_scores_equal_an_independent_forward(tiny_path, tmp_path, engine):
    """TeacherWorker = log-softmax of a plain transformers forward at temperature T: a local teacher (chunked,
    micro-batched) and an SGLang teacher, whose server (here tests/fakes/sglang_server.py, SGLang's HTTP shapes)
    answers prefill-only requests with input-token logprobs."""
    from transformers import AutoModelForCausalLM

    from opd.teacher import TeacherWorker

    fake = [sys.executable, str(Path(__file__).resolve().parents[1] / "fakes" / "sglang_server.py")]
    teacher = TeacherWorker("t", tiny_path, engine, temperature=0.7, micro_batch_tokens=64,
                            sglang={"launch_command": fake, "startup_timeout_s": 120}, log_dir=str(tmp_path))
    samples = [{"token_ids": list(range(5, 25)), "loss_mask": [0] * 8 + [1] * 12},
               {"token_ids": list(range(40, 47)), "loss_mask": [0, 0, 1, 1, 0, 1, 1]}]
    try:
        scores = teacher.score(samples)
    finally:
        teacher.shutdown()
    model = AutoModelForCausalLM.from_pretrained(tiny_path).eval()
    for s, got in zip(samples, scores):
        ids = torch.tensor([s["token_ids"]])
        with torch.no_grad():
            logp = torch.log_softmax(model(ids).logits[0, :-1].float() / 0.7, -1)
        want = [0.0] + logp.gather(-1, ids[0, 1:, None])[:, 0].tolist()
        for m, g, w in zip(s["loss_mask"], got, want):
            if m:
                assert g == pytest.approx(w, abs=1e-4)
    assert teacher.stats()["tokens"] == 12 + 4


def test_an_sglang_teacher_needs_temperature_one():
    """SGLang scores a prompt at T = 1 whatever the request says: an SGLang teacher under another rollout
    temperature is refused, a local one (which divides by T) is not."""
    cfg = _cfg(TeacherConfig("f", "p", ["function"], engine="sglang"))
    cfg.engine.temperature = 0.7
    with pytest.raises(ValueError, match="returns prompt logprobs at temperature 1"):
        validate_opd(cfg, {"function"})
    cfg.opd.teachers[0].engine = "local"
    assert validate_opd(cfg, {"function"})["function"].name == "f"
    cfg.opd.teachers[0].engine, cfg.engine.temperature = "sglang", 1.0
    assert validate_opd(cfg, {"function"})["function"].name == "f"


def test_an_sglang_teacher_captures_no_decode_graph():
    """A teacher only scores (prefill-only requests): its server gets --disable-decode-cuda-graph unless the run's
    args choose the graphs; the student's servers keep the batch their workers can fill."""
    from opd.distill import sglang_settings
    from rollout.config import EngineConfig, SGLangConfig

    engine = EngineConfig(type="sglang", max_concurrent_episodes=64, sglang=SGLangConfig(args={"tp": 1}))
    assert sglang_settings(engine.sglang)["args"] == {"tp": 1, "disable-decode-cuda-graph": True}
    assert engine.server_config().args == {"tp": 1, "cuda-graph-max-bs-decode": 72}
    chosen = SGLangConfig(args={"cuda_graph_bs": [1, 2]})
    assert sglang_settings(chosen)["args"] == {"cuda_graph_bs": [1, 2]}


def test_an_expert_is_the_policy_fine_tuned_on_its_domain(tmp_path):
    """python -m opd.experts: SFT on one domain's reference solutions; the result loads as a policy."""
    import json

    from environments.tasks import SHIPPED_TASKS
    from models import load_model
    from opd.experts import train_expert

    rows = [json.loads(line) for line in open(SHIPPED_TASKS)]
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text("".join(json.dumps(r) + "\n" for r in [r for r in rows if r["domain"] == "function"][:3]
                             + [r for r in rows if r["domain"] == "bugfix"][:1]))
    result = train_expert("tiny-random", "function", str(tmp_path / "expert"), epochs=3, lr=1e-3,
                          tasks_source=str(tasks), device="cpu")
    from environments import load_tasks

    with_solution = [t for t in load_tasks(str(tasks)).split("train") if t.domain == "function"
                     and any(f.path == t.entry_file for f in t.reference_solution)]
    assert result["examples"] == len(with_solution) > 0 and result["last_epoch_loss"] < result["first_loss"]
    assert load_model(str(tmp_path / "expert")) is not None
    with pytest.raises(SystemExit, match="no 'train' tasks of domain 'repo'"):
        train_expert("tiny-random", "repo", str(tmp_path / "none"), tasks_source=str(tasks), device="cpu")


def test_the_gpu_experiment_fits_one_gpu(monkeypatch):
    """opd_merge_gpu as docs/OPD.md runs it: a valid configuration on one GPU, SGLang teachers at T = 1, and the
    actor, the student's server and both teachers' servers within the GPU's share."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from opd.config import register_opd_configs
    from rl.config import validate

    register_opd_configs()
    configs = str(Path(__file__).resolve().parents[2] / "configs")
    with initialize_config_dir(config_dir=configs, version_base=None):
        cfg = OmegaConf.to_object(compose(config_name="opd", overrides=["+experiment=opd_merge_gpu"]))
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    validate(cfg)
    owner = validate_opd(cfg, {"function", "bugfix"})
    assert {t.engine for t in owner.values()} == {"sglang"} and cfg.engine.type == "sglang"
    shares = cfg.trainer.actor_gpus + cfg.engine.sglang.gpus_per_server + sum(t.gpus for t in cfg.opd.teachers)
    assert shares <= 1.0 and cfg.trainer.episodes_per_step >= 64 and cfg.trainer.eval_samples > 1
