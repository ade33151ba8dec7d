"""Metrics of a batch of trajectories (rollout and evaluation)."""

from __future__ import annotations

from collections import Counter
from statistics import mean

from rollout.types import Trajectory


def solved_share(trajs: list[Trajectory]) -> float:
    solved: dict[str, bool] = {}
    for t in trajs:
        solved[t.task_id] = solved.get(t.task_id, False) or bool(t.passed)
    return mean(solved.values()) if solved else 0.0


def trajectory_metrics(trajs: list[Trajectory], prefix: str) -> dict[str, float]:
    if not trajs:
        return {f"{prefix}/episodes": 0}
    graded = [t for t in trajs if t.finish_reason not in ("error", "aborted")]
    m = {
        f"{prefix}/episodes": len(trajs),
        f"{prefix}/reward_mean": mean(t.reward for t in graded) if graded else 0.0,
        f"{prefix}/pass_rate": mean(float(t.passed) for t in graded) if graded else 0.0,
        # With several episodes per task (eval_samples, grouped rollouts): the share of tasks solved at least once.
        f"{prefix}/tasks_solved": solved_share(graded),
        f"{prefix}/turns_mean": mean(t.num_turns for t in trajs),
        f"{prefix}/episode_tokens_mean": mean(t.num_tokens for t in trajs),
        f"{prefix}/action_tokens_mean": mean(t.num_action_tokens for t in trajs),
        f"{prefix}/segments_mean": mean(len(t.segments) for t in trajs),
        f"{prefix}/segment_tokens_mean": mean(len(s.token_ids) for t in trajs for s in t.segments)
        if any(t.segments for t in trajs) else 0.0,
        f"{prefix}/compactions": sum(t.num_compactions for t in trajs),
        f"{prefix}/tool_calls_mean": mean(t.num_tool_calls for t in trajs),
        f"{prefix}/malformed_calls": sum(t.num_malformed_calls for t in trajs),
        f"{prefix}/guard_flags": sum(t.num_guard_flags for t in trajs),
        f"{prefix}/guard_blocks": sum(t.num_guard_blocks for t in trajs),
        f"{prefix}/errors": sum(t.finish_reason == "error" for t in trajs),
    }
    m.update(compaction_metrics(trajs, graded, prefix))
    for reason, count in Counter(t.finish_reason for t in trajs).items():
        m[f"{prefix}/finish_{reason}"] = count
    for stage in ("generate_s", "tool_s", "guard_s", "grade_s", "episode_s"):
        values = [t.timings.get(stage, 0.0) for t in trajs]
        m[f"{prefix}/{stage}_mean"] = mean(values)
    return m


def summary_tokens(segment) -> int:
    """The handoff note's tokens: a summary segment ends with them (the last run of policy tokens)."""
    n = 0
    for m in reversed(segment.loss_mask):
        if not m:
            break
        n += 1
    return n


def compaction_metrics(trajs: list[Trajectory], graded: list[Trajectory], prefix: str) -> dict[str, float]:
    """How often episodes compact, the notes' length, and the pass rate by number of compactions (0, 1, 2+)."""
    m = {f"{prefix}/compactions_per_episode": mean(t.num_compactions for t in trajs),
         f"{prefix}/compacted_frac": mean(float(t.num_compactions > 0) for t in trajs)}
    notes = [summary_tokens(s) for t in trajs for s in t.segments if s.segment_type == "summary_closed"]
    if notes:
        m[f"{prefix}/summary_tokens_mean"] = mean(notes)
    for label, test in (("0", lambda n: n == 0), ("1", lambda n: n == 1), ("2plus", lambda n: n >= 2)):
        group = [t for t in graded if test(t.num_compactions)]
        if group:
            m[f"{prefix}/pass_rate_compactions_{label}"] = mean(float(t.passed) for t in group)
    return m
