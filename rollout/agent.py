"""The agent loop: one task attempt, multi-turn with tools, token in / token out, guarded, compacted.

    render(system + task) → ids ─► engine.generate ─► parse tool calls ─► guard ─► sandbox (or dummy)
          ▲                                                                           │
          └──────────── observation tokens appended with loss mask 0 ◄───────────────┘

Before each turn, if the prompt has reached context_window - reserve, the policy writes a summary and the
context is rebuilt in a new segment (same rollout_id). At the end the workspace is graded in a fresh sandbox.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass, field

from antihack import Guard, GuardContext
from environments import Observation, Task, ToolCall, collect_files, execute_tool, grade, make_sandbox
from environments.sandbox import task_sandbox_options
from environments.grading import setup_workspace
from rollout.chat import ChatFormat, Message
from rollout.compaction import (SUMMARY_INSTRUCTION, atomic_steps, rebuilt_context,
                                shrink_largest_observation)
from rollout.config import AgentConfig
from rollout.engine import Engine
from rollout.ledger import TokenLedger
from rollout.tool_parsers import ToolCallParser, last_python_block
from rollout.types import SamplingParams, Trajectory

MIN_TURN_TOKENS = 16  # a turn with less room than this cannot say anything useful


@dataclass
class EpisodeRuntime:
    """Everything an episode needs from the worker that runs it."""

    engine: Engine
    tokenizer: object
    chat: ChatFormat
    parser: ToolCallParser
    guard: Guard
    config: AgentConfig
    sandbox_backend: str = "bwrap"
    sandbox_limits: dict = field(default_factory=dict)
    reward: str = "pass_fraction"
    grade_timeout_s: float = 60.0

    def encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def decode(self, ids: list[int], special: bool) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=not special)


class SandboxStartError(RuntimeError):
    pass


class _LazySandbox:
    """The episode's sandbox while it may still be starting: `get()` waits for it (once)."""

    def __init__(self, starting: asyncio.Future):
        self._starting = starting

    async def get(self):
        try:
            return await self._starting
        except Exception as exc:
            raise SandboxStartError("the sandbox could not start") from exc

    async def close(self) -> None:
        if not self._starting.done():
            try:
                await self._starting
            except Exception:
                return
        if self._starting.cancelled() or self._starting.exception() is not None:
            return
        await asyncio.to_thread(self._starting.result().close)


def system_prompt(rt: EpisodeRuntime) -> str:
    example = rt.parser.format_call(ToolCall("write_file", {"path": "hello.py", "content": "print('hello')\n"}))
    text = ("You are a coding agent in a sandbox. The task's project is your current directory, /workspace. "
            f"No network.\n{rt.parser.instructions()}\nExample:\n{example}\n"
            "One tool call per reply; call submit when the task is done.")
    if rt.config.code_block_answer:
        text += "\nOr reply with the final solution as one ```python block: it is saved to the main file and submitted."
    return text


def task_message(task: Task, files_in_prompt_chars: int = 3000) -> str:
    """The statement, the starting source files when they are short (`agent.files_in_prompt_chars`), and where
    the visible tests are (their text is left out: small models copy test code instead of solving the task)."""
    text = f"Task: {task.statement}\n\nThe main file is {task.entry_file}."
    if files_in_prompt_chars > 0 and sum(len(f.content) for f in task.files) <= files_in_prompt_chars:
        for f in task.files:
            text += f"\n\n{f.path}:\n```python\n{f.content.rstrip()}\n```"
    else:
        text += "\nFiles: " + ", ".join(f.path for f in task.files)
    if task.visible_tests:
        text += "\n\nVisible tests: " + ", ".join(f.path for f in task.visible_tests) + " (run them with run_tests)."
    return text


