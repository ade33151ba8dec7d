"""Token ledger of one segment: what the engine saw and sampled, with loss masks, behaviour logprobs and the
experts that routed each token."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import numpy as np

from rollout.types import Segment

log = logging.getLogger(__name__)


@dataclass
class TokenLedger:
    ids: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)  # per token: the weight version that sampled it, or -1
    # [positions, layers, k] int16: the experts the engine routed each position to (MoE replay), from the latest
    # generation, which ran every position before its last token; None when the engine reports none
    routing: np.ndarray | None = None
    # the indexer rows under the engine's margin (sparse), each position's from the first generation that ran it
    indexer_rows: dict | None = None
    _indexer_ran: int = 0  # positions some generation has run
    step_rewards: list[tuple[int, float]] = field(default_factory=list)  # (position, reward) before the end
    _last_output: tuple[int, int] | None = None  # [start, end) of the latest sampled output

    def __len__(self) -> int:
        return len(self.ids)

    def append_context(self, ids: list[int]) -> None:
        """Prompt, template, observation or copied text: never trained (loss mask 0)."""
        self.ids += ids
        self.mask += [0] * len(ids)
        self.logprobs += [0.0] * len(ids)
        self.versions += [-1] * len(ids)

    def append_output(self, ids: list[int], logprobs: list[float], versions: list[int] | int,
                      routing=None, indexer_rows=None) -> None:
        """Tokens the policy sampled, with their behaviour logprobs (loss mask 1) and the weight version that
        sampled each (one int: all of them). `routing` ([positions, layers, k]): the experts of every position the
        engine ran for this generation, the whole ledger but the last token (SGLang's `routed_experts`).
        `indexer_rows`: the generation's indexer rows under the engine's margin (rollout/indexer_replay.py). Unlike
        the routing, earlier rows stay: the tokens an earlier generation sampled depend on the choices it made, and
        a near-tied row can flip when a later generation runs the same positions again (the LocalEngine prefills
        the whole context anew); the new generation adds the rows of the positions it ran first."""
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
        if routing is not None:
            self._record_routing(np.asarray(routing))
        if indexer_rows is not None:  # the generation ran every position but its last sampled token
            self._record_indexer_rows(indexer_rows, ran_before=self._indexer_ran)
            self._indexer_ran = len(self.ids) - 1

    def _record_indexer_rows(self, rows: dict, ran_before: int) -> None:
        new = rows["positions"] >= ran_before
        if self.indexer_rows is None:
            self.indexer_rows = {name: value[new] for name, value in rows.items()}
            return
        self.indexer_rows = {name: np.concatenate([self.indexer_rows[name], value[new]])
                             for name, value in rows.items()}

    def _record_routing(self, routing: np.ndarray) -> None:
        """The latest generation's routing replaces what came before: it covers every earlier position, as the
        engine ran (or, with a prefix cache, kept) them for the tokens it just sampled."""
        if routing.ndim != 3 or routing.shape[0] != len(self.ids) - 1:
            # an engine that reported another span than it was given: keep the earlier routing; the positions
            # it does not cover train on the model's own
            log.warning("routing of shape %s for a ledger of %d tokens (expected %d positions): not replayed",
                        routing.shape, len(self.ids), len(self.ids) - 1)
            return
        self.routing = routing.astype(np.int16, copy=False)

    def clear(self) -> None:
        self.ids, self.mask, self.logprobs, self.versions, self._last_output = [], [], [], [], None
        self.step_rewards = []
        self.routing = None
        self.indexer_rows, self._indexer_ran = None, 0

    def mask_last_output(self) -> None:
        if self._last_output:
            start, end = self._last_output
            self.mask[start:end] = [0] * (end - start)

    def reward_last_output(self, reward: float) -> None:
        """A reward (a penalty when negative) for the latest sampled output, on its last token."""
        if self._last_output and reward:
            self.step_rewards.append((self._last_output[1] - 1, float(reward)))

    def routed_experts(self) -> np.ndarray | None:
        """[len, layers, k] int16 aligned with `ids`: −1 where no generation ran the position (the tokens after
        the last one, whose routing no sampled token depends on)."""
        if self.routing is None:
            return None
        out = np.full((len(self.ids), *self.routing.shape[1:]), -1, dtype=np.int16)
        out[:len(self.routing)] = self.routing
        return out

    def to_segment(self, rollout_id: str, index: int, segment_type: str) -> Segment:
        replay = {}
        if (routing := self.routed_experts()) is not None:
            replay["routed_experts"] = routing
        if self.indexer_rows is not None:
            replay["indexer_replay"] = self.indexer_rows
        return Segment(rollout_id, index, list(self.ids), list(self.mask), list(self.logprobs), segment_type,
                       list(self.versions), replay or None, list(self.step_rewards))
