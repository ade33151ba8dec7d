"""Token ledger of one segment: what the engine saw and sampled, with loss masks and behaviour logprobs."""

from __future__ import annotations

from dataclasses import dataclass, field

from rollout.types import Segment


@dataclass
class TokenLedger:
    ids: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)  # per token: the weight version that sampled it, or -1
    _last_output: tuple[int, int] | None = None  # [start, end) of the latest sampled output

    def __len__(self) -> int:
        return len(self.ids)

    def append_context(self, ids: list[int]) -> None:
        """Prompt, template, observation or copied text: never trained (loss mask 0)."""
        self.ids += ids
        self.mask += [0] * len(ids)
        self.logprobs += [0.0] * len(ids)
        self.versions += [-1] * len(ids)

    def append_output(self, ids: list[int], logprobs: list[float], versions: list[int] | int) -> None:
        """Tokens the policy sampled, with their behaviour logprobs (loss mask 1) and the weight version that
        sampled each (one int: all of them)."""
        if isinstance(versions, int):
            versions = [versions] * len(ids)
        if not len(ids) == len(logprobs) == len(versions):
            raise ValueError(f"{len(ids)} output ids, {len(logprobs)} logprobs, {len(versions)} versions")
        start = len(self.ids)
        self.ids += ids
        self.mask += [1] * len(ids)
        self.logprobs += list(logprobs)
        self.versions += list(versions)
        self._last_output = (start, len(self.ids))

    def clear(self) -> None:
        self.ids, self.mask, self.logprobs, self.versions, self._last_output = [], [], [], [], None

    def mask_last_output(self) -> None:
        if self._last_output:
            start, end = self._last_output
            self.mask[start:end] = [0] * (end - start)

    def to_segment(self, rollout_id: str, index: int, segment_type: str) -> Segment:
        return Segment(rollout_id, index, list(self.ids), list(self.mask), list(self.logprobs), segment_type,
                       list(self.versions))
