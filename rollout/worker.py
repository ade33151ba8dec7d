"""Ray rollout worker: an engine replica, a guard, and concurrent agent episodes on it.

The driver submits one `run_episode` call per task; the worker is an async Ray actor, so calls overlap and the
LocalEngine batches their generation requests. Weights arrive in buckets from the trainer, between steps or (the
asynchronous loop) while episodes run: their generations pause, and go on with the new weights.
"""

from __future__ import annotations

import asyncio
import copy
import json
import os

import torch

from antihack import Guard
from antihack.config import GuardConfig
from environments import TOOL_SPECS, Task
from rollout.agent import AgentEpisode, EpisodeRuntime
from rollout.chat import make_chat_format
from rollout.config import AgentConfig, EngineConfig
from rollout.guard import build_guard
from rollout.local_engine import LocalEngine
from rollout.sglang.engine import SGLangEngine
from rollout.tool_parsers import make_tool_parser
from rollout.types import SamplingParams, Trajectory

ABORT_GRACE_S = 10.0  # after abort(), how long an episode may take to stop before it is left to end on its own


class WorkerNeedsWeights(RuntimeError):
    """A worker that Ray restarted refuses episodes until it has been given the current weights (or, on SGLang,
    the served version): its engine would otherwise run the initial ones."""


def _restarted_by_ray() -> bool:
    import warnings

    import ray

    if not ray.is_initialized():  # in-process (rl.evaluate, tests): asking would start a Ray of its own
        return False
    try:
        with warnings.catch_warnings():  # the property reads a deprecated attribute of Ray's own
            warnings.simplefilter("ignore")
            return bool(ray.get_runtime_context().was_current_actor_reconstructed)
    except Exception:  # not in a Ray actor (tests, tools)
        return False


