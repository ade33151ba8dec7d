"""The actor worker: the policy under DeepSpeed, its PPO update, and the source of weight syncs."""

from __future__ import annotations

import asyncio
import time

import torch

from critic.losses import masked_sum
from models import load_model, policy_logprobs, to_dtype
from models.batching import TokenBatch, as_token_batch, unbatch
from models.deepspeed_worker import (DeepSpeedWorker, DistEnv, OptimConfig, accumulate_and_step, expert_shard,
                                     release_memory)
from models.weight_stream import WeightBuckets
from rl.config import AlgorithmConfig
from rl.losses import kl_estimate, ppo_policy_loss, rollout_correction


# Token lags (in weight versions) the mismatch metrics are broken down by; the last level gathers the rest.
LAG_LEVELS = 4
_LAGGED = tuple(f"lag{k}_{stat}" for k in range(LAG_LEVELS) for stat in ("tokens", "abs_diff", "masked"))
# The statistics train_step sums over micro-batches and ranks (the same keys on every rank, for the all-reduce).
_SUMMED = ("loss", "pg", "entropy", "clip_tokens", "dual_clip_tokens", "approx_kl_sum", "tis_truncated_tokens",
           "mismatch_masked_tokens", "mismatch_abs_logp_sum", "mismatch_kl_sum", "vetoed_sequences") + _LAGGED


def needs_logprob_pass(algo: AlgorithmConfig, step: int = 0) -> bool:
    """Whether step `step` (from 0) computes π_old or π_ref before the update: for the reference when it is due,
    or because the update takes several optimiser steps (then π_old must be fixed before the first one changes
    the weights)."""
    return reference_due(algo, step) or algo.ppo_epochs * algo.mini_batches > 1


def needs_old_logprobs(algo: AlgorithmConfig) -> bool:
    """π_old before the update: for several optimiser steps, or for a KL penalty in the reward. One step with no
    KL in the reward reads π_old off its own forward (train_step), so the pass computes π_ref alone."""
    return algo.ppo_epochs * algo.mini_batches > 1 or algo.kl_coef > 0


def needs_reference(algo: AlgorithmConfig) -> bool:
    """A frozen reference is kept to log or penalise KL(π ‖ π_ref). Its logprobs (and π_old, for a KL penalty in
    the reward) are computed before the update; otherwise the step needs no logprob pass of its own."""
    return algo.use_reference or algo.kl_penalty


def reference_due(algo: AlgorithmConfig, step: int) -> bool:
    """π_ref's logprobs at step `step` (from 0): on every step for a KL penalty, and for the logged KL alone on
    every `algorithm.reference_every`-th one, the first included."""
    return needs_reference(algo) and (algo.kl_penalty or step % algo.reference_every == 0)


