"""The `rollout.Engine` contract (docs/DESIGN.md §4): token in, token out, with the sampled tokens' logprobs."""

from __future__ import annotations

from pathlib import Path
from typing import Mapping, Protocol, runtime_checkable

import torch

from rollout.types import GenerateResult, SamplingParams


@runtime_checkable
class Engine(Protocol):
    """What every inference backend provides. Implementations: `LocalEngine` (in-process torch),
    `SGLangEngine` (an SGLang server fleet)."""

    weight_version: int

    async def generate(self, input_ids: list[int], sampling: SamplingParams, request_id: str | None = None,
                       session_id: str | None = None) -> GenerateResult:
        """`session_id` (the episode) keeps the turns of one episode on one server: its prefix cache."""

    async def update_weights(self, weights: Mapping[str, torch.Tensor] | str | Path,
                             version: int | None = None) -> None: ...

    async def pause(self) -> None: ...

    async def resume(self) -> None: ...

    async def abort(self, request_ids: list[str]) -> None: ...

    async def health(self) -> dict: ...
