"""Policy optimisation: PPO losses, the actor worker, advantages, checkpoints, metrics and the training driver
(`python -m rl.train`). Nothing imports `rl` except entry points."""

from rl.config import AlgorithmConfig, Config, TrainerConfig
from rl.losses import kl_estimate, masked_whiten, ppo_policy_loss, rollout_correction

__all__ = ["AlgorithmConfig", "Config", "TrainerConfig", "kl_estimate", "masked_whiten", "ppo_policy_loss",
           "rollout_correction"]
