"""The agent loop against a scripted engine (replies fixed in advance) and, once, against the real LocalEngine."""

import asyncio
import json

import pytest

from antihack import Guard
from environments import TOOL_SPECS
from rollout.agent import AgentEpisode, EpisodeRuntime
from rollout.chat import make_chat_format
from rollout.compaction import RESUME_PREAMBLE
from rollout.config import AgentConfig, CompactionConfig
from rollout.tool_parsers import make_tool_parser
from rollout.types import GenerateResult, SamplingParams

SOLUTION = "def add(a, b):\n    return a + b\n"


def call(name, **arguments):
    return "<tool_call>" + json.dumps({"name": name, "arguments": arguments}) + "</tool_call>"


class ScriptedEngine:
    """Replies with the given texts in order (each closed by <|im_end|>), logprob -0.25 per token."""

    def __init__(self, tokenizer, replies):
        self.tokenizer, self.replies, self.weight_version = tokenizer, list(replies), 3
        self.prompts = []

    async def generate(self, input_ids, sampling, request_id=None, session_id=None):
        self.prompts.append(list(input_ids))
        text = self.replies.pop(0) if self.replies else "I have nothing more to say."
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"][:sampling.max_new_tokens - 1]
        ids.append(self.tokenizer.convert_tokens_to_ids("<|im_end|>"))
        return GenerateResult(ids, [-0.25] * len(ids), "stop", {"weight_version": self.weight_version})


def episode(tokenizer, task, replies, guard=None, **agent):
    cfg = AgentConfig(**{"context_window": 4096, "max_turns": 6, "max_new_tokens": 200,
                         "max_episode_tokens": 4000, **agent})
    cfg.validate()
    engine = ScriptedEngine(tokenizer, replies)
    rt = EpisodeRuntime(engine, tokenizer, make_chat_format("chatml"), make_tool_parser("json", TOOL_SPECS),
                        guard or Guard(), cfg)
    traj = asyncio.run(AgentEpisode(rt, task, SamplingParams(), "rid-1").run())
    return traj, engine


def text_of(tokenizer, seg, mask_value=None):
    ids = [t for t, m in zip(seg.token_ids, seg.loss_mask) if mask_value is None or m == mask_value]
    return tokenizer.decode(ids)


def test_tools_run_in_the_sandbox_and_the_work_is_graded(tokenizer, task_by_id):
    task = task_by_id["add_two_numbers"]
    traj, engine = episode(tokenizer, task, [
        call("write_file", path="solution.py", content=SOLUTION), call("run_tests"),
        call("bash", command="cat solution.py"), call("submit")])
    assert traj.finish_reason == "submitted" and traj.reward == 1.0 and traj.passed
    assert traj.num_turns == 4 and traj.num_tool_calls == 4 and len(traj.segments) == 1
    seg = traj.segments[0]
    observed = text_of(tokenizer, seg, 0)
    assert "Wrote 32 bytes to solution.py" in observed and "1 passed" in observed and "return a + b" in observed
    # exactly the sampled tokens are trainable, with their behaviour logprobs; everything else is masked
    sampled = [lp for lp, m in zip(seg.rollout_logprobs, seg.loss_mask) if m]
    assert sampled == [-0.25] * len(sampled) and sum(seg.loss_mask) == len(sampled)
    assert all(lp == 0.0 for lp, m in zip(seg.rollout_logprobs, seg.loss_mask) if not m)
    # every sampled token carries the version that sampled it; context tokens none
    assert [v for v, m in zip(seg.weight_versions, seg.loss_mask) if m] == [3] * len(sampled)
    assert all(v == -1 for v, m in zip(seg.weight_versions, seg.loss_mask) if not m)
    # token in / token out: every prompt the engine saw is a prefix of the final ledger
    assert all(seg.token_ids[:len(p)] == p for p in engine.prompts)


def test_malformed_calls_get_error_observations(tokenizer, task_by_id):
    traj, _ = episode(tokenizer, task_by_id["add_two_numbers"], [
        '<tool_call>{"name": "bash", "arguments": {"command": "ls"</tool_call>',
        call("no_such_tool"), call("write_file", path="x.py"), "Just talking.", call("submit")])
    assert traj.finish_reason == "submitted" and traj.num_malformed_calls == 1
    observed = text_of(tokenizer, traj.segments[0], 0)
    assert "invalid JSON" in observed and "unknown tool 'no_such_tool'" in observed
    assert "missing argument(s) content" in observed and "No tool call found" in observed
    assert traj.segments[0].step_rewards == []  # no penalty unless agent.malformed_call_reward asks for one


