"""Data that crosses process boundaries during rollout: sampling parameters, engine results, segments and
trajectories (docs/DESIGN.md §3.4)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    max_new_tokens: int = 256
    stop_token_ids: tuple[int, ...] = ()
    stop_strings: tuple[str, ...] = ()
    seed: int | None = None
    ignore_eos: bool = False  # run to max_new_tokens (benchmarks): no stop token or string ends it (as in SGLang)

    def replace(self, **changes) -> "SamplingParams":
        return SamplingParams(**{**asdict(self), **changes})


@dataclass
class GenerateResult:
    output_ids: list[int]
    output_logprobs: list[float]  # log μ(token), μ = the distribution actually sampled from
    finish_reason: str  # "stop" | "length" | "abort"
    meta: dict[str, Any] = field(default_factory=dict)  # weight_version, request id, timings, replay data
    # The weight version that sampled each output token: a generation paused for a weight update and continued
    # on the new weights (a partial rollout) spans two or more. Empty: every token came from meta's weight_version.
    token_versions: list[int] = field(default_factory=list)

    def versions(self) -> list[int]:
        """One weight version per output token."""
        if self.token_versions:
            return list(self.token_versions)
        return [int(self.meta.get("weight_version", 0))] * len(self.output_ids)


SEGMENT_TYPES = ("final", "summary_closed")


@dataclass
class Segment:
    """One trainable sub-trace. `loss_mask` is 1 exactly on tokens the policy sampled in this segment."""

    rollout_id: str
    segment_index: int
    token_ids: list[int]
    loss_mask: list[int]
    rollout_logprobs: list[float]  # aligned with token_ids; 0 where loss_mask == 0
    segment_type: str = "final"
    # aligned with token_ids: the weight version that sampled each token, -1 where the policy sampled nothing
    weight_versions: list[int] = field(default_factory=list)
    # MoE replay when the engine reports it: {"routed_experts": int16 [len(token_ids), layers, k]}, the experts the
    # engine routed each position to, −1 where it ran none (the segment's tail after its last sampled token);
    # "indexer_replay": the indexer rows whose choice could differ, sparse (rollout/indexer_replay.py)
    replay: dict[str, Any] | None = None
    # Rewards before the episode's end (agent.malformed_call_reward): (position in token_ids, reward), each on the
    # last token of the reply it judges; the trajectory's graded reward comes at its end, as always
    step_rewards: list[tuple[int, float]] = field(default_factory=list)

    def __post_init__(self):
        n = len(self.token_ids)
        if not self.weight_versions:
            self.weight_versions = [-1] * n
        if len(self.loss_mask) != n or len(self.rollout_logprobs) != n or len(self.weight_versions) != n:
            raise ValueError(f"segment {self.rollout_id}/{self.segment_index}: token_ids ({n}), loss_mask "
                             f"({len(self.loss_mask)}), rollout_logprobs ({len(self.rollout_logprobs)}) and "
                             f"weight_versions ({len(self.weight_versions)}) differ")
        for key, value in (self.replay or {}).items():
            if key == "indexer_replay":  # sparse rows (rollout/indexer_replay.py), not a row a token
                if len(value["positions"]) and int(value["positions"].max()) >= n:
                    raise ValueError(f"segment {self.rollout_id}/{self.segment_index}: indexer rows at positions "
                                     f"up to {int(value['positions'].max())} for {n} tokens")
            elif len(value) != n:
                raise ValueError(f"segment {self.rollout_id}/{self.segment_index}: replay {key!r} covers "
                                 f"{len(value)} positions for {n} tokens")
        if any(not 0 <= position < n for position, _ in self.step_rewards):
            raise ValueError(f"segment {self.rollout_id}/{self.segment_index}: step rewards at positions "
                             f"{[p for p, _ in self.step_rewards]} for {n} tokens")

    @property
    def num_action_tokens(self) -> int:
        return sum(self.loss_mask)

    def sampled_versions(self) -> list[int]:
        """The weight versions of the trained (loss-masked) tokens."""
        return [v for v, m in zip(self.weight_versions, self.loss_mask) if m]


@dataclass
class Trajectory:
    """One task attempt: ordered segments sharing `rollout_id`, the graded reward and what happened."""

    rollout_id: str
    task_id: str
    segments: list[Segment]
    reward: float = 0.0
    passed: bool = False
    finish_reason: str = ""  # submitted | max_turns | max_tokens | context_exhausted | error
    domain: str = ""
    num_turns: int = 0
    num_tool_calls: int = 0
    num_malformed_calls: int = 0
    num_guard_flags: int = 0
    num_guard_blocks: int = 0
    num_compactions: int = 0
    grade_details: dict[str, Any] = field(default_factory=dict)
    guard_events: list[dict[str, Any]] = field(default_factory=list)
    timings: dict[str, float] = field(default_factory=dict)

    @property
    def num_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.segments)

    @property
    def num_action_tokens(self) -> int:
        return sum(s.num_action_tokens for s in self.segments)

    def oldest_version(self) -> int | None:
        """The oldest weight version among the trained tokens (None: no trained token)."""
        versions = [v for s in self.segments for v in s.sampled_versions()]
        return min(versions) if versions else None
