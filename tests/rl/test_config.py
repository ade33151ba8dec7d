import subprocess
import sys
import time
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf

from rl.config import Config, register_configs

CONFIGS = str(Path(__file__).resolve().parents[2] / "configs")


def composed(*overrides) -> Config:
    register_configs()
    with initialize_config_dir(config_dir=CONFIGS, version_base=None):
        return OmegaConf.to_object(compose(config_name="config", overrides=list(overrides)))


@pytest.mark.parametrize("experiment", ["coding_ppo", "coding_ppo_tiny"])
def test_experiments_compose(experiment):
    cfg = composed(f"+experiment={experiment}")
    assert isinstance(cfg, Config) and cfg.run_name == experiment
    cfg.agent.validate()


@pytest.mark.parametrize("experiment,gpus", [("coding_ppo_gpu", 1), ("coding_ppo_gpu_sglang", 1),
                                             ("coding_ppo_2gpu_disaggregated", 2), ("long_horizon_gpu", 1),
                                             ("long_horizon_gen_gpu", 1), ("long_horizon_gen_split_gpu", 1)])
def test_gpu_experiments_fit_the_gpus_their_docs_promise(experiment, gpus, monkeypatch):
    """README's GPU commands as written: each experiment's placement fits its machine and not a smaller one."""
    import torch

    from rl.config import validate

    cfg = composed(f"+experiment={experiment}")
    assert cfg.run_name == experiment
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    validate(cfg)
    if gpus > 1:
        monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus - 1)
        with pytest.raises(ValueError, match="asks for"):
            validate(cfg)


def test_one_gpu_sglang_layout():
    cfg = composed("+experiment=coding_ppo_gpu_sglang")
    assert cfg.engine.type == "sglang" and cfg.engine.gpus_per_worker == 0
    assert cfg.engine.sglang.gpus_per_server + cfg.trainer.actor_gpus + cfg.trainer.critic_gpus <= 1.0
    assert cfg.engine.sglang.weight_sync == "tensor"  # same GPU as the actor: CUDA IPC


def test_overrides_are_typed():
    cfg = composed("+experiment=coding_ppo", "trainer.learning_rate=3e-6", "agent.compaction.max_compactions=5")
    assert cfg.trainer.learning_rate == 3e-6 and cfg.agent.compaction.max_compactions == 5


@pytest.mark.parametrize("override,key", [("trainer.lerning_rate=1", "lerning_rate"),
                                          ("trainer.steps=many", "steps"),
                                          ("agent.compaction.resrve=3", "resrve")])
def test_bad_keys_fail_naming_the_key(override, key):
    with pytest.raises(ConfigCompositionException) as err:
        composed("+experiment=coding_ppo", override)
    assert key in str(err.value) + str(err.value.__cause__)


def test_cli_fails_fast_on_a_typo():
    started = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "rl.train", "+experiment=coding_ppo", "trainer.lerning_rate=1"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "lerning_rate" in proc.stderr + proc.stdout
    assert time.perf_counter() - started < 120


def test_semantic_validation():
    from rl.config import validate

    validate(composed("+experiment=coding_ppo"))
    cfg = composed("+experiment=coding_ppo", "agent.compaction.reserve=10", "algorithm.kl_estimator=k7",
                   "algorithm.dual_clip=0.5", "env.reward=vibes", "trainer.eval_samples=4",
                   "trainer.time_limit_action=pause", "trainer.driver_torch_threads=-1")
    with pytest.raises(ValueError) as err:
        validate(cfg)
    for key in ("reserve", "algorithm.kl_estimator", "algorithm.dual_clip", "env.reward", "trainer.eval_samples",
                "trainer.time_limit_action", "trainer.driver_torch_threads"):
        assert key in str(err.value)
    validate(composed("+experiment=coding_ppo", "algorithm.reference_every=4"))  # KL only logged: fine
    for bad, why in (("algorithm.reference_every=0", "must be >= 1"), ("algorithm.kl_loss_coef=0.01",
                                                                      "the penalty needs π_ref on every step")):
        with pytest.raises(ValueError, match=why):
            validate(composed("+experiment=coding_ppo", "algorithm.reference_every=4", bad))
    with pytest.raises(ValueError, match="cannot have two members on one GPU"):  # NCCL refuses a shared GPU
        validate(composed("+experiment=coding_ppo_2gpu_disaggregated", "engine.sglang.num_servers=2",
                          "engine.sglang.gpus_per_server=0.5"))
    # indexer replay is the LocalEngine's: refused for SGLang before anything starts
    validate(composed("+experiment=coding_ppo_tiny", "model=glm52_tiny", "engine.indexer_replay_margin=1e-4"))
    with pytest.raises(ValueError, match="engine.indexer_replay_margin"):
        validate(composed("+experiment=coding_ppo_tiny", "model=glm52_tiny", "engine.type=sglang",
                          "engine.indexer_replay_margin=1e-4"))