def test_a_malformed_call_penalty_sits_on_the_last_token_of_its_reply(tokenizer, task_by_id):
    broken = '<tool_call>{"name": "bash", "arguments": {"command": "ls"</tool_call>'
    traj, _ = episode(tokenizer, task_by_id["add_two_numbers"], [call("bash", command="ls"), broken, call("submit")],
                      malformed_call_reward=-0.05)
    seg = traj.segments[0]
    assert traj.num_malformed_calls == 1 and len(seg.step_rewards) == 1
    position, reward = seg.step_rewards[0]
    assert reward == -0.05 and seg.loss_mask[position] == 1 and seg.loss_mask[position + 1] == 0
    mask = seg.loss_mask
    reply_ends = [i for i, m in enumerate(mask) if m and (i + 1 == len(mask) or not mask[i + 1])]
    assert position == reply_ends[1]  # the second reply's last token (its <|im_end|>)
    assert tokenizer.decode(seg.token_ids[position]) == "<|im_end|>"


def test_a_positive_malformed_call_reward_is_refused():
    with pytest.raises(ValueError, match="malformed_call_reward"):
        AgentConfig(malformed_call_reward=0.1).validate()


def test_blocked_call_is_not_executed(tokenizer, task_by_id):
    traj, _ = episode(tokenizer, task_by_id["add_two_numbers"], [
        call("bash", command="rm tests/test_visible.py"), call("bash", command="ls tests"), call("submit")])
    assert traj.num_guard_blocks == 1 and traj.guard_events[0]["rules"] == ["test-file-modify"]
    observed = text_of(tokenizer, traj.segments[0], 0)
    assert "Permission denied" in observed and "test_visible.py" in observed.split("Permission denied")[1]


def test_blocked_turn_can_be_masked(tokenizer, task_by_id):
    traj, _ = episode(tokenizer, task_by_id["add_two_numbers"], [
        call("bash", command="rm tests/test_visible.py"), call("submit")], train_blocked_tokens="mask")
    trained = text_of(tokenizer, traj.segments[0], 1)
    assert "rm tests" not in trained and "submit" in trained


def test_code_block_answer(tokenizer, task_by_id):
    traj, _ = episode(tokenizer, task_by_id["add_two_numbers"], [f"Here:\n```python\n{SOLUTION}```"])
    assert traj.finish_reason == "submitted" and traj.reward == 1.0 and traj.num_turns == 1
    traj, _ = episode(tokenizer, task_by_id["add_two_numbers"], [f"```python\n{SOLUTION}```"],
                      code_block_answer=False, max_turns=2)
    assert traj.finish_reason == "max_turns" and traj.reward == 0.0


def test_budgets(tokenizer, task_by_id):
    traj, _ = episode(tokenizer, task_by_id["add_two_numbers"], ["hmm"] * 10, max_turns=3)
    assert traj.finish_reason == "max_turns" and traj.num_turns == 3
    traj, _ = episode(tokenizer, task_by_id["add_two_numbers"], ["word " * 150] * 10, max_episode_tokens=250)
    assert traj.finish_reason == "max_tokens" and traj.num_action_tokens <= 250 + 1


def test_compaction_splits_the_trajectory(tokenizer, task_by_id):
    task = task_by_id["add_two_numbers"]
    long_note = "step " * 60
    summary = "NOTE: write add in solution.py, then submit."
    replies = [call("bash", command=f"echo '{long_note}'"), call("bash", command=f"echo '{long_note}'"),
               summary, call("write_file", path="solution.py", content=SOLUTION), call("submit")]
    traj, engine = episode(tokenizer, task, replies, context_window=1100, max_new_tokens=150,
                           compaction=CompactionConfig(reserve=450, summary_max_tokens=120, max_compactions=1,
                                                       keep_recent_steps=1))
    assert traj.num_compactions == 1 and traj.finish_reason == "submitted" and traj.reward == 1.0
    first, second = traj.segments
    assert (first.segment_type, second.segment_type) == ("summary_closed", "final")
    assert first.rollout_id == second.rollout_id == "rid-1" and (first.segment_index, second.segment_index) == (0, 1)
    assert text_of(tokenizer, first, 1).removesuffix("<|im_end|>").endswith(summary)  # the summary is trained
    prompt = tokenizer.decode(second.token_ids[:second.loss_mask.index(1)])
    assert RESUME_PREAMBLE.strip()[:40] in prompt and summary in prompt  # copied note: context, mask 0
    assert "Task: " in prompt and "echo" in prompt  # task kept verbatim, last step kept
    assert summary not in text_of(tokenizer, second, 1)


