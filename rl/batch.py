"""From trajectories to training samples: one sample per segment, advantages chained per trajectory.

GAE runs once per trajectory over the action tokens of all its segments in time order (docs/ALGORITHMS.md §1.5.2):
the last action of segment k bootstraps from V at the first action of segment k+1, computed by the critic on
segment k+1's own (compacted) context. The terminal reward sits on the very last action token; nothing is
split or duplicated across segments.
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import torch

from critic.gae import adaptive_lambda, compute_gae
from rl.config import AlgorithmConfig
from rl.losses import kl_estimate, masked_whiten
from rollout import indexer_replay
from rollout.types import Trajectory


def trainable(trajectories: list[Trajectory]) -> tuple[list[Trajectory], Counter]:
    """Drop (and count) what must not be trained on: crashed or aborted episodes, nothing sampled."""
    kept, dropped = [], Counter()
    for t in trajectories:
        if t.finish_reason in ("error", "aborted"):
            dropped[t.finish_reason] += 1
        elif t.num_action_tokens == 0:
            dropped["no_action_tokens"] += 1
        else:
            kept.append(t)
    return kept, dropped


def to_samples(trajectories: list[Trajectory]) -> list[dict]:
    """One sample per segment; its per-token fields as 1-D tensors (token ids and weight versions as int64, the
    rest float32), and, when the engine reported routing, `routed_experts` (int16 [tokens, layers, k], −1 in a
    segment that has none: the trainer routes those itself), and `indexer_replay` (the engine's indexer rows under
    its margin, rollout/indexer_replay.py) where a segment has them."""
    samples = []
    routing_shape = next((s.replay["routed_experts"].shape[1:] for t in trajectories for s in t.segments
                          if s.replay and "routed_experts" in s.replay), None)
    for ti, t in enumerate(trajectories):
        for s in t.segments:
            sample = {"traj": ti, "segment_index": s.segment_index, "segment_type": s.segment_type,
                      "token_ids": torch.tensor(s.token_ids, dtype=torch.long),
                      "loss_mask": torch.tensor(s.loss_mask, dtype=torch.float32),
                      "rollout_logprobs": torch.tensor(s.rollout_logprobs, dtype=torch.float32),
                      "weight_versions": torch.tensor(s.weight_versions, dtype=torch.long),
                      "step_rewards": list(s.step_rewards)}
            if routing_shape is not None:
                routing = (s.replay or {}).get("routed_experts")
                sample["routed_experts"] = (torch.from_numpy(np.array(routing, dtype=np.int16)) if routing is not None
                                            else torch.full((len(s.token_ids), *routing_shape), -1, dtype=torch.int16))
            if s.replay and s.replay.get("indexer_replay") is not None:  # sparse: one dict a sample, not a row a token
                sample["indexer_replay"] = s.replay["indexer_replay"]
            samples.append(sample)
    return samples


def mark_staleness(samples: list[dict], version: int) -> None:
    """Each sample's `weight_versions` becomes `staleness`: how many versions each action token lags the policy at
    `version` (0 elsewhere), which the actor's mismatch metrics are reported by."""
    for s in samples:
        s["staleness"] = (version - s.pop("weight_versions")).clamp(min=0).float() * s["loss_mask"]


def replay_metrics(samples: list[dict]) -> dict:
    """How much of the routing the trained logprobs depend on came from the engine: `replay/tokens_replayed_frac`,
    over each sample's positions before its last action token (the ones that token's logprob depends on), and
    the replay data's size per token; with indexer replay, its rows and bytes per token. Empty without replay."""
    out = indexer_replay_metrics(samples)
    if not samples or "routed_experts" not in samples[0]:
        return out
    replayed = positions = 0
    for s in samples:
        actions = _actions(s)
        last = int(actions[-1]) if len(actions) else 0
        replayed += int((s["routed_experts"][:last] >= 0).flatten(1).any(1).sum())
        positions += last
    per_token = samples[0]["routed_experts"][0].numel() * samples[0]["routed_experts"].element_size()
    return {**out, "replay/tokens_replayed_frac": replayed / max(positions, 1), "replay/bytes_per_token": per_token}


def indexer_replay_metrics(samples: list[dict]) -> dict:
    """`replay/indexer_rows_per_token` (query rows shipped, over all layers) and `replay/indexer_bytes_per_token`
    (the sparse rows' size) over the samples' tokens; empty when no sample has indexer rows."""
    having = [s["indexer_replay"] for s in samples if s.get("indexer_replay") is not None]
    if not having:
        return {}
    tokens = max(sum(len(s["token_ids"]) for s in samples), 1)
    rows = sum(len(r["positions"]) for r in having)
    size = sum(indexer_replay.nbytes(r) for r in having)
    return {"replay/indexer_rows_per_token": rows / tokens, "replay/indexer_bytes_per_token": size / tokens}


