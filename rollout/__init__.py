"""Rollout: engines (the `Engine` contract, `LocalEngine`), chat formats and tool-call parsers, the agent loop
with compaction, trajectory types, and the Ray rollout worker."""

from rollout.agent import AgentEpisode, EpisodeRuntime
from rollout.chat import ChatFormat, Message, make_chat_format
from rollout.config import AgentConfig, CompactionConfig, EngineConfig
from rollout.engine import Engine
from rollout.local_engine import LocalEngine
from rollout.tool_parsers import ToolCallParser, make_tool_parser
from rollout.types import GenerateResult, SamplingParams, Segment, Trajectory
from rollout.worker import RolloutWorker

__all__ = ["AgentEpisode", "EpisodeRuntime", "ChatFormat", "Message", "make_chat_format", "AgentConfig",
           "CompactionConfig", "EngineConfig", "Engine", "LocalEngine", "ToolCallParser", "make_tool_parser",
           "GenerateResult", "SamplingParams", "Segment", "Trajectory", "RolloutWorker"]