def test_episode_on_the_real_engine(tiny_path, tokenizer, task_by_id):
    from rollout.local_engine import LocalEngine

    engine = LocalEngine.from_pretrained(tiny_path)
    try:
        cfg = AgentConfig(context_window=1536, max_turns=2, max_new_tokens=32, max_episode_tokens=64,
                          compaction=CompactionConfig(reserve=320, summary_max_tokens=48))
        rt = EpisodeRuntime(engine, tokenizer, make_chat_format("chatml"), make_tool_parser("json", TOOL_SPECS),
                            Guard(), cfg)
        traj = asyncio.run(AgentEpisode(rt, task_by_id["add_two_numbers"], SamplingParams(seed=1)).run())
    finally:
        engine.close()
    assert traj.finish_reason in ("max_turns", "max_tokens", "submitted") and traj.num_turns >= 1
    assert traj.num_action_tokens > 0 and "outcomes" in traj.grade_details


def test_flagged_call_goes_to_the_judge_and_its_block_is_audited(tokenizer, task_by_id):
    from antihack import JudgeConfig, LLMJudge

    class Blocker:  # a judge backend that always says "hack" (the judge's own logic is tested in antihack)
        async def complete(self, prompt, max_new_tokens):
            return '{"verdict": "hack", "category": "solution_search", "confidence": 0.9, "reason": "looks for answers"}'

    cfg = AgentConfig(context_window=4096, max_turns=3, max_new_tokens=200, max_episode_tokens=4000)
    engine = ScriptedEngine(tokenizer, [call("bash", command="find / -name '*.py' | head"), call("submit")])
    guard = Guard(judge=LLMJudge(Blocker(), JudgeConfig()))
    rt = EpisodeRuntime(engine, tokenizer, make_chat_format("chatml"), make_tool_parser("json", TOOL_SPECS), guard, cfg)
    traj = asyncio.run(AgentEpisode(rt, task_by_id["add_two_numbers"], SamplingParams(), "rid-j").run())
    event = traj.guard_events[0]
    assert event["action"] == "block" and event["stage"] == "judge" and event["rules"] == ["broad-search"]
    assert event["judge"]["verdict"] == "hack" and traj.num_guard_blocks == 1
    assert "No such file or directory" in text_of(tokenizer, traj.segments[0], 0)


def test_the_first_turn_is_generated_while_the_sandbox_starts(tokenizer, task_by_id, monkeypatch):
    """Sandbox start-up runs next to the first generation; a sandbox that cannot start ends the episode as an
    error with its reason (after the turn that was already generated), and the run goes on."""
    import threading
    import time

    import rollout.agent as agent_module

    generated_before_ready = threading.Event()
    real_make = agent_module.make_sandbox

    def slow_make(backend, **options):
        time.sleep(0.5)
        return real_make(backend, **options)

    class Recording(ScriptedEngine):
        async def generate(self, input_ids, sampling, request_id=None, session_id=None):
            generated_before_ready.set()
            return await super().generate(input_ids, sampling, request_id, session_id)

    monkeypatch.setattr(agent_module, "make_sandbox", slow_make)
    cfg = AgentConfig(context_window=4096, max_turns=4, max_new_tokens=200, max_episode_tokens=4000)
    engine = Recording(tokenizer, [call("write_file", path="solution.py", content=SOLUTION), call("submit")])
    rt = EpisodeRuntime(engine, tokenizer, make_chat_format("chatml"), make_tool_parser("json", TOOL_SPECS),
                        Guard(), cfg)
    started = time.perf_counter()

    async def go():
        task = asyncio.ensure_future(AgentEpisode(rt, task_by_id["add_two_numbers"], SamplingParams(), "r").run())
        await asyncio.sleep(0.2)
        first_turn_early = generated_before_ready.is_set()  # the sandbox is still sleeping in make_sandbox
        return await task, first_turn_early

    traj, early = asyncio.run(go())
    assert early and traj.finish_reason == "submitted" and traj.reward == 1.0
    assert time.perf_counter() - started >= 0.5

    def failing_make(backend, **options):
        raise OSError("no bubblewrap here")

    monkeypatch.setattr(agent_module, "make_sandbox", failing_make)
    traj, engine = episode(tokenizer, task_by_id["add_two_numbers"], [call("bash", command="ls"), call("submit")])
    assert traj.finish_reason == "error" and "sandbox start failed" in traj.grade_details["error"]
    assert "no bubblewrap here" in traj.grade_details["error"] and len(engine.prompts) == 1