class ActorWorker(DeepSpeedWorker):
    # The per-token fields train_step reads (besides token_ids); the group sends those the samples have.
    TRAIN_FIELDS = ("loss_mask", "advantages", "rollout_logprobs", "old_logprobs", "ref_logprobs", "staleness",
                    "routed_experts", "indexer_replay")
    # compute_logprobs's (routed_experts: MoE replay; indexer_replay: the engine's indexer rows, per sample)
    LOGPROB_FIELDS = ("loss_mask", "routed_experts", "indexer_replay")

    def __init__(self, model_path: str, optim: OptimConfig, algo: AlgorithmConfig, temperature: float = 1.0,
                 dtype: str = "float32", seed: int = 0, torch_threads: int = 0, dist: DistEnv | None = None,
                 model_overrides: dict | None = None, reference_path: str | None = None):
        """`reference_path`: the frozen π_ref's weights when they are not `model_path`'s (a run resumed from a
        checkpoint's weights keeps its original reference, rl.train.model_sources)."""
        self.model_path = model_path
        self.algo = algo
        # The engine sampled from softmax(logits / T); π_old and π_θ must be the same function (greedy: T = 1).
        self.temperature = temperature if temperature > 0 else 1.0
        super().__init__(load_model(model_path, "policy", dtype=dtype, expert_shard=expert_shard(dist, optim),
                                    overrides=model_overrides),
                         optim, to_dtype(dtype), seed, torch_threads, dist, tokenizer_source=model_path)
        self.reference = None
        if needs_reference(algo):
            # on the host first: under expert parallelism only this rank's experts then go to the device
            self.reference = self.shard_experts(load_model(reference_path or model_path, "policy", dtype=dtype,
                                                           expert_shard=expert_shard(dist, optim),
                                                           overrides=model_overrides))
            self.reference.to(self.device).eval()
            self.reference.requires_grad_(False)

    @torch.no_grad()
    def compute_logprobs(self, samples: list[dict] | TokenBatch, with_old: bool = True,
                         with_ref: bool = True) -> dict[str, torch.Tensor]:
        """π_old (this step's proximal policy; skipped unless `with_old`) and, if kept and `with_ref`, π_ref
        logprobs of every action token: flat tensors in the batch's layout (`TokenBatch.split` gives one per
        sample)."""
        reference = self.reference if with_ref else None
        batch = as_token_batch(samples, self.LOGPROB_FIELDS)
        self.module.eval()
        replay = self.all_reduce([float(batch.has("routed_experts"))], "max")[0] > 0
        fields = ("loss_mask",) + (("routed_experts",) if replay else ())
        fields += ("indexer_replay",) if batch.has("indexer_replay") else ()  # changes no collective: local
        batches = self.micro_batches(batch, fields)
        old, ref = [], []
        for mb in batches:
            args = (mb.tensors["input_ids"], mb.tensors["attention_mask"], self.temperature)
            kwargs = dict(only=mb.tensors["loss_mask"], position_ids=mb.position_ids,
                          routed_experts=mb.tensors.get("routed_experts"), indexer_topk=mb.indexer_topk(),
                          sequence=mb.sequence,
                          head_calls=self.head_calls(mb, mb.tensors["loss_mask"]))
            with self.forward_precision():
                if with_old:
                    old.append(self.whole(mb, policy_logprobs(self.module, *args, **kwargs)[0]))
                if reference is not None:
                    ref.append(self.whole(mb, policy_logprobs(reference, *args, **kwargs)[0]))
        release_memory()
        out = {"old_logprobs": unbatch(batches, old, batch)} if with_old else {}
        if reference is not None:
            out["ref_logprobs"] = unbatch(batches, ref, batch)
        return out

    def train_step(self, samples: list[dict] | TokenBatch, seed: int = 0) -> dict:
        """PPO's update on the step's segments: `algorithm.ppo_epochs` passes, each split into
        `algorithm.mini_batches` random groups, one optimiser step per group with the token-mean of that group
        (docs/ALGORITHMS.md §1.8); the defaults make one step over the whole batch.

        Samples carry token_ids, loss_mask, advantages, rollout_logprobs (and ref_logprobs). π_old is the policy
        at the start of the update. With a single optimiser step the parameters *are* π_old throughout, so each
        micro-batch's own logprobs, detached, are π_old exactly and no separate pass is needed; with more than one
        step `old_logprobs` (from `compute_logprobs`, before the update) must be given, and from the second step
        on the ratio π/π_old moves and the clip acts (`actor/clipfrac`, `actor/approx_kl`)."""
        started = time.perf_counter()
        a = self.algo
        batch = as_token_batch(samples, self.TRAIN_FIELDS)
        # the same on every rank (a rank's shard may be empty): the fields decide the micro-batches' tensors
        have_old = self.all_reduce([float(len(batch) > 0 and batch.has("old_logprobs"))], "max")[0] > 0
        if a.ppo_epochs * a.mini_batches > 1 and not have_old:
            raise ValueError("several optimiser steps per batch need old_logprobs from compute_logprobs, "
                             "computed before the update")
        have_lag = self.all_reduce([float(len(batch) > 0 and batch.has("staleness"))], "max")[0] > 0
        fields = ("loss_mask", "advantages", "rollout_logprobs") + (("old_logprobs",) if have_old else ())
        fields += ("staleness",) if have_lag else ()
        # π_ref's logprobs come on the steps they were computed for (algorithm.reference_every)
        have_ref = self.all_reduce([float(len(batch) > 0 and batch.has("ref_logprobs"))], "max")[0] > 0
        if have_ref:
            fields += ("ref_logprobs",)
        if self.all_reduce([float(batch.has("routed_experts"))], "max")[0] > 0:
            fields += ("routed_experts",)  # the engine's experts, replayed in the forward (models/glm5/moe.py)
        if batch.has("indexer_replay"):
            fields += ("indexer_replay",)  # the engine's fragile indexer rows (rollout/indexer_replay.py)
        self.module.train()
        sums = dict.fromkeys(_SUMMED + (("kl_ref",) if have_ref else ()), 0.0)
        grad_norms, tokens_seen = [], 0.0
        for _, group, denom in self.ppo_steps(batch, a.mini_batches, a.ppo_epochs, seed):
            grad_norms.append(self._optimiser_step(group, fields, have_old, denom, sums))
            tokens_seen += denom
        release_memory()
        sums = dict(zip(sums, self.all_reduce(list(sums.values()))))
        steps = len(grad_norms)
        tokens = self.shard_total(batch.num_tokens)
        elapsed = time.perf_counter() - started
        metrics = {
            "actor/loss": sums["loss"] / steps, "actor/pg_loss": sums["pg"] / steps,
            "actor/grad_norm": sum(grad_norms) / steps, "actor/optim_steps": steps,
            "actor/entropy": sums["entropy"] / tokens_seen, "actor/clipfrac": sums["clip_tokens"] / tokens_seen,
            "actor/dual_clipfrac": sums["dual_clip_tokens"] / tokens_seen,
            "actor/approx_kl": sums["approx_kl_sum"] / tokens_seen,
            "mismatch/tis_truncated_frac": sums["tis_truncated_tokens"] / tokens_seen,
            "mismatch/masked_frac": sums["mismatch_masked_tokens"] / tokens_seen,
            "mismatch/train_rollout_logprob_abs_diff": sums["mismatch_abs_logp_sum"] / tokens_seen,
            "mismatch/kl_rollout_train": sums["mismatch_kl_sum"] / tokens_seen,
            "mismatch/vetoed_segments": sums["vetoed_sequences"] / a.ppo_epochs,
            "perf/actor_train_s": elapsed, "perf/actor_train_tokens_per_s": a.ppo_epochs * tokens / max(elapsed, 1e-9),
        }
        if "kl_ref" in sums:
            metrics["actor/kl_ref"] = sums["kl_ref"] / tokens_seen
        for k in range(LAG_LEVELS):  # the mismatch π_old vs μ by how many versions the tokens lag
            n = sums[f"lag{k}_tokens"]
            if n:
                metrics[f"mismatch/abs_diff_lag{k}"] = sums[f"lag{k}_abs_diff"] / n
                metrics[f"mismatch/masked_frac_lag{k}"] = sums[f"lag{k}_masked"] / n
        return metrics

    def _optimiser_step(self, samples: TokenBatch, fields: tuple[str, ...], have_old: bool, denom: float,
                        sums: dict[str, float]) -> float:
        """One optimiser step over `samples` (micro-batched), loss = Σ per-token terms / denom; adds the step's
        statistics (masked sums) into `sums`; returns the gradient norm."""
        a = self.algo
        batches = self.micro_batches(samples, fields)

        def add(key: str, value) -> None:  # summed on the device: the host reads the sums once (host_floats)
            sums[key] = sums.get(key, 0.0) + (value.detach().double() if torch.is_tensor(value) else value)

        def micro_loss(mb):
            def compute():
                t = mb.tensors
                if mb.padding:  # keeps this rank's collectives in step with the others; contributes nothing
                    logp, _ = policy_logprobs(self.module, t["input_ids"], t["attention_mask"], self.temperature,
                                              position_ids=mb.position_ids, sequence=mb.sequence,
                                              head_calls=self.head_calls(mb, t["attention_mask"]))
                    return logp.sum() * 0.0
                mask = self.owned(mb, t["loss_mask"])  # under sequence parallelism: the positions of this rank
                logp, entropy = policy_logprobs(self.module, t["input_ids"], t["attention_mask"], self.temperature,
                                                with_entropy=True, only=mask, position_ids=mb.position_ids,
                                                routed_experts=t.get("routed_experts"),
                                                indexer_topk=mb.indexer_topk(), sequence=mb.sequence,
                                                head_calls=self.head_calls(mb, t["loss_mask"]))
                old = t["old_logprobs"] if have_old else logp.detach()
                weights, keep, corr = rollout_correction(old, t["rollout_logprobs"], mask, a.tis_low, a.tis_high,
                                                         a.mask_low or None, a.mask_high or None, a.veto or None,
                                                         mb.sample_ids(), mb.sequence.any_rank if mb.sequence else None)
                if mb.sequence is not None and self.sequence_rank:  # a sample's veto is counted by one rank
                    corr["vetoed_sequences"] = 0.0
                pg, stats = ppo_policy_loss(logp, old, t["advantages"], mask, a.clip_low, a.clip_high,
                                            a.dual_clip or None)
                effective = mask * keep
                per_token = pg * weights
                if a.kl_loss_coef > 0:
                    per_token = per_token + a.kl_loss_coef * kl_estimate(logp, t["ref_logprobs"], a.kl_estimator)
                if a.entropy_coef > 0:
                    per_token = per_token - a.entropy_coef * entropy
                loss = masked_sum(per_token, effective) / denom
                add("loss", loss)
                loss = loss * self.loss_scale
                add("pg", masked_sum(pg, effective) / denom)
                add("entropy", masked_sum(entropy.detach(), mask))
                if "ref_logprobs" in t:
                    add("kl_ref", masked_sum(kl_estimate(logp.detach(), t["ref_logprobs"], "k3"), mask))
                for k, v in {**stats, **corr}.items():
                    add(k, v)
                if "staleness" in t:  # per lag: tokens, |π_old − μ| and masked tokens
                    lag = t["staleness"].clamp(max=LAG_LEVELS - 1)
                    at = mask.unsqueeze(0) * (lag.unsqueeze(0) == torch.arange(LAG_LEVELS, device=lag.device)
                                              .view(-1, *[1] * lag.dim())).float()  # [levels, *mask.shape]
                    diff, masked = (old - t["rollout_logprobs"]).abs().detach(), 1.0 - keep
                    per_lag = torch.stack([at.flatten(1).sum(1), (at * diff).flatten(1).sum(1),
                                           (at * masked).flatten(1).sum(1)], 1)
                    for k in range(LAG_LEVELS):
                        for j, stat in enumerate(("tokens", "abs_diff", "masked")):
                            add(f"lag{k}_{stat}", per_lag[k, j])
                return loss
            return compute

        return accumulate_and_step(self.engine, [micro_loss(mb) for mb in batches], self.optim.bf16_autocast)

    def sft_step(self, samples: list[dict] | TokenBatch, mini_batches: int = 1, seed: int = 0) -> dict:
        """Supervised fine-tuning on episodes the agent loop rendered (rl/sft.py): the loss of each of
        `mini_batches` optimiser steps is the token-mean negative log-likelihood of its loss-mask tokens over all
        ranks, −Σ mask·log π(x_t | x_<t) / Σ mask, at temperature 1 (the plain model). The mask is 1 on exactly
        the policy's own tokens (its replies and compaction summaries), so prompts and observations are context."""
        started = time.perf_counter()
        batch = as_token_batch(samples, ("loss_mask",))
        self.module.train()
        nll, tokens, grad_norms = [], 0.0, []
        for _, group, denom in self.ppo_steps(batch, mini_batches, 1, seed):
            step_sum = [0.0]

            def micro_loss(mb):
                def compute():
                    t = mb.tensors
                    if mb.padding:  # keeps this rank's collectives in step with the others; contributes nothing
                        logp, _ = policy_logprobs(self.module, t["input_ids"], t["attention_mask"],
                                                  position_ids=mb.position_ids, sequence=mb.sequence,
                                                  head_calls=self.head_calls(mb, t["attention_mask"]))
                        return logp.sum() * 0.0
                    mask = self.owned(mb, t["loss_mask"])
                    logp, _ = policy_logprobs(self.module, t["input_ids"], t["attention_mask"], only=mask,
                                              position_ids=mb.position_ids, sequence=mb.sequence,
                                              head_calls=self.head_calls(mb, t["loss_mask"]))
                    loss = -masked_sum(logp, mask) / denom
                    step_sum[0] += float(loss.detach())
                    return loss * self.loss_scale
                return compute

            grad_norms.append(accumulate_and_step(self.engine, [micro_loss(mb) for mb in self.micro_batches(
                group, ("loss_mask",))], self.optim.bf16_autocast))
            nll.append(step_sum[0])
            tokens += denom
        release_memory()
        nll = self.all_reduce(nll)  # each rank's share of every step's token-mean: summed, the whole
        elapsed = time.perf_counter() - started
        return {"sft/loss": sum(nll) / len(nll), "sft/grad_norm": sum(grad_norms) / len(grad_norms),
                "sft/optim_steps": len(nll), "sft/tokens": tokens, "perf/sft_s": elapsed,
                "perf/sft_tokens_per_s": self.shard_total(batch.num_tokens) / max(elapsed, 1e-9)}

    def weight_buckets(self, bucket_mb: int, on_device: bool = False) -> WeightBuckets:
        """The policy's parameters in buckets of about `bucket_mb` MB, in a fixed order, gathered one bucket at a
        time (every rank walks them; rank 0 keeps them)."""
        return self.weight_stream(bucket_mb, on_device=on_device)

    def weight_bucket_refs(self, bucket_mb: int) -> list[tuple[int, object]]:
        """This rank's share of the buckets (bucket i on rank i mod N), each put into Ray's object store once, as
        (bucket index, ref); every rollout worker pulls them from there. Under ZeRO-0..2 each rank copies its
        share from its own full parameters, so N ranks put the model in parallel without communicating (but for
        the experts under expert parallelism, gathered over their expert group)."""
        import ray

        stream = self.weight_stream(bucket_mb, shared=True)
        return [(i, ray.put(b)) for i, b in enumerate(stream) if b]

    # ---- the policy to SGLang servers (rollout/sglang/weights.py), one method per transport; rl/weight_sync.py
    # picks one. Every rank takes part in gathering the weights (ZeRO-3); rank 0 sends them and reports.
    def push_sglang_disk(self, urls: list[str], version: int, folder: str, pause_mode: str) -> dict:
        """An HF folder, `folder`/v`version`, that the servers reload."""
        from rollout.sglang.weights import sync_from_disk

        started, target = time.perf_counter(), f"{folder}/v{version}"
        written = self.save_hf(target)
        if self.rank != 0:
            return {}
        stats = asyncio.run(sync_from_disk(urls, target, version, pause_mode))
        return self._pushed({**stats, "bytes": written}, started)

    def push_sglang_tensors(self, urls: list[str], version: int, bucket_mb: int, tp_sizes: list[int],
                            pause_mode: str) -> dict:
        """CUDA IPC handles of our own GPU copies, bucket by bucket (servers on this rank's GPU)."""
        from rollout.sglang.weights import sync_from_tensors

        started, buckets = time.perf_counter(), self.weight_buckets(bucket_mb, on_device=True)
        if self.rank != 0:
            return self._take_part(buckets)
        try:
            return self._pushed(asyncio.run(sync_from_tensors(urls, buckets, version, tp_sizes, pause_mode)), started)
        finally:
            buckets.finish()  # after a failure: the gathers the other ranks wait in

    def push_sglang_group(self, urls: list[str], version: int, bucket_mb: int, tp_sizes: list[int],
                          pause_mode: str, new_group: bool = False) -> dict:
        """A broadcast over a process group with the servers (NCCL; gloo on the CPU), kept for the next sync
        unless `new_group` or broken (a member died)."""
        from models.deepspeed_worker import free_port
        from rollout.sglang.server import advertised_host
        from rollout.sglang.weights import sync_over_group

        started, buckets = time.perf_counter(), self.weight_buckets(bucket_mb, on_device=True)
        if self.rank != 0:
            return self._take_part(buckets)
        group = getattr(self, "_update_group", None)
        if group is not None and (new_group or getattr(group, "broken", False)):
            try:
                group.close()
            except Exception:  # a member died: the group is broken anyway
                pass
            group = None
        # servers elsewhere reach us at this node's IP (the one they are advertised by, too)
        address = advertised_host("0.0.0.0") if any("127.0.0.1" not in u for u in urls) else "127.0.0.1"
        try:
            stats, self._update_group = asyncio.run(sync_over_group(
                urls, buckets, version, address, free_port(), tp_sizes,
                "nccl" if self.device.type == "cuda" else "gloo", pause_mode, group, self.device))
        finally:
            buckets.finish()  # after a failure: the gathers the other ranks wait in
        return self._pushed(stats, started)

    def close(self) -> None:
        """The weight-update group with the SGLang servers first, aborted (local: the servers may be gone, and
        NCCL's destroy can wait for its peers), then the trainer's own groups."""
        group = getattr(self, "_update_group", None)
        if group is not None:
            group.broken = True
            group.close()
            self._update_group = None
        super().close()

    @staticmethod
    def _take_part(buckets: WeightBuckets) -> dict:
        buckets.finish()  # each bucket's gather needs every rank (ZeRO-3; experts under expert parallelism)
        return {}

    @staticmethod
    def _pushed(stats: dict, started: float) -> dict:
        release_memory()
        stats["seconds"] = time.perf_counter() - started
        return stats
