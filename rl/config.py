"""The run's configuration: one dataclass per component, composed by Hydra (configs/) into `Config`.

The dataclasses are registered as the schema of configs/config.yaml, so a misspelt or ill-typed key fails when
Hydra composes the config, before anything starts, with a message that names the key.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from hydra.core.config_store import ConfigStore

from antihack.config import GuardConfig, JudgeConfig
from environments.config import EnvConfig
from environments.sandbox import SandboxLimits
from rollout.config import AgentConfig, CompactionConfig, EngineConfig


@dataclass
class ModelConfig:
    name: str = "smollm2-135m-instruct"  # built-in name or an HF-format folder
    critic: Optional[str] = None  # critic initialisation; default: the policy's backbone with a new value head
    dtype: str = "float32"
    chat_format: str = "chatml"  # chatml | glm
    tool_format: str = "json"  # json | glm
    # GLM-5.x config fields the trainer's policy (and reference) load with, e.g. {indexer_fp8: true}: score the
    # indexer as SGLang does, so that its top-k matches the engine's (docs/BENCHMARKS.md, indexer consistency)
    trainer_overrides: dict = field(default_factory=dict)


@dataclass
class AlgorithmConfig:
    name: str = "ppo"
    gamma: float = 1.0
    lam_critic: float = 1.0  # λ for value targets (decoupled GAE, §1.4.2)
    lam_policy: float = 1.0  # λ for advantages, unless lam_alpha > 0
    lam_alpha: float = 0.0  # > 0: length-adaptive λ_policy = 1 − 1/(α·ℓ)
    # GAE over a trajectory's segments as one chain (values carried across compaction boundaries, §2.6); false:
    # each segment is an episode of its own that ends with the trajectory's reward (the ablation baseline)
    chain_segments: bool = True
    clip_low: float = 0.2
    clip_high: float = 0.28
    dual_clip: float = 3.0  # 0: off
    value_clip: float = 0.2  # 0: off
    normalize_advantages: bool = True
    kl_coef: float = 0.0  # KL to the reference in the reward
    kl_loss_coef: float = 0.0  # KL to the reference in the loss
    kl_estimator: str = "k3"  # k1 | k2 | k3
    use_reference: bool = True  # keep a frozen reference to log (and optionally penalise) KL
    # π_ref's logprob pass on every N-th step only (steps 1, N+1, ...). With no KL penalty the reference serves
    # only the logged KL (`actor/kl_ref`), and its pass is a fifth of the trainer's step on one GPU (BENCHMARKS).
    reference_every: int = 1
    entropy_coef: float = 0.0
    tis_low: float = 0.5  # truncated importance weights π_old/μ, clamped to [tis_low, tis_high]
    tis_high: float = 2.0
    mask_low: float = 0.2  # tokens with π_old/μ outside [mask_low, mask_high] get no gradient
    mask_high: float = 5.0
    veto: float = 1e-4  # a segment with any π_old/μ below this is dropped
    critic_warmup_steps: int = 0  # first steps train only the critic
    # PPO's optimiser steps per rollout batch: epochs passes, each split into mini_batches random groups (one step
    # each, token-mean within the group). 1 and 1: one step over the whole batch. More than one step recomputes
    # π_old before the update, so the ratio, the clip and the value clip act from the second step on.
    ppo_epochs: int = 1
    mini_batches: int = 1

    @property
    def kl_penalty(self) -> bool:
        """KL to the reference in the reward or the loss (either needs π_ref's logprobs on every step)."""
        return self.kl_coef > 0 or self.kl_loss_coef > 0

    def problems(self, prefix: str = "algorithm") -> list[str]:
        """What is wrong with these settings alone, each with its key (empty: nothing)."""
        out = [f"{prefix}.{key}={value!r}: must be one of {list(allowed)}" for key, value, allowed in (
            ("name", self.name, ("ppo",)), ("kl_estimator", self.kl_estimator, ("k1", "k2", "k3")))
            if value not in allowed]
        if self.dual_clip and self.dual_clip <= 1:
            out.append(f"{prefix}.dual_clip={self.dual_clip}: must be > 1 (or 0 to turn it off)")
        if not (0 <= self.gamma <= 1 and 0 <= self.lam_critic <= 1 and 0 <= self.lam_policy <= 1):
            out.append(f"{prefix}.gamma, lam_critic and lam_policy must lie in [0, 1]")
        if self.ppo_epochs < 1 or self.mini_batches < 1:
            out.append(f"{prefix}.ppo_epochs and {prefix}.mini_batches must be >= 1")
        if self.reference_every < 1:
            out.append(f"{prefix}.reference_every={self.reference_every}: must be >= 1")
        elif self.reference_every > 1 and self.kl_penalty:
            out.append(f"{prefix}.reference_every={self.reference_every} with a KL penalty ({prefix}.kl_coef or "
                       "kl_loss_coef > 0): the penalty needs π_ref on every step")
        if self.tis_low > self.tis_high:
            out.append(f"{prefix}.tis_low must be <= {prefix}.tis_high")
        return out


@dataclass
class TrainerConfig:
    steps: int = 4
    episodes_per_step: int = 8
    # K: how many weight versions a trained token may lag the policy being trained (rl/rollout_manager.py).
    # 0: the synchronous loop (nothing runs while the trainer trains); K > 0: episodes run through the steps,
    # continuing on new weights (partial rollouts), up to (K + 1) batches ahead of the trainer
    max_staleness: int = 0
    learning_rate: float = 1e-6
    critic_learning_rate: float = 1e-5
    # The critic's value head (fresh, zero) at its own step size; 0: critic_learning_rate. See
    # models/deepspeed_worker.py optimizer_groups: at 1e-5 the values trail the returns for a hundred steps.
    critic_head_learning_rate: float = 0.0
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    zero_stage: int = 0
    micro_batch_tokens: int = 4096  # positions per forward/backward (rows x width)
    gradient_checkpointing: bool = False
    tf32: bool = False  # a GPU trainer's fp32 matmuls on TF32 tensor cores (models/deepspeed_worker.py OptimConfig)
    # forward passes under bf16 autocast, weights and optimizer in model.dtype (OptimConfig.bf16_autocast)
    bf16_autocast: bool = False
    # Rows holding several samples end to end (as wide as the micro-batch's longest sample) where the model
    # supports it (transformers' models, GLM-5.2); false: one right-padded sample a row for every model
    pack_micro_batches: bool = True
    offload_optimizer: bool = False  # ZeRO >= 1: Adam's state and the fp32 master weights in host memory
    offload_params: bool = False  # ZeRO-3: the parameter shards in host memory between uses
    eval_every: int = 0  # 0: only before the first and after the last step
    eval_at_start: bool = True
    eval_max_tasks: int = 0  # 0: the whole held-out split
    eval_samples: int = 1  # episodes per held-out task; > 1 (with engine.eval_temperature > 0) averages pass@1
    save_every: int = 1
    keep_checkpoints: int = 2
    # resume=true from a checkpoint whose optimizer state (actor/state, critic/state) is gone, e.g. dropped to carry
    # it between machines: the models start from its HF weights with fresh Adam moments (the reference stays
    # model.name). Off: such a checkpoint is refused, since the resume would not be exact.
    resume_weights_only: bool = False
    weight_sync_bucket_mb: int = 64
    verify_weight_sync: bool = False  # compare every engine's weights with the trainer's after each sync
    torch_threads: int = 0  # 0: every core
    # The driver process's own torch work (batching, GAE, metrics) is thousands of ops on small tensors; with an
    # OpenMP thread per core on a host whose cores the engine, the sandboxes and the workers keep busy, each op waits
    # on threads that are not scheduled (bench/driver_threads.py). 0: every core.
    driver_torch_threads: int = 1
    time_limit_s: float = 0.0  # > 0: end the run before a step that would end past it
    # stop: checkpoint and stop (resume=true goes on); finish: make the last step that fits the final one (its
    # final evaluation included), for a run that must end complete within one job slot
    time_limit_action: str = "stop"
    actor_gpus: float = 0.0  # Ray GPU share of each actor rank (0: CPU); fractions colocate workers on one GPU
    critic_gpus: float = 0.0  # the same for each critic rank
    # Data-parallel ranks per model (rl/group.py): one DeepSpeed world of that many Ray actors, the step's samples
    # split across them by tokens; ZeRO (zero_stage) shards over them. The reference lives on the actor's ranks.
    actor_ranks: int = 1
    critic_ranks: int = 1
    # Expert parallelism (models/glm5/expert_parallel.py) for a GLM-5.2-style MoE model: the ranks split into
    # groups of E, each rank holding 1/E of every MoE layer's routed experts (E divides the ranks and the expert
    # count; ZeRO-1/2 partitions the rest over all ranks and the experts within the ranks holding the same ones)
    expert_parallel: int = 1  # the actor's (and its reference's)
    critic_expert_parallel: int = 1
    # Sequence parallelism (models/glm5/sequence_parallel.py) for long trajectories, GLM-5.2 models: groups of S
    # ranks of each model take the same samples, each rank a chunk of the positions (S divides both rank counts)
    sequence_parallel: int = 1
    # The actor's and the critic's passes and updates at the same time: auto = when each rank of both has a GPU
    # of its own (sharing a GPU, their peaks add up: measured out of memory on one H200 beside SGLang; on the
    # CPU they share the cores and gain nothing) | on | off
    overlap_models: str = "auto"
    ray_address: Optional[str] = None  # None: start a local Ray


    def problems(self, prefix: str = "trainer") -> list[str]:
        """What is wrong with these settings alone, each with its key (empty: nothing)."""
        out = [f"{prefix}.{key}={value!r}: must be one of {list(allowed)}" for key, value, allowed in (
            ("time_limit_action", self.time_limit_action, ("stop", "finish")),
            ("overlap_models", self.overlap_models, ("auto", "on", "off")),
            ("zero_stage", self.zero_stage, (0, 1, 2, 3))) if value not in allowed]
        if self.offload_optimizer and self.zero_stage < 1:
            out.append(f"{prefix}.offload_optimizer needs {prefix}.zero_stage >= 1 (ZeRO partitions what it offloads)")
        if self.offload_params and self.zero_stage != 3:
            out.append(f"{prefix}.offload_params needs {prefix}.zero_stage=3 (only ZeRO-3 partitions parameters)")
        for key, ep, ranks_key, ranks in (("expert_parallel", self.expert_parallel, "actor_ranks", self.actor_ranks),
                                          ("critic_expert_parallel", self.critic_expert_parallel, "critic_ranks",
                                           self.critic_ranks)):
            if ep < 1 or ranks % ep:
                out.append(f"{prefix}.{key}={ep} must divide {prefix}.{ranks_key}={ranks}")
            elif ep > 1 and self.zero_stage not in (1, 2):
                out.append(f"{prefix}.{key}={ep} needs {prefix}.zero_stage 1 or 2 (DeepSpeed partitions expert "
                           "weights within their groups under ZeRO-1/2 only)")
        for ranks_key, ranks in (("actor_ranks", self.actor_ranks), ("critic_ranks", self.critic_ranks)):
            if self.sequence_parallel < 1 or ranks % self.sequence_parallel:
                out.append(f"{prefix}.sequence_parallel={self.sequence_parallel} must divide "
                           f"{prefix}.{ranks_key}={ranks}")
        if self.max_staleness < 0:
            out.append(f"{prefix}.max_staleness={self.max_staleness}: must be >= 0 (0: synchronous)")
        for key in ("learning_rate", "critic_learning_rate", "critic_head_learning_rate"):
            if getattr(self, key) < 0:
                out.append(f"{prefix}.{key}={getattr(self, key)}: must be >= 0")
        if self.driver_torch_threads < 0:
            out.append(f"{prefix}.driver_torch_threads={self.driver_torch_threads}: must be >= 0 (0: every core)")
        for key in ("steps", "episodes_per_step", "micro_batch_tokens", "eval_samples"):
            if getattr(self, key) < 1:
                out.append(f"{prefix}.{key} must be >= 1")
        for role in ("actor", "critic"):
            ranks, share = getattr(self, f"{role}_ranks"), getattr(self, f"{role}_gpus")
            if ranks < 1:
                out.append(f"{prefix}.{role}_ranks must be >= 1")
            elif ranks > 1 and 0 < share < 1:
                out.append(f"{prefix}.{role}_ranks={ranks} with {prefix}.{role}_gpus={share:g}: NCCL refuses two "
                           "ranks of one world on one GPU; give each rank a whole GPU (or train on the CPU)")
        return out


@dataclass
class LoggingConfig:
    wandb_mode: str = "offline"  # offline | online | disabled
    project: str = "agentic-rl"
    plot: bool = True
    # every N-th finished episode of each mode (train / eval) on each rollout worker, decoded, to
    # <run dir>/episodes/worker<i>.jsonl (what the policy wrote, for reading); 0: none
    episode_log_every: int = 16


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    env: EnvConfig = field(default_factory=EnvConfig)
    guard: GuardConfig = field(default_factory=GuardConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    agent: AgentConfig = field(default_factory=AgentConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    run_name: str = "coding_ppo"
    output_dir: str = "outputs"
    seed: int = 0
    resume: bool = False


def register_configs() -> None:
    cs = ConfigStore.instance()
    cs.store(name="config_schema", node=Config)


__all__ = ["Config", "ModelConfig", "EngineConfig", "EnvConfig", "SandboxLimits", "GuardConfig",
           "JudgeConfig", "AlgorithmConfig", "TrainerConfig", "AgentConfig", "CompactionConfig", "LoggingConfig",
           "register_configs"]


def overlaps_models(t: TrainerConfig) -> bool:
    """Whether the actor's and the critic's work of a step run at the same time (trainer.overlap_models)."""
    if t.overlap_models == "auto":
        return t.actor_gpus >= 1 and t.critic_gpus >= 1
    return t.overlap_models == "on"


def validate(cfg: Config) -> None:
    """Checks the schema cannot express, before anything is started: each component's own (its `problems()`), then
    what spans components (staleness and the engine's pause mode, evaluation samples and temperature, the GPU
    placement). Raises one error listing every problem, each with its key."""
    problems = cfg.engine.problems() + cfg.env.problems() + cfg.guard.problems() + cfg.algorithm.problems()
    problems += cfg.trainer.problems()
    for key, value, allowed in (("model.chat_format", cfg.model.chat_format, ("chatml", "glm")),
                                ("model.tool_format", cfg.model.tool_format, ("json", "glm")),
                                ("logging.wandb_mode", cfg.logging.wandb_mode, ("offline", "online", "disabled"))):
        if value not in allowed:
            problems.append(f"{key}={value!r}: must be one of {list(allowed)}")
    sg = cfg.engine.sglang
    if cfg.trainer.max_staleness > 0 and cfg.engine.type == "sglang" and sg.pause_mode != "abort":
        problems.append(f"trainer.max_staleness > 0 with engine.sglang.pause_mode={sg.pause_mode}: SGLang reports "
                        "only a request's final weight version, so the tokens sampled before the update would be "
                        "credited to the new one; pause_mode=abort continues them exactly (a partial rollout)")
    if cfg.trainer.bf16_autocast and cfg.model.dtype != "float32":
        problems.append(f"trainer.bf16_autocast with model.dtype={cfg.model.dtype}: autocast is for fp32 weights "
                        "(their forwards in bf16, their updates exact); these weights already compute in their dtype")
    if cfg.trainer.eval_samples > 1 and cfg.engine.eval_temperature <= 0:
        problems.append(f"trainer.eval_samples={cfg.trainer.eval_samples} needs engine.eval_temperature > 0 "
                        "(greedy samples of one task are the same episode)")
    gpus = {"trainer.actor_gpus": cfg.trainer.actor_gpus, "trainer.critic_gpus": cfg.trainer.critic_gpus,
            "engine.gpus_per_worker": cfg.engine.gpus_per_worker}
    for key, value in gpus.items():
        if value < 0 or (value > 1 and value != int(value)):
            problems.append(f"{key}={value}: a GPU count must be a fraction of one GPU or a whole number")
    if cfg.engine.type == "sglang" and not (sg.urls or sg.router_url):
        gpus["engine.sglang.gpus_per_server"] = sg.gpus_per_server
        if sg.weight_sync == "distributed" and 0 < sg.gpus_per_server < 1:
            problems.append(f"engine.sglang.weight_sync=distributed with engine.sglang.gpus_per_server="
                            f"{sg.gpus_per_server:g}: the broadcast's NCCL group (the actor's rank 0 and every "
                            "server) cannot have two members on one GPU, and a share of a GPU lets Ray put a server "
                            "beside another or beside the actor; give each server whole GPUs (or weight_sync=tensor "
                            "for servers on the actor's GPU)")
    if any(gpus.values()):
        import torch

        terms = {"trainer.actor_gpus x trainer.actor_ranks": cfg.trainer.actor_gpus * cfg.trainer.actor_ranks,
                 "trainer.critic_gpus x trainer.critic_ranks": cfg.trainer.critic_gpus * cfg.trainer.critic_ranks,
                 "engine.gpus_per_worker x engine.num_workers": cfg.engine.gpus_per_worker * cfg.engine.num_workers}
        if "engine.sglang.gpus_per_server" in gpus:
            terms["engine.sglang.gpus_per_server x engine.sglang.num_servers"] = sg.gpus_per_server * sg.num_servers
        wanted = sum(terms.values())
        have = torch.cuda.device_count() if not cfg.trainer.ray_address else wanted
        if wanted > have + 1e-9:
            parts = " + ".join(f"{key} {value:g}" for key, value in terms.items() if value)
            problems.append(f"the placement asks for {wanted:g} GPUs ({parts}) but this machine has {have}")
    try:
        cfg.agent.validate()
    except ValueError as exc:
        problems.append(str(exc))
    if problems:
        raise ValueError("invalid configuration:\n  " + "\n  ".join(problems))