def _by_trajectory(samples: list[dict]) -> dict[int, list[dict]]:
    """Each trajectory's samples, in segment order."""
    by_traj: dict[int, list[dict]] = {}
    for s in samples:
        by_traj.setdefault(s["traj"], []).append(s)
    return {t: sorted(v, key=lambda s: s["segment_index"]) for t, v in sorted(by_traj.items())}


def _actions(sample: dict) -> torch.Tensor:
    """Positions of the sample's action tokens."""
    return torch.as_tensor(sample["loss_mask"]).nonzero().flatten()


def add_advantages(samples: list[dict], trajectories: list[Trajectory], algo: AlgorithmConfig) -> dict:
    """Fill `advantages`, `returns` and `old_values` of every sample (needs `values`; `old_logprobs` and
    `ref_logprobs` when the KL is in the reward), as float32 tensors. Returns metrics about the advantages."""
    by_traj = _by_trajectory(samples)
    rows_v, rows_r, spans = [], [], []
    kl_total, kl_tokens, step_total = 0.0, 0, 0.0
    # one GAE row per trajectory (its segments chained), or per segment (algorithm.chain_segments=false)
    chains = [(ti, segs) for ti, segs in by_traj.items()] if algo.chain_segments else \
        [(ti, [s]) for ti, segs in by_traj.items() for s in segs]
    for ti, segs in chains:
        values, rewards, span = [], [], []
        for s in segs:
            idx = _actions(s)
            values.append(torch.as_tensor(s["values"], dtype=torch.float64)[idx])
            if algo.kl_coef > 0:
                kl = kl_estimate(torch.as_tensor(s["old_logprobs"])[idx].float(),
                                 torch.as_tensor(s["ref_logprobs"])[idx].float(), algo.kl_estimator)
                rewards.append((-algo.kl_coef * kl).double())
                kl_total += float(kl.sum())
                kl_tokens += len(idx)
            else:
                rewards.append(torch.zeros(len(idx), dtype=torch.float64))
            for position, value in s.get("step_rewards", ()):
                # on the last action token at or before its position (a reply masked after the guard blocked its
                # call has none of its own); on the segment's first action if nothing trainable comes before
                rewards[-1][max(int(torch.searchsorted(idx, position, right=True)) - 1, 0)] += value
                step_total += value
            span.append((s, idx))
        v, r = torch.cat(values), torch.cat(rewards)
        r[-1] += trajectories[ti].reward  # terminal reward on the trajectory's last action token
        rows_v.append(v)
        rows_r.append(r)
        spans.append(span)

    width = max(len(v) for v in rows_v)
    V = torch.zeros(len(rows_v), width, dtype=torch.float64)
    R = torch.zeros_like(V)
    M = torch.zeros_like(V, dtype=torch.bool)
    for i, (v, r) in enumerate(zip(rows_v, rows_r)):
        V[i, :len(v)], R[i, :len(r)], M[i, :len(v)] = v, r, True
    lam_policy = adaptive_lambda(M.sum(1), algo.lam_alpha) if algo.lam_alpha > 0 else algo.lam_policy
    adv, _ = compute_gae(R, V, M, algo.gamma, lam_policy)
    _, returns = compute_gae(R, V, M, algo.gamma, algo.lam_critic)
    raw_std = float(adv[M].std()) if int(M.sum()) > 1 else 0.0
    if algo.normalize_advantages:
        adv = masked_whiten(adv, M.double())

    for row, span in enumerate(spans):
        pos = 0
        for s, idx in span:
            n = len(s["token_ids"])
            a, g = torch.zeros(n, dtype=torch.float32), torch.zeros(n, dtype=torch.float32)
            a[idx] = adv[row, pos:pos + len(idx)].float()
            g[idx] = returns[row, pos:pos + len(idx)].float()
            pos += len(idx)
            s["advantages"], s["returns"] = a, g
            s["old_values"] = torch.as_tensor(s["values"], dtype=torch.float32)
    metrics = {"adv/raw_std": raw_std, "adv/mean_return": float(returns[M].mean()),
               "adv/mean_value": float(V[M].mean())}
    if kl_tokens:
        metrics["adv/kl_in_reward"] = kl_total / kl_tokens
    if step_total:
        metrics["adv/step_reward_per_episode"] = step_total / len(by_traj)
    return metrics


def boundary_value_drop(samples: list[dict]) -> float | None:
    """Mean V(first action of segment k+1) − V(last action of segment k) over compaction boundaries
    (docs/ALGORITHMS.md §2.6: negative means the summary lost information)."""
    drops = []
    for segs in _by_trajectory(samples).values():
        for prev, nxt in zip(segs, segs[1:]):
            last, first = int(_actions(prev)[-1]), int(_actions(nxt)[0])
            drops.append(float(nxt["values"][first]) - float(prev["values"][last]))
    return sum(drops) / len(drops) if drops else None