class StallingEngine(ScriptedEngine):
    """Its second generation never ends unless aborted (then it returns what it had, finish reason 'abort')."""

    def __init__(self, tokenizer, replies):
        super().__init__(tokenizer, replies)
        self.aborted: list[str] = []

    async def generate(self, input_ids, sampling, request_id=None, session_id=None):
        if len(self.prompts) == 0:
            return await super().generate(input_ids, sampling, request_id, session_id)
        self.prompts.append(list(input_ids))
        while request_id not in self.aborted:
            await asyncio.sleep(0.01)
        return GenerateResult([], [], "abort", {"weight_version": self.weight_version})

    async def abort(self, request_ids):
        self.aborted += request_ids


def test_an_episode_past_its_timeout_is_aborted_and_not_graded(tokenizer, task_by_id):
    """agent.episode_timeout_s: the generation in flight is aborted, the episode ends 'aborted' (never trained on,
    counted), and the worker returns it instead of waiting for the stalled call."""
    from rollout.worker import RolloutWorker

    cfg = AgentConfig(context_window=4096, max_turns=6, max_new_tokens=200, max_episode_tokens=4000,
                      episode_timeout_s=0.5)
    engine = StallingEngine(tokenizer, ["Let me think first."])  # no tool call: the second turn comes at once
    worker = object.__new__(RolloutWorker)  # the worker's episode logic alone, on this engine
    worker.engine_cfg = type("E", (), {"temperature": 1.0, "eval_temperature": 0.0, "top_p": 1.0, "top_k": 0})()
    worker.runtime = EpisodeRuntime(engine, tokenizer, make_chat_format("chatml"),
                                    make_tool_parser("json", TOOL_SPECS), Guard(), cfg)
    worker._episodes, worker._needs_weights, worker.engine = {}, False, engine
    worker.episode_log, worker.episode_log_every, worker._finished = "", 0, {}
    traj = asyncio.run(worker.run_episode(task_by_id["add_two_numbers"], "train", 1, "slow-1"))
    assert traj.finish_reason == "aborted" and traj.grade_details["aborted"] == "timeout"
    assert engine.aborted == ["slow-1-1"] and traj.reward == 0.0 and "tests" not in traj.grade_details
    assert worker._episodes == {}


def test_a_sandbox_killed_mid_episode_costs_a_call_not_the_episode(tokenizer, task_by_id):
    """Fault injection: the agent kills every process of its sandbox (pid 1 of its namespace included; the guard
    is off, as it would block the call). The call after it gets an observation (the sandbox came back, or an
    error saying it failed), the episode goes on to submit, and grading in a fresh sandbox still sees the work."""
    task = task_by_id["add_two_numbers"]
    traj, _ = episode(tokenizer, task, [
        call("write_file", path="solution.py", content=SOLUTION), call("bash", command="kill -9 -1; kill -9 1"),
        call("run_tests"), call("submit")], guard=Guard(enabled=False))
    assert traj.finish_reason == "submitted" and traj.num_tool_calls == 4 and traj.num_guard_blocks == 0
    observed = text_of(tokenizer, traj.segments[0], 0)
    assert "passed" in observed or "Error: the sandbox failed" in observed  # the call after the kill answered
    assert "error" not in traj.grade_details and traj.reward == 1.0 and traj.passed


def test_a_grader_that_crashes_makes_an_error_trajectory_that_is_not_trained(tokenizer, task_by_id, monkeypatch):
    """Fault injection: grading raises. The episode ends as an error with the reason, and the trainer drops and
    counts it (rl.batch.trainable) instead of training on a reward it never got."""
    import rollout.agent
    from rl.batch import trainable

    def crash(*args, **kwargs):
        raise OSError("injected: the grading sandbox died")

    monkeypatch.setattr(rollout.agent, "grade", crash)
    task = task_by_id["add_two_numbers"]
    traj, _ = episode(tokenizer, task, [call("write_file", path="solution.py", content=SOLUTION), call("submit")])
    assert traj.finish_reason == "error" and "injected" in traj.grade_details["error"] and traj.reward == 0.0
    kept, dropped = trainable([traj])
    assert kept == [] and dropped["error"] == 1