def test_expert_and_sequence_parallel_are_validated():
    from rl.config import validate

    ok = ("+experiment=coding_ppo", "trainer.actor_ranks=4", "trainer.zero_stage=2")
    validate(composed(*ok, "trainer.expert_parallel=2"))
    with pytest.raises(ValueError, match="trainer.expert_parallel=3 must divide trainer.actor_ranks=4"):
        validate(composed(*ok, "trainer.expert_parallel=3"))
    with pytest.raises(ValueError, match="trainer.critic_expert_parallel=2 must divide trainer.critic_ranks=1"):
        validate(composed(*ok, "trainer.critic_expert_parallel=2"))
    with pytest.raises(ValueError, match="needs trainer.zero_stage 1 or 2"):
        validate(composed(*ok[:2], "trainer.zero_stage=3", "trainer.expert_parallel=2"))
    validate(composed(*ok, "trainer.critic_ranks=2", "trainer.sequence_parallel=2", "trainer.expert_parallel=2"))
    with pytest.raises(ValueError, match="trainer.sequence_parallel=2 must divide trainer.critic_ranks=1"):
        validate(composed(*ok, "trainer.sequence_parallel=2"))


def test_ppo_step_counts_are_validated():
    from rl.config import validate

    with pytest.raises(ValueError, match="ppo_epochs and algorithm.mini_batches must be >= 1"):
        validate(composed("+experiment=coding_ppo", "algorithm.mini_batches=0"))
    validate(composed("+experiment=coding_ppo", "algorithm.ppo_epochs=2", "algorithm.mini_batches=4"))


def test_the_models_overlap_only_on_gpus_of_their_own():
    from rl.config import TrainerConfig, overlaps_models

    assert not overlaps_models(TrainerConfig())  # the CPU: one set of cores
    assert not overlaps_models(TrainerConfig(actor_gpus=0.4, critic_gpus=0.3))  # one GPU shared: peaks add up
    assert overlaps_models(TrainerConfig(actor_gpus=1, critic_gpus=1))
    assert overlaps_models(TrainerConfig(overlap_models="on")) and not overlaps_models(
        TrainerConfig(actor_gpus=1, critic_gpus=1, overlap_models="off"))


def test_long_horizon_advantages_credit_a_solved_episode_from_its_start():
    """The long-horizon experiments' λ_policy with the critic still at zero (a run's first step): whitened over the
    batch, the advantages must push a solved episode's early actions up, not down as a failed episode's. At
    λ = 0.95 over 300-900 action tokens they pushed both down alike (docs/RESULTS.md, 2026-12-04)."""
    import torch

    from rl.batch import compute_gae, masked_whiten

    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(300, 900, (64,), generator=g)
    solved = torch.rand(64, generator=g) < 0.6
    mask = torch.arange(int(lengths.max()))[None, :] < lengths[:, None]
    rewards = torch.zeros(mask.shape, dtype=torch.float64)
    rewards[torch.arange(64), lengths - 1] = solved.double()
    early = mask & (torch.arange(mask.shape[1])[None, :] < lengths[:, None] // 2)
    for experiment in ("long_horizon_gpu", "long_horizon_gen_gpu", "long_horizon_gen_split_gpu"):
        algo = composed(f"+experiment={experiment}").algorithm
        assert algo.lam_policy < 1  # else the chained/per-segment ablation compares two equal things
        adv, _ = compute_gae(rewards, torch.zeros_like(rewards), mask, algo.gamma, algo.lam_policy)
        adv = masked_whiten(adv, mask.double())
        assert float(adv[early & solved[:, None]].mean()) > 0 > float(adv[early & ~solved[:, None]].mean())
        assert float((adv[mask & solved[:, None]] < 0).double().mean()) < 0.5


@pytest.mark.parametrize("gpus", [2, 4, 8])
def test_the_multi_gpu_launchers_asynchronous_layout_is_a_valid_run(gpus, monkeypatch):
    """launch/gpu/multi_gpu.sh's `async` phase runs on a kind with several GPUs that these tests never see: the
    overrides its plan prints for 2, 4 and 8 GPUs must make valid configs at K = 0 and 1 (the placement fits the
    GPUs, the SGLang pause mode allows partial rollouts, every server on a GPU of its own for NCCL), or the rare
    session that has those GPUs is lost to it."""
    from rl.config import validate

    root = Path(CONFIGS).parent
    plan = subprocess.run(["bash", "launch/gpu/multi_gpu.sh", "plan"], cwd=root, capture_output=True, text=True,
                          env={"GPUS": str(gpus), "PATH": "/usr/bin:/bin"}, check=True).stdout
    overrides = plan.split(" async ", 1)[1].split()
    assert "engine.sglang.weight_sync=distributed" in overrides
    monkeypatch.setattr("torch.cuda.device_count", lambda: gpus)
    for k in (0, 1):
        cfg = composed("+experiment=coding_ppo_2gpu_disaggregated", f"trainer.max_staleness={k}", *overrides)
        validate(cfg)  # among its checks: no two members of the NCCL broadcast on one GPU
        assert cfg.engine.sglang.num_servers >= (2 if gpus >= 4 else 1) and cfg.engine.sglang.gpus_per_server >= 1
        assert cfg.trainer.actor_ranks > 1 or gpus < 8  # the broadcast from a sharded actor, where the GPUs allow
        placed = (cfg.trainer.actor_gpus * cfg.trainer.actor_ranks + cfg.trainer.critic_gpus * cfg.trainer.critic_ranks
                  + cfg.engine.sglang.gpus_per_server * cfg.engine.sglang.num_servers)
        assert placed <= gpus
    monkeypatch.setattr("torch.cuda.device_count", lambda: gpus - 1)
    with pytest.raises(ValueError, match="placement asks for"):  # the check above can fail
        validate(composed("+experiment=coding_ppo_2gpu_disaggregated", *overrides))
