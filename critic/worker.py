"""The critic worker: a value model (policy backbone + scalar head) with its own weights and optimizer."""

from __future__ import annotations

import time

import torch

from critic.losses import explained_variance, masked_mean, masked_sum, value_loss
from models import load_model, to_dtype, token_values
from models.batching import ppo_mini_batches, unbatch
from models.training import DeepSpeedWorker, DistEnv, OptimConfig, accumulate_and_step, release_memory


class CriticWorker(DeepSpeedWorker):
    def __init__(self, model_path: str, optim: OptimConfig, value_clip: float | None = 0.2,
                 dtype: str = "float32", seed: int = 0, torch_threads: int = 0, dist: DistEnv | None = None):
        self.model_path = model_path
        self.value_clip = value_clip
        model = load_model(model_path, role="value", dtype=dtype)
        super().__init__(model, optim, to_dtype(dtype), seed, torch_threads, dist, tokenizer_source=model_path)

    @torch.no_grad()
    def compute_values(self, samples: list[dict]) -> list[list[float]]:
        """V(t) for every token of every segment (aligned like the actor's logprobs)."""
        self.module.eval()
        batches = self.micro_batches(samples, ())
        outputs = [token_values(self.module, mb.tensors["input_ids"], mb.tensors["attention_mask"])
                   for mb in batches]
        release_memory()
        return unbatch(batches, outputs, len(samples))

    def train_step(self, samples: list[dict], mini_batches: int = 1, epochs: int = 1, seed: int = 0) -> dict:
        """The clipped value loss, token-mean over the action tokens of each optimiser step: `epochs` passes, each
        split into `mini_batches` random groups, one step per group (the defaults: one step over the whole batch).
        Each sample needs token_ids, loss_mask, returns and old_values (the values before the update, so the
        value clip binds from the second step on)."""
        started = time.perf_counter()
        self.module.train()
        totals = {"loss": 0.0, "clipped": 0.0, "tokens": 0.0}
        grad_norms, last = [], ([], [], [])  # values, returns, masks of the last epoch, for explained variance
        for epoch, group in ppo_mini_batches(samples, mini_batches, epochs, seed):
            if epoch == epochs - 1:
                grad_norms.append(self._optimiser_step(group, totals, last))
            else:
                grad_norms.append(self._optimiser_step(group, totals, None))
        release_memory()
        steps = len(grad_norms)
        v, g, m = (torch.cat(x) for x in last)
        tokens = sum(len(s["token_ids"]) for s in samples)
        elapsed = time.perf_counter() - started
        return {"critic/value_loss": totals["loss"] / steps, "critic/value_clipfrac": totals["clipped"] / totals["tokens"],
                "critic/explained_variance": explained_variance(v, g, m),
                "critic/value_mean": float(masked_mean(v, m)), "critic/return_mean": float(masked_mean(g, m)),
                "critic/grad_norm": sum(grad_norms) / steps, "critic/optim_steps": steps,
                "perf/critic_train_s": elapsed, "perf/critic_train_tokens_per_s": epochs * tokens / max(elapsed, 1e-9)}

    def _optimiser_step(self, samples: list[dict], totals: dict[str, float], keep: tuple | None) -> float:
        """One optimiser step of the value loss over `samples`; adds loss, clipped and token counts into `totals`
        and, given `keep`, appends each micro-batch's values, returns and masks there."""
        batches = self.micro_batches(samples, ("loss_mask", "returns", "old_values"))
        denom = sum(float(sum(s["loss_mask"])) for s in samples) or 1.0
        totals["tokens"] += denom

        def micro_loss(mb):
            def compute():
                t = mb.tensors
                values = token_values(self.module, t["input_ids"], t["attention_mask"])
                per_token, clipped = value_loss(values, t["old_values"], t["returns"], self.value_clip)
                loss = masked_sum(per_token, t["loss_mask"]) / denom
                totals["loss"] += float(loss.detach())
                totals["clipped"] += float(masked_sum(clipped, t["loss_mask"]))
                if keep is not None:
                    for store, x in zip(keep, (values.detach(), t["returns"], t["loss_mask"])):
                        store.append(x.flatten())
                return loss
            return compute

        return accumulate_and_step(self.engine, [micro_loss(mb) for mb in batches])
