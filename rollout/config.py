"""Configuration of the rollout side: the engine, the agent loop and compaction (one dataclass each)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

SUMMARY_INSTRUCTION_TOKENS = 256  # upper bound of the summary instruction message, tokenised
# SGLang server flags that choose the decode CUDA graphs' batch sizes themselves (0.5.17 spellings and older ones)
CUDA_GRAPH_BATCH_FLAGS = ("cuda-graph-max-bs", "cuda-graph-max-bs-decode", "cuda-graph-bs", "cuda-graph-bs-decode",
                          "disable-cuda-graph", "disable-decode-cuda-graph", "cuda-graph-backend-decode",
                          "cuda-graph-config")
# Above this many requests in flight the server's own choice stands (SGLang 0.5.17: 256 on an 80-160 GB GPU at tp < 4)
CUDA_GRAPH_DERIVED_MAX = 256


@dataclass
class SGLangConfig:
    """engine.type=sglang: a fleet of SGLang servers (rollout/sglang/), launched as Ray actors or attached to.

    `args` go to `python -m sglang.launch_server` unchanged (`{"tp": 2, "mem-fraction-static": 0.3}` becomes
    `--tp 2 --mem-fraction-static 0.3`; true adds a bare flag, false or null leaves the flag out, a list repeats
    its values). The model path, host and port are set by the launcher.
    """

    urls: list[str] = field(default_factory=list)  # attach to running servers instead of launching them
    router_url: str = ""  # attach to a running sglang-router
    num_servers: int = 1
    gpus_per_server: float = 1.0  # Ray GPUs of each server actor (its --tp size, usually)
    launch_command: list[str] = field(default_factory=lambda: ["python", "-m", "sglang.launch_server"])
    host: str = "127.0.0.1"
    args: dict[str, Any] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)  # extra environment of the server processes
    startup_timeout_s: float = 900.0  # a cold start JIT-compiles kernels (minutes)
    # a start that fails because another process took GPU memory while the server loaded (servers or runs sharing
    # a GPU) is retried this many times, a random pause apart (rollout/sglang/server.py: MEMORY_RACE_MARKERS)
    memory_retries: int = 3
    request_timeout_s: float = 900.0
    max_retries: int = 3  # per request, on a dead server or an abort we did not ask for
    router: str = "auto"  # auto: sglang-router in front when num_servers > 1 | on | off (client-side affinity)
    router_policy: str = "consistent_hashing"
    weight_sync: str = "disk"  # tensor (colocated, CUDA IPC) | distributed (NCCL group) | disk (HF folder)
    weight_sync_fallback: str = ""  # e.g. disk: when a sync in `weight_sync` mode fails, log why and use this
    #                                 mode from then on (a run is not lost to a transport problem)
    weight_sync_dir: str = ""  # disk: a folder every server can read ("" = <run dir>/weights)
    pause_mode: str = "abort"  # during a weight update, in-flight requests are: abort (retried on the new
    #                            weights) | in_place (kept; they finish on the new weights: partial rollout)
    return_indexer_topk: bool = False  # (needs --enable-return-indexer-topk; 87 KB a token for GLM-5.2's top-2048)
    health_interval_s: float = 5.0
    max_restarts: int = 3  # per server over the run

    def problems(self, prefix: str = "engine.sglang") -> list[str]:
        out = [f"{prefix}.{key}={value!r}: must be one of {list(allowed)}" for key, value, allowed in (
            ("weight_sync", self.weight_sync, ("tensor", "distributed", "disk")),
            ("weight_sync_fallback", self.weight_sync_fallback, ("", "tensor", "distributed", "disk")),
            ("pause_mode", self.pause_mode, ("abort", "in_place", "retract")),
            ("router", self.router, ("auto", "on", "off"))) if value not in allowed]
        if self.num_servers < 1 and not self.urls and not self.router_url:
            out.append(f"{prefix}.num_servers must be >= 1 (or give {prefix}.urls)")
        if self.weight_sync == "tensor" and self.urls:
            out.append(f"{prefix}.weight_sync=tensor needs servers on the trainer's GPUs; attached servers "
                       f"({prefix}.urls) take distributed or disk")
        return out


@dataclass
class EngineConfig:
    type: str = "local"  # local | sglang
    num_workers: int = 1  # Ray rollout workers, each with its own engine replica
    max_batch_size: int = 32  # LocalEngine: requests decoded together
    speculative_steps: int = 0  # LocalEngine: > 0 drafts this many tokens a round with the model's MTP layer
    # MoE replay: each engine reports the experts it routed every token to, and the trainer's forwards (π_old,
    # π_ref, the update) use them instead of routing again (a MoE policy; SGLang: --enable-return-routed-experts,
    # added to the servers' arguments)
    return_routed_experts: bool = False
    # Indexer replay (GLM-5.2, the LocalEngine): τ > 0 ships the indexer's selection of every query whose top-k
    # margin is under τ, and the trainer replays those rows (rollout/indexer_replay.py; docs/DESIGN.md). τ must
    # be at least twice the largest score difference between the engine's indexer and the trainer's. 0: off.
    indexer_replay_margin: float = 0.0
    dtype: str = "float32"
    device: str = "auto"  # auto: the worker's GPU when Ray gave it one, else the CPU
    gpus_per_worker: float = 0.0  # Ray GPU share of each rollout worker (fractions colocate it with the trainer)
    torch_threads: int = 0  # 0: all cores of the worker
    max_concurrent_episodes: int = 32  # per worker
    # a rollout worker whose process dies is restarted (by Ray) this many times over the run, each time with the
    # current weights; its episodes in flight run again elsewhere (rl/rollout_manager.py)
    max_worker_restarts: int = 3
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    eval_temperature: float = 0.0  # held-out evaluation: greedy by default (pass@1)
    sglang: SGLangConfig = field(default_factory=SGLangConfig)

    def problems(self, prefix: str = "engine") -> list[str]:
        """What is wrong with these settings alone, each with its key (empty: nothing)."""
        out = [f"{prefix}.{key}={value!r}: must be one of {list(allowed)}" for key, value, allowed in (
            ("type", self.type, ("local", "sglang")), ("device", self.device.split(":")[0], ("auto", "cpu", "cuda")))
            if value not in allowed]
        if self.speculative_steps < 0 or (self.speculative_steps and self.type != "local"):
            out.append(f"{prefix}.speculative_steps={self.speculative_steps}: a count ≥ 0, for the LocalEngine "
                       "(SGLang servers take their own --speculative-* arguments in engine.sglang.args)")
        if self.num_workers < 1:
            out.append(f"{prefix}.num_workers must be >= 1")
        if self.indexer_replay_margin < 0 or (self.indexer_replay_margin and self.type != "local"):
            # SGLang reports no margins, and its top-k differs from the trainer's on 96-99% of positions by a key or
            # more (docs/BENCHMARKS.md): a margin gate there would ship nearly every row
            out.append(f"{prefix}.indexer_replay_margin={self.indexer_replay_margin}: τ ≥ 0, for the LocalEngine "
                       "(SGLang reports no indexer margins)")
        if self.type == "sglang":
            out += self.sglang.problems(f"{prefix}.sglang")
        return out

    @property
    def worker_max_calls(self) -> int:
        """Calls a rollout worker's Ray actor takes at once: its episodes, and 8 spare ones (weight pushes, stats,
        an evaluation starting beside training)."""
        return self.max_concurrent_episodes + 8

    def max_requests_in_flight(self) -> int:
        """The most generation requests the rollout workers can have open at once: each worker runs at most
        `worker_max_calls` episodes, each one request at a time."""
        return self.num_workers * self.worker_max_calls

    def server_config(self) -> SGLangConfig:
        """The fleet's settings, with the server flags the engine's options need.

        - `return_routed_experts` adds --enable-return-routed-experts.
        - The decode CUDA graphs are captured only up to the batch the workers can fill
          (--cuda-graph-max-bs-decode; 0.5.17's deprecated --cuda-graph-max-bs is its alias), unless
          engine.sglang.args choose the graphs' sizes. On an H200 at tp < 4, SGLang 0.5.17 captures 36 batch sizes
          up to 256 by default; a fleet fed by 64 episodes never batches more than 72 requests. A server of several
          gets no more than the fleet's total, so this bound holds whatever the router does. (Measured on an H100,
          2026-12-05: 21 decode graphs in 4.8 s; the prefill graphs, 58 sizes up to 8,192 tokens, took 70 s of a
          138-s start-up: docs/SGLANG.md.)
        """
        args = dict(self.sglang.args)
        if self.return_routed_experts:
            args = {"enable-return-routed-experts": True, **args}
        in_flight, given = self.max_requests_in_flight(), flags_given(args)
        if "max-running-requests" in given:  # the server batches no more than it lets run
            in_flight = min(in_flight, int(given["max-running-requests"]))
        if not chooses_cuda_graphs(args) and in_flight <= CUDA_GRAPH_DERIVED_MAX:
            args["cuda-graph-max-bs-decode"] = in_flight
        return dataclasses.replace(self.sglang, args=args)


def flag_name(key: Any) -> str:
    """An SGLang argument's name as its flag spells it: `cuda_graph_max_bs` and `--cuda-graph-max-bs` alike."""
    return str(key).lstrip("-").replace("_", "-")


