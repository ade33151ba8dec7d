"""From trajectories to training samples: one sample per segment, advantages chained per trajectory.

GAE runs once per trajectory over the action tokens of all its segments in time order (docs/ALGORITHMS.md §1.5.2):
the last action of segment k bootstraps from V at the first action of segment k+1, computed by the critic on
segment k+1's own (compacted) context. The terminal reward sits on the very last action token; nothing is
split or duplicated across segments.
"""

from __future__ import annotations

from collections import Counter

import torch

from critic.gae import adaptive_lambda, compute_gae
from rl.config import AlgorithmConfig
from rl.losses import kl_estimate, masked_whiten
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
    samples = []
    for ti, t in enumerate(trajectories):
        for s in t.segments:
            samples.append({"traj": ti, "segment_index": s.segment_index, "segment_type": s.segment_type,
                            "token_ids": s.token_ids, "loss_mask": s.loss_mask,
                            "rollout_logprobs": s.rollout_logprobs})
    return samples


def add_advantages(samples: list[dict], trajectories: list[Trajectory], algo: AlgorithmConfig) -> dict:
    """Fill `advantages`, `returns` and `old_values` of every sample (needs `values`; `old_logprobs` and
    `ref_logprobs` when the KL is in the reward). Returns metrics about the advantages."""
    by_traj: dict[int, list[dict]] = {}
    for s in samples:
        by_traj.setdefault(s["traj"], []).append(s)
    rows_v, rows_r, spans = [], [], []
    kl_total, kl_tokens = 0.0, 0
    for ti in sorted(by_traj):
        segs = sorted(by_traj[ti], key=lambda s: s["segment_index"])
        values, rewards, span = [], [], []
        for s in segs:
            idx = [i for i, m in enumerate(s["loss_mask"]) if m]
            values += [s["values"][i] for i in idx]
            if algo.kl_coef > 0:
                kl = kl_estimate(torch.tensor([s["old_logprobs"][i] for i in idx]),
                                 torch.tensor([s["ref_logprobs"][i] for i in idx]), algo.kl_estimator)
                rewards += (-algo.kl_coef * kl).tolist()
                kl_total += float(kl.sum())
                kl_tokens += len(idx)
            else:
                rewards += [0.0] * len(idx)
            span.append((s, idx))
        rewards[-1] += trajectories[ti].reward  # terminal reward on the trajectory's last action token
        rows_v.append(values)
        rows_r.append(rewards)
        spans.append(span)

    width = max(len(v) for v in rows_v)
    V = torch.zeros(len(rows_v), width, dtype=torch.float64)
    R = torch.zeros_like(V)
    M = torch.zeros_like(V, dtype=torch.bool)
    for i, (v, r) in enumerate(zip(rows_v, rows_r)):
        V[i, :len(v)] = torch.tensor(v, dtype=torch.float64)
        R[i, :len(r)] = torch.tensor(r, dtype=torch.float64)
        M[i, :len(v)] = True
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
            a, g = [0.0] * n, [0.0] * n
            for i in idx:
                a[i] = float(adv[row, pos])
                g[i] = float(returns[row, pos])
                pos += 1
            s["advantages"], s["returns"], s["old_values"] = a, g, s["values"]
    metrics = {"adv/raw_std": raw_std, "adv/mean_return": float(returns[M].mean()),
               "adv/mean_value": float(V[M].mean())}
    if kl_tokens:
        metrics["adv/kl_in_reward"] = kl_total / kl_tokens
    return metrics


def boundary_value_drop(samples: list[dict]) -> float | None:
    """Mean V(first action of segment k+1) − V(last action of segment k) over compaction boundaries
    (docs/ALGORITHMS.md §2.6: negative means the summary lost information)."""
    by_traj: dict[int, list[dict]] = {}
    for s in samples:
        by_traj.setdefault(s["traj"], []).append(s)
    drops = []
    for segs in by_traj.values():
        segs = sorted(segs, key=lambda s: s["segment_index"])
        for prev, nxt in zip(segs, segs[1:]):
            last = max(i for i, m in enumerate(prev["loss_mask"]) if m)
            first = min(i for i, m in enumerate(nxt["loss_mask"]) if m)
            drops.append(nxt["values"][first] - prev["values"][last])
    return sum(drops) / len(drops) if drops else None