class RolloutWorker:
    def __init__(self, model_path: str, engine: EngineConfig, agent: AgentConfig, guard: GuardConfig | Guard,
                 chat_format: str = "chatml", tool_format: str = "json", sandbox_backend: str = "bwrap",
                 sandbox_limits: dict | None = None, reward: str = "pass_fraction", grade_timeout_s: float = 60.0,
                 worker_index: int = 0, sglang_endpoint: dict | None = None, episode_log: str = "",
                 episode_log_every: int = 0):
        # Ray sets OMP_NUM_THREADS=1 in workers without CPUs reserved: choose the thread count ourselves.
        torch.set_num_threads(engine.torch_threads or os.cpu_count() or 1)
        agent.validate()
        if isinstance(guard, GuardConfig):  # built here: an engine-backed judge cannot travel between processes
            guard = build_guard(guard, initial_policy=model_path)
        self.index = worker_index
        self.engine_cfg = engine
        if engine.type == "sglang":
            self.engine = make_sglang_engine(model_path, engine, sglang_endpoint or {})
        else:
            device = engine.device if engine.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
            self.engine = LocalEngine.from_pretrained(model_path, dtype=engine.dtype, device=device,
                                                      max_batch_size=engine.max_batch_size,
                                                      speculative_steps=engine.speculative_steps,
                                                      return_routed_experts=engine.return_routed_experts,
                                                      indexer_replay_margin=engine.indexer_replay_margin)
        self.runtime = EpisodeRuntime(
            engine=self.engine, tokenizer=self.engine.tokenizer, chat=make_chat_format(chat_format),
            parser=make_tool_parser(tool_format, TOOL_SPECS), guard=guard, config=agent,
            sandbox_backend=sandbox_backend, sandbox_limits=dict(sandbox_limits or {}), reward=reward,
            grade_timeout_s=grade_timeout_s)
        self._pending: dict[str, torch.Tensor] = {}
        self._episodes: dict[str, AgentEpisode] = {}  # rollout id → running episode (for abort_episodes)
        self._needs_weights = _restarted_by_ray()  # cleared by commit_weights / set_weight_version
        # every `episode_log_every`-th finished episode of each mode, decoded, appended to `episode_log` (JSONL)
        self.episode_log, self.episode_log_every = episode_log, episode_log_every
        self._finished: dict[str, int] = {}
        if episode_log and episode_log_every:
            os.makedirs(os.path.dirname(episode_log) or ".", exist_ok=True)

    def sampling(self, mode: str, seed: int | None) -> SamplingParams:
        e = self.engine_cfg
        temperature = e.eval_temperature if mode == "eval" else e.temperature
        return SamplingParams(temperature=temperature, top_p=e.top_p, top_k=e.top_k, seed=seed)

    async def run_episode(self, task: Task, mode: str = "train", seed: int | None = None,
                          rollout_id: str | None = None) -> Trajectory:
        """One episode. Past `agent.episode_timeout_s` it is aborted (finish reason "aborted", grade_details'
        "aborted": "timeout"); one stuck where an abort cannot reach it (a hung tool call or grading) is returned
        as it stands after ABORT_GRACE_S and left to end by itself, closing its sandbox."""
        if self._needs_weights:
            raise WorkerNeedsWeights(f"rollout worker {self.index} was restarted and has no current weights yet")
        if getattr(self.engine, "failed", False):  # its serving loop gave up: let Ray restart the process
            os._exit(70)
        episode = AgentEpisode(self.runtime, task, self.sampling(mode, seed), rollout_id)
        self._episodes[episode.rollout_id] = episode
        running = asyncio.ensure_future(episode.run())
        running.add_done_callback(lambda _: self._episodes.pop(episode.rollout_id, None))
        timeout = self.runtime.config.episode_timeout_s or None
        done, _ = await asyncio.wait({running}, timeout=timeout)
        if not done:
            await episode.abort("timeout")
            done, _ = await asyncio.wait({running}, timeout=ABORT_GRACE_S)
        if done:
            traj = running.result()
        else:
            traj = copy.deepcopy(episode.traj)
            traj.finish_reason = "aborted"
            traj.grade_details["aborted"] = episode.abort_reason
        self._log_episode(mode, traj)
        return traj

    def _log_episode(self, mode: str, traj: Trajectory) -> None:
        """What the policy actually wrote, for a reader: the segments as text (special tokens kept), with the
        outcome. Sampled (every `episode_log_every`-th per mode) so that the file stays readable in size."""
        if not self.episode_log or not self.episode_log_every:
            return
        n = self._finished[mode] = self._finished.get(mode, 0) + 1
        if (n - 1) % self.episode_log_every:
            return
        decode = self.runtime.tokenizer.decode
        record = {"worker": self.index, "mode": mode, "n": n, "rollout_id": traj.rollout_id, "task": traj.task_id,
                  "reward": traj.reward, "passed": traj.passed, "finish": traj.finish_reason,
                  "turns": traj.num_turns, "tool_calls": traj.num_tool_calls,
                  "malformed_calls": traj.num_malformed_calls, "compactions": traj.num_compactions,
                  "segments": [{"type": s.segment_type, "tokens": len(s.token_ids),
                                "text": decode(s.token_ids, skip_special_tokens=False)} for s in traj.segments]}
        with open(self.episode_log, "a") as f:
            f.write(json.dumps(record) + "\n")

    async def abort_episodes(self, rollout_ids: list[str], reason: str) -> int:
        """Abort these running episodes (unknown ids are ignored); returns how many were running."""
        episodes = [self._episodes[r] for r in rollout_ids if r in self._episodes]
        await asyncio.gather(*(e.abort(reason) for e in episodes))
        return len(episodes)

    # ---- weight sync (receiving side) -----------------------------------------------------------------
    async def receive_bucket(self, bucket: dict[str, torch.Tensor]) -> int:
        """Stage one bucket; applied all at once by `commit_weights` so no request sees half an update."""
        self._pending.update(bucket)
        return sum(t.numel() * t.element_size() for t in bucket.values())

    async def commit_weights(self, version: int) -> dict:
        await self.engine.pause()
        try:
            await self.engine.update_weights(self._pending, version)
        finally:
            self._pending = {}
            await self.engine.resume()
        self._needs_weights = False
        return {"worker": self.index, "weight_version": self.engine.weight_version}

    async def set_weight_version(self, version: int) -> None:
        """The fleet now serves `version` (an SGLang engine takes samples from servers at that version only)."""
        if isinstance(self.engine, SGLangEngine):
            self.engine.set_weight_version(version)
        self._needs_weights = False

    async def engine_metrics(self) -> dict:
        """Since the last call: the engine's busy fraction and its counters (requests and prefix cache on SGLang,
        speculative decoding on the LocalEngine)."""
        return self.engine.usage_metrics()

    async def engine_weights(self) -> dict[str, torch.Tensor]:
        """The engine's current parameters (for verifying a sync)."""
        return {k: v.detach().cpu().clone() for k, v in self.engine.model.named_parameters()}

    async def guard_metrics(self, reset: bool = True) -> dict:
        stats = self.runtime.guard.stats
        out = stats.as_metrics()
        if reset:
            self.runtime.guard.stats = type(stats)()
        return out

    async def health(self) -> dict:
        return {"worker": self.index, "pid": os.getpid(), **(await self.engine.health())}

    async def shutdown(self) -> None:
        if isinstance(self.engine, SGLangEngine):
            await self.engine.close()
        else:
            self.engine.close()


def make_sglang_engine(model_path: str, engine: EngineConfig, endpoint: dict) -> SGLangEngine:
    """An SGLangEngine on the fleet's endpoint, asking for the replay data the config wants."""
    import json
    from pathlib import Path

    from models import load_tokenizer

    cfg = engine.sglang
    if engine.indexer_replay_margin > 0:
        raise ValueError("engine.indexer_replay_margin: SGLang reports no indexer margins; it is the LocalEngine's "
                         "for now (engine.type=local)")
    replay: dict[str, int] = {}
    if engine.return_routed_experts or cfg.return_indexer_topk:
        model_cfg = json.loads((Path(model_path) / "config.json").read_text())
        if engine.return_routed_experts:
            if "num_experts_per_tok" not in model_cfg:
                raise ValueError(f"engine.return_routed_experts: {model_path} is not a MoE model (no "
                                 "num_experts_per_tok in its config.json)")
            replay["routed_experts"] = int(model_cfg["num_experts_per_tok"])
        if cfg.return_indexer_topk:
            replay["indexer_topk"] = int(model_cfg["index_topk"])
    return SGLangEngine(endpoint.get("urls"), endpoint.get("router_url"), tokenizer=load_tokenizer(model_path),
                        request_timeout_s=cfg.request_timeout_s, max_retries=cfg.max_retries,
                        health_interval_s=cfg.health_interval_s, replay_top_k=replay)