def flags_given(args: dict[str, Any]) -> dict[str, Any]:
    """The flags SGLang server arguments pass, by flag name (false or null leaves a flag out)."""
    return {flag_name(key): value for key, value in args.items() if value not in (False, None)}


def chooses_cuda_graphs(args: dict[str, Any]) -> bool:
    """Whether SGLang server arguments choose the decode CUDA graphs themselves (any spelling)."""
    return not flags_given(args).keys().isdisjoint(CUDA_GRAPH_BATCH_FLAGS)


@dataclass
class CompactionConfig:
    """docs/ALGORITHMS.md §2: compact before a turn when the prompt reaches context_window - reserve."""

    enabled: bool = True
    reserve: int = 768  # Δ: must cover one turn, or one summary plus its instruction
    summary_max_tokens: int = 256
    max_compactions: int = 2
    keep_recent_steps: int = 2  # atomic steps copied verbatim (fallback 1, then 0)
    include_task: bool = True


@dataclass
class AgentConfig:
    context_window: int = 2048  # C: prompt + generation of one request
    max_turns: int = 8
    max_new_tokens: int = 256  # per turn
    max_episode_tokens: int = 2048  # sampled tokens over the whole episode (all segments)
    tool_timeout_s: float = 20.0
    # An episode still running after this long is aborted and not trained on (counted in rollout/dropped_aborted);
    # 0: no limit. Generation, tools and grading all count.
    episode_timeout_s: float = 1800.0
    observation_max_chars: int = 2000
    # A reply without a tool call but with a ```python block is taken as the final answer: written to the task's
    # entry file and submitted. Small policies write code blocks long before they learn tool syntax.
    code_block_answer: bool = True
    # Starting source files whose text is at most this many characters in all are shown in the task message (a
    # small function task needs no look around); longer ones, or all with 0, are listed by name only, so the
    # agent reads what it needs (long-horizon repository tasks).
    files_in_prompt_chars: int = 3000
    train_blocked_tokens: str = "keep"  # keep | mask: loss mask of a turn whose call the guard blocked
    # Reward for each tool call the parser could not read (≤ 0: a penalty), on the last token of the reply that
    # made it, so that GAE credits the reply that broke the protocol rather than the episode's end. 0: none (the
    # turn it wasted is the only cost). The graded reward still comes at the episode's end.
    malformed_call_reward: float = 0.0
    compaction: CompactionConfig = field(default_factory=CompactionConfig)

    def validate(self) -> None:
        c = self.compaction
        need = max(self.max_new_tokens, c.summary_max_tokens + SUMMARY_INSTRUCTION_TOKENS)
        if c.enabled and c.reserve < need:
            raise ValueError(f"agent.compaction.reserve ({c.reserve}) must cover one turn "
                             f"(max_new_tokens={self.max_new_tokens}) and one summary (summary_max_tokens="
                             f"{c.summary_max_tokens} + {SUMMARY_INSTRUCTION_TOKENS} for its instruction): >= {need}")
        if self.context_window <= c.reserve + 128:
            raise ValueError(f"agent.context_window ({self.context_window}) leaves no room for a prompt "
                             f"after the reserve ({c.reserve})")
        if self.episode_timeout_s < 0:
            raise ValueError(f"agent.episode_timeout_s must be >= 0 (0: no limit), got {self.episode_timeout_s}")
        if self.max_turns < 1 or self.max_new_tokens < 1:
            raise ValueError("agent.max_turns and agent.max_new_tokens must be >= 1")
        if self.train_blocked_tokens not in ("keep", "mask"):
            raise ValueError(f"agent.train_blocked_tokens must be 'keep' or 'mask', got {self.train_blocked_tokens!r}")
        if self.malformed_call_reward > 0:
            raise ValueError(f"agent.malformed_call_reward={self.malformed_call_reward} would pay for malformed tool "
                             "calls: use 0 (off) or a negative penalty such as -0.05")