class AgentEpisode:
    def __init__(self, rt: EpisodeRuntime, task: Task, sampling: SamplingParams, rollout_id: str | None = None):
        self.rt, self.task, self.cfg = rt, task, rt.config
        stops = tuple(rt.chat.stop_token_ids(rt.tokenizer))
        self.sampling = sampling.replace(stop_token_ids=tuple(sampling.stop_token_ids) + stops)
        self.rollout_id = rollout_id or uuid.uuid4().hex[:12]
        self.system = Message("system", system_prompt(rt))
        self.task_msg = Message("user", task_message(task, rt.config.files_in_prompt_chars))
        self.history: list[Message] = [self.system, self.task_msg]  # the current context, as messages
        self.ledger = TokenLedger()
        self.traj = Trajectory(self.rollout_id, task.id, [], domain=task.domain)
        self.guard_ctx = GuardContext.for_task(task)
        self.sampled = 0  # tokens sampled over the whole episode
        self.turns_in_context = 0  # turns since the start or the last compaction
        self.generate_calls = 0  # turns and summaries: each call gets its own seed and request id
        self.header_len = len(rt.encode(rt.chat.generation_prompt()))
        self.timings = {"generate_s": 0.0, "tool_s": 0.0, "guard_s": 0.0, "grade_s": 0.0}
        self.abort_reason = ""  # set by abort(): the loop ends at its next step, the trajectory is not graded
        self._request_id: str | None = None  # the generation in flight

    async def abort(self, reason: str) -> None:
        """End the episode early (a timeout, or too stale to train on): the generation in flight is aborted and
        the loop stops before its next step. Idempotent."""
        if self.abort_reason:
            return
        self.abort_reason = reason
        if self._request_id is not None:
            await self.rt.engine.abort([self._request_id])

    # ---- helpers --------------------------------------------------------------------------------------
    async def _generate(self, ledger: TokenLedger, max_new: int):
        started = time.perf_counter()
        call = self.generate_calls
        self.generate_calls += 1
        seed = None if self.sampling.seed is None else self.sampling.seed + call * 7919
        self._request_id = f"{self.rollout_id}-{call}"
        try:
            result = await self.rt.engine.generate(ledger.ids, self.sampling.replace(max_new_tokens=max_new, seed=seed),
                                                   request_id=self._request_id, session_id=self.rollout_id)
        finally:
            self._request_id = None
        self.timings["generate_s"] += time.perf_counter() - started
        ledger.append_output(result.output_ids, result.output_logprobs, result.versions(),
                             routing=result.meta.pop("routed_experts", None),
                             indexer_rows=result.meta.pop("indexer_replay", None))
        self.sampled += len(result.output_ids)
        return result

    def _close_segment(self, ledger: TokenLedger, segment_type: str) -> None:
        """Record the ledger as a segment (if it holds any sampled token) and empty it."""
        if ledger.ids and any(ledger.mask):
            self.traj.segments.append(ledger.to_segment(self.rollout_id, len(self.traj.segments), segment_type))
        ledger.clear()

    def _can_compact(self) -> bool:
        comp = self.cfg.compaction
        return comp.enabled and self.turns_in_context > 0 and self.traj.num_compactions < comp.max_compactions

    def _prompt_len(self) -> int:
        return len(self.ledger) + self.header_len

    # ---- the loop -------------------------------------------------------------------------------------
    async def _start_sandbox(self):
        """Make the episode's sandbox and its workspace. Started as a task next to the first generation, which
        needs no sandbox: the episode never waits for start-up it could overlap (Docker's is ~0.5 s)."""
        options = {**self.rt.sandbox_limits, **task_sandbox_options(self.task, self.rt.sandbox_backend)}
        sandbox = await asyncio.to_thread(make_sandbox, self.rt.sandbox_backend, **options)
        try:
            await asyncio.to_thread(setup_workspace, sandbox.workspace, self.task.files + self.task.visible_tests,
                                    getattr(sandbox, "uid", None))
        except BaseException:
            await asyncio.to_thread(sandbox.close)
            raise
        return sandbox

    async def run(self) -> Trajectory:
        started = time.perf_counter()
        starting = asyncio.ensure_future(self._start_sandbox())
        sandbox = _LazySandbox(starting)
        try:
            self.ledger.append_context(self.rt.encode(self.rt.chat.render(self.history, add_generation_prompt=False)))
            self.traj.finish_reason = await self._loop(sandbox)
            self._close_segment(self.ledger, "final")
            if self.abort_reason:  # even if the loop got as far as submitting: ungraded, so never trained on
                self.traj.finish_reason = "aborted"
                self.traj.grade_details["aborted"] = self.abort_reason
            elif self.traj.finish_reason != "aborted":
                files = await asyncio.to_thread(collect_files, (await sandbox.get()).workspace)
                t0 = time.perf_counter()
                result = await asyncio.to_thread(grade, self.task, files, self.rt.sandbox_backend, self.rt.reward,
                                                 self.rt.grade_timeout_s, **self.rt.sandbox_limits)
                self.timings["grade_s"] = time.perf_counter() - t0
                self.traj.reward, self.traj.passed = result.reward, result.all_passed
                self.traj.grade_details = {**result.details, **self.traj.grade_details}
        except SandboxStartError as exc:  # no sandbox, no episode: report it, the run goes on
            self.traj.finish_reason = "error"
            self.traj.grade_details = {"error": f"sandbox start failed: {exc.__cause__!r}"}
        except Exception as exc:
            self.traj.finish_reason = "error"
            self.traj.grade_details = {"error": repr(exc)}
        finally:
            await sandbox.close()
        self.timings["episode_s"] = time.perf_counter() - started
        self.traj.timings = self.timings
        return self.traj

    async def _loop(self, sandbox) -> str:
        cfg, rt = self.cfg, self.rt
        while True:
            if self.abort_reason:
                return "aborted"
            if self.traj.num_turns >= cfg.max_turns:
                return "max_turns"
            budget = cfg.max_episode_tokens - self.sampled
            if budget <= 0:
                return "max_tokens"
            if self._prompt_len() >= cfg.context_window - cfg.compaction.reserve and self._can_compact():
                if not await self._compact():
                    return "context_exhausted"
                continue
            max_new = min(cfg.max_new_tokens, cfg.context_window - self._prompt_len(), budget)
            if max_new < MIN_TURN_TOKENS:  # no compaction left (or nothing to compact) and the window is full
                return "context_exhausted"
            self.ledger.append_context(rt.encode(rt.chat.generation_prompt()))
            result = await self._generate(self.ledger, max_new)
            self.traj.num_turns += 1
            self.turns_in_context += 1
            if result.finish_reason == "abort":
                return "aborted"
            text = rt.decode(result.output_ids, special=False)
            self.history.append(Message("assistant", text))
            observations, submitted = await self._act(sandbox, text)
            if submitted:
                return "submitted"
            raw_output = rt.decode(result.output_ids[-4:], special=True)
            self.ledger.append_context(rt.encode(rt.chat.continuation(observations, raw_output)))
            self.history += observations

    async def _act(self, sandbox, text: str) -> tuple[list[Message], bool]:
        """Run the tool calls of one reply; returns the observation messages and whether the agent submitted."""
        parsed = self.rt.parser.parse(text)
        calls = parsed.calls
        if not calls and not parsed.errors and self.cfg.code_block_answer:
            code = last_python_block(text)
            if code is not None:
                calls = [ToolCall("write_file", {"path": self.task.entry_file, "content": code}),
                         ToolCall("submit", {})]
        if parsed.errors:
            self.traj.num_malformed_calls += len(parsed.errors)
            self.ledger.reward_last_output(self.cfg.malformed_call_reward * len(parsed.errors))
        if not calls:
            hint = ("Error: " + "; ".join(parsed.errors)) if parsed.errors else (
                "No tool call found. Call a tool to act, or submit when you are done.")
            return [Message("tool", hint)], False
        observations, submitted = [], False
        for call in calls:
            obs = await self._call(sandbox, call)
            observations.append(Message("tool", obs.text))
            if obs.submitted:
                submitted = True
                break
        for error in parsed.errors:
            observations.append(Message("tool", f"Error: {error}"))
        return observations, submitted

    async def _call(self, sandbox, call: ToolCall) -> Observation:
        self.traj.num_tool_calls += 1
        self.guard_ctx.turn = self.traj.num_turns
        verdict = await self.rt.guard.acheck(call, self.guard_ctx)
        self.timings["guard_s"] += verdict.latency
        if verdict.flagged:
            self.traj.num_guard_flags += 1
        event = {"turn": self.traj.num_turns, "segment": len(self.traj.segments), "call": call.describe(),
                 "rules": verdict.rule_ids, "action": verdict.action, "stage": verdict.stage,
                 "category": verdict.category, "reason": verdict.reason, "judge": verdict.judge,
                 "rules_ms": round(1000 * verdict.rules_latency, 3), "judge_ms": round(1000 * verdict.judge_latency, 1)}
        if verdict.action == "block":
            self.traj.num_guard_blocks += 1
            dummy = self.rt.guard.dummy_observation(call, verdict)
            event["observation"] = dummy.text
            self.traj.guard_events.append(event)
            if self.cfg.train_blocked_tokens == "mask":
                self.ledger.mask_last_output()
            return Observation(dummy.text, dummy.exit_code)
        if verdict.flagged:
            self.traj.guard_events.append(event)
        box = await sandbox.get()  # a sandbox that could not start ends the episode (SandboxStartError)
        started = time.perf_counter()
        try:
            obs = await asyncio.to_thread(execute_tool, call, box, self.task, self.cfg.tool_timeout_s,
                                          self.cfg.observation_max_chars)
        except Exception as exc:  # a crashing sandbox call is an observation, not a lost episode
            obs = Observation(f"Error: the sandbox failed to run this call ({type(exc).__name__}: {exc})", 1)
        self.timings["tool_s"] += time.perf_counter() - started
        return obs

    # ---- compaction -----------------------------------------------------------------------------------
    async def _compact(self) -> bool:
        cfg, rt, comp = self.cfg, self.rt, self.cfg.compaction
        instruction = Message("user", SUMMARY_INSTRUCTION.format(budget=comp.summary_max_tokens))
        request = rt.encode(rt.chat.render_message(instruction) + rt.chat.generation_prompt())
        if len(self.ledger) + len(request) + comp.summary_max_tokens <= cfg.context_window:
            # The summary continues the live segment, which then closes with it.
            self.ledger.append_context(request)
            result = await self._generate(self.ledger, comp.summary_max_tokens)
            self._close_segment(self.ledger, "summary_closed")
        else:
            # Too full to ask in place: close the live segment, and sample the note from a copy of the history
            # with the largest observations shortened, recorded as its own segment (exact token provenance).
            self._close_segment(self.ledger, "compacted")
            temp = list(self.history) + [instruction]
            while len(rt.encode(rt.chat.render(temp))) + comp.summary_max_tokens > cfg.context_window:
                if not shrink_largest_observation(temp):
                    return False
            summary_ledger = TokenLedger()
            summary_ledger.append_context(rt.encode(rt.chat.render(temp)))
            result = await self._generate(summary_ledger, comp.summary_max_tokens)
            self._close_segment(summary_ledger, "summary_closed")
        if result.finish_reason == "abort":
            return False
        summary = rt.decode(result.output_ids, special=False)
        steps = atomic_steps(self.history[1:])
        limit = cfg.context_window - comp.reserve
        for keep in range(min(comp.keep_recent_steps, len(steps)), -1, -1):
            recent = steps[len(steps) - keep:] if keep else []
            messages = rebuilt_context(self.system, self.task_msg if comp.include_task else None, summary, recent)
            ids = rt.encode(rt.chat.render(messages, add_generation_prompt=False))
            if len(ids) + len(rt.encode(rt.chat.generation_prompt())) < limit:
                self.ledger = TokenLedger()
                self.ledger.append_context(ids)
                self.history = messages
                self.traj.num_compactions += 1
                self.turns_in_context = 0
                self.traj.grade_details.setdefault("compaction_kept_steps", []).append(keep)
                return True
        return False
