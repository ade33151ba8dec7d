"""The critic: token-level GAE (skip-observation, chained across segments), the value loss, the critic worker."""

from critic.gae import adaptive_lambda, compute_gae
from critic.losses import explained_variance, masked_mean, masked_sum, value_loss
from critic.worker import CriticWorker

__all__ = ["adaptive_lambda", "compute_gae", "explained_variance", "masked_mean", "masked_sum", "value_loss",
           "CriticWorker"]
