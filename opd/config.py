"""Configuration of parallel on-policy distillation: the run config of rl.train plus an `opd` block."""

from __future__ import annotations

from dataclasses import dataclass, field

from hydra.core.config_store import ConfigStore

from rl.config import Config


@dataclass
class TeacherConfig:
    name: str = ""
    path: str = ""  # built-in model name, HF folder or training checkpoint
    domains: list[str] = field(default_factory=list)  # task domains it owns (docs/ALGORITHMS.md §3.3: one per domain)
    engine: str = "local"  # local: a torch scorer in its own Ray worker | sglang: its own SGLang server
    gpus: float = 0.0  # Ray GPUs of its worker


@dataclass
class OPDConfig:
    teachers: list[TeacherConfig] = field(default_factory=list)
    mode: str = "opd"  # opd: advantage = −λ·clip(d̂) (no critic) | ppo_opd: added to the critic-PPO advantages
    kl_coef: float = 1.0  # λ_opd
    kl_clip: float = 10.0  # d_max: |d̂| is clipped to it (the fraction clipped is logged)
    eval_teachers: bool = True  # held-out pass rate of every teacher once, at the start (the target)
    teacher_restarts: int = 3  # a teacher worker that dies is restarted by Ray this many times; its pending
    # scores are asked again of the restarted worker (none lost, none twice: opd.distill.collect_scores)


@dataclass
class DistillConfig(Config):
    opd: OPDConfig = field(default_factory=OPDConfig)
    run_name: str = "opd_merge"


def register_opd_configs() -> None:
    ConfigStore.instance().store(name="opd_schema", node=DistillConfig)


def validate_opd(cfg: DistillConfig, task_domains: set[str]) -> dict[str, TeacherConfig]:
    """domain → teacher. Every teacher has a name, a path and domains; no domain has two teachers; every domain
    of the task mixture has one (a task nobody can score would be trained on noise)."""
    problems, owner = [], {}
    if not cfg.opd.teachers:
        problems.append("opd.teachers is empty: give a list of {name, path, domains}")
    if cfg.opd.mode not in ("opd", "ppo_opd"):
        problems.append(f"opd.mode={cfg.opd.mode!r}: must be one of ['opd', 'ppo_opd']")
    for i, t in enumerate(cfg.opd.teachers):
        if not t.name or not t.path or not t.domains:
            problems.append(f"opd.teachers[{i}] needs name, path and domains (got {t})")
        if t.engine not in ("local", "sglang"):
            problems.append(f"opd.teachers[{i}].engine={t.engine!r}: must be one of ['local', 'sglang']")
        # SGLang applies the sampling temperature to generated tokens' logprobs only: a prefill-only request's
        # input logprobs are log softmax of the raw logits whatever the request's temperature (0.5.17's
        # logprob_processor; tests/gpu/test_sglang_server.py checks it on the GPU). So an SGLang teacher scores at
        # T = 1, and at any other rollout temperature its reverse KL against the student would mix temperatures.
        if t.engine == "sglang" and cfg.engine.temperature not in (0, 1):
            problems.append(f"opd.teachers[{i}] ({t.name}) is served by SGLang, which returns prompt logprobs at "
                            f"temperature 1, but engine.temperature={cfg.engine.temperature}: roll out at "
                            "engine.temperature=1 or make this teacher engine=local (which scales by the "
                            "temperature)")
        for d in t.domains:
            if d in owner:
                problems.append(f"domain {d!r} has two teachers: {owner[d].name} and {t.name}")
            owner[d] = t
    orphans = sorted(task_domains - set(owner))
    if orphans:
        problems.append(f"task domains {orphans} have no teacher (teachers own {sorted(owner)})")
    if problems:
        raise ValueError("invalid OPD configuration:\n  " + "\n  ".join(problems))
    return owner
