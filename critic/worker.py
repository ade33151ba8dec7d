"""The critic worker: a value model (policy backbone + scalar head) with its own weights and optimizer."""

from __future__ import annotations

import time

import torch

from critic.losses import explained_variance_from_sums, masked_sum, value_loss
from models import load_model, to_dtype, token_values
from models.batching import TokenBatch, as_token_batch, unbatch
from models.deepspeed_worker import (DeepSpeedWorker, DistEnv, OptimConfig, accumulate_and_step, expert_shard,
                                     release_memory)


class CriticWorker(DeepSpeedWorker):
    # The per-token fields train_step reads (besides token_ids).
    TRAIN_FIELDS = ("loss_mask", "returns", "old_values")

    def __init__(self, model_path: str, optim: OptimConfig, value_clip: float | None = 0.2,
                 dtype: str = "float32", seed: int = 0, torch_threads: int = 0, dist: DistEnv | None = None):
        self.model_path = model_path
        self.value_clip = value_clip
        model = load_model(model_path, role="value", dtype=dtype, expert_shard=expert_shard(dist, optim))
        super().__init__(model, optim, to_dtype(dtype), seed, torch_threads, dist, tokenizer_source=model_path)

    @torch.no_grad()
    def compute_values(self, samples: list[dict] | TokenBatch) -> torch.Tensor:
        """V(t) for every token of every segment (aligned like the actor's logprobs): a flat tensor in the batch's
        layout (`TokenBatch.split` gives one per sample)."""
        batch = as_token_batch(samples, ())
        self.module.eval()
        batches = self.micro_batches(batch, ())
        with self.forward_precision():
            outputs = [self.whole(mb, token_values(self.module, mb.tensors["input_ids"],
                                                   mb.tensors["attention_mask"], mb.position_ids,
                                                   sequence=mb.sequence)) for mb in batches]
        release_memory()
        return unbatch(batches, outputs, batch)

    def train_step(self, samples: list[dict] | TokenBatch, mini_batches: int = 1, epochs: int = 1,
                   seed: int = 0) -> dict:
        """The clipped value loss, token-mean over the action tokens of each optimiser step: `epochs` passes, each
        split into `mini_batches` random groups, one step per group (the defaults: one step over the whole batch).
        Each sample needs token_ids, loss_mask, returns and old_values (the values before the update, so the
        value clip binds from the second step on). With several ranks each holds a shard; the token counts, the
        statistics and the explained variance are over all ranks."""
        started = time.perf_counter()
        batch = as_token_batch(samples, self.TRAIN_FIELDS)
        self.module.train()
        # loss, clipped tokens; then over the last epoch: n, Σv, Σg, Σg², Σ(g−v), Σ(g−v)² (action tokens)
        totals = dict.fromkeys(("loss", "clipped", "n", "v", "g", "g2", "d", "d2"), 0.0)
        grad_norms, tokens_seen = [], 0.0  # (each step's denominator is already over every rank)
        for epoch, group, denom in self.ppo_steps(batch, mini_batches, epochs, seed):
            tokens_seen += denom
            grad_norms.append(self._optimiser_step(group, denom, totals, moments=epoch == epochs - 1))
        release_memory()
        t = dict(zip(totals, self.all_reduce(list(totals.values()))))
        steps, n = len(grad_norms), max(t["n"], 1.0)
        tokens = self.shard_total(batch.num_tokens)
        elapsed = time.perf_counter() - started
        return {"critic/value_loss": t["loss"] / steps, "critic/value_clipfrac": t["clipped"] / max(tokens_seen, 1.0),
                "critic/explained_variance": explained_variance_from_sums(t["n"], t["g"], t["g2"], t["d"], t["d2"]),
                "critic/value_mean": t["v"] / n, "critic/return_mean": t["g"] / n,
                "critic/grad_norm": sum(grad_norms) / steps, "critic/optim_steps": steps,
                "perf/critic_train_s": elapsed, "perf/critic_train_tokens_per_s": epochs * tokens / max(elapsed, 1e-9)}

    def _optimiser_step(self, samples: TokenBatch, denom: float, totals: dict[str, float], moments: bool) -> float:
        """One optimiser step of the value loss over `samples` (`denom`: the step's action tokens on every rank);
        adds the loss and clipped counts into `totals` and, with `moments`, the sums behind explained variance."""
        batches = self.micro_batches(samples, self.TRAIN_FIELDS)

        def micro_loss(mb):
            def compute():
                t = mb.tensors
                values = token_values(self.module, t["input_ids"], t["attention_mask"], mb.position_ids,
                                      sequence=mb.sequence)
                if mb.padding:  # keeps this rank's collectives in step with the others; contributes nothing
                    return values.sum() * 0.0
                per_token, clipped = value_loss(values, t["old_values"], t["returns"], self.value_clip)
                mask = self.owned(mb, t["loss_mask"])  # under sequence parallelism: the positions of this rank
                loss = masked_sum(per_token, mask) / denom
                # summed on the device: the host reads the totals once (models/deepspeed_worker.py host_floats)
                totals["loss"] = totals["loss"] + loss.detach().double()
                totals["clipped"] = totals["clipped"] + masked_sum(clipped, mask).double()
                if moments:
                    v, g = values.detach().double(), t["returns"].double()
                    m = mask.double()
                    for key, x in (("n", m), ("v", v * m), ("g", g * m), ("g2", g * g * m), ("d", (g - v) * m),
                                   ("d2", (g - v) ** 2 * m)):
                        totals[key] = totals[key] + x.sum()
                return loss * self.loss_scale
            return compute

        return accumulate_and_step(self.engine, [micro_loss(mb) for mb in batches], self.optim.bf16_autocast)
