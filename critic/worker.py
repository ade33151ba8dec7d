"""The critic worker: a value model (policy backbone + scalar head) with its own weights and optimizer."""

from __future__ import annotations

import time

import torch

from critic.losses import explained_variance, masked_mean, masked_sum, value_loss
from models import load_model, to_dtype, token_values
from models.batching import unbatch
from models.training import DeepSpeedWorker, DistEnv, OptimConfig, release_memory


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

    def train_step(self, samples: list[dict]) -> dict:
        """One optimiser step of the clipped value loss, token-mean over all action tokens of the step.
        Each sample needs token_ids, loss_mask, returns and old_values."""
        from models.training import accumulate_and_step

        started = time.perf_counter()
        self.module.train()
        batches = self.micro_batches(samples, ("loss_mask", "returns", "old_values"))
        denom = sum(float(sum(s["loss_mask"])) for s in samples) or 1.0
        totals = {"loss": 0.0, "clipped": 0.0}
        all_v, all_g, all_m = [], [], []

        def micro_loss(mb):
            def compute():
                t = mb.tensors
                values = token_values(self.module, t["input_ids"], t["attention_mask"])
                per_token, clipped = value_loss(values, t["old_values"], t["returns"], self.value_clip)
                loss = masked_sum(per_token, t["loss_mask"]) / denom
                totals["loss"] += float(loss.detach())
                totals["clipped"] += float(masked_sum(clipped, t["loss_mask"]))
                all_v.append(values.detach().flatten())
                all_g.append(t["returns"].flatten())
                all_m.append(t["loss_mask"].flatten())
                return loss
            return compute

        grad_norm = accumulate_and_step(self.engine, [micro_loss(mb) for mb in batches])
        release_memory()
        v, g, m = torch.cat(all_v), torch.cat(all_g), torch.cat(all_m)
        tokens = sum(len(s["token_ids"]) for s in samples)
        elapsed = time.perf_counter() - started
        return {"critic/value_loss": totals["loss"], "critic/value_clipfrac": totals["clipped"] / denom,
                "critic/explained_variance": explained_variance(v, g, m),
                "critic/value_mean": float(masked_mean(v, m)), "critic/return_mean": float(masked_mean(g, m)),
                "critic/grad_norm": grad_norm, "perf/critic_train_s": elapsed,
                "perf/critic_train_tokens_per_s": tokens / max(elapsed, 1e-9)}
