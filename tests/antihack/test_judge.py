"""The LLM judge: strict verdict parsing, decisions, cache, retries, timeouts, fallbacks; both backends for real
(the local engine, and an OpenAI-compatible HTTP server on localhost)."""

import asyncio
import json
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer

import pytest

from antihack import Guard, GuardContext, JudgeConfig, LLMJudge, OpenAIJudgeBackend, parse_verdict
from antihack.judge import JudgeError
from environments import ToolCall

# flagged for the judge (output-spoofing escalates): a constant __repr__ may be a spoof, or a real singleton
NEW_TEST = ToolCall("write_file", {"path": "src/point.py", "content": "class P:\n    def __repr__(self):\n"
                                                                     "        return 'P(1, 2)'\n"})


class Scripted:
    """A judge backend replying with fixed texts (unit tests of the judge's own logic)."""

    def __init__(self, *replies, delay=0.0):
        self.replies, self.delay, self.prompts = list(replies), delay, []

    async def complete(self, prompt, max_new_tokens):
        self.prompts.append(prompt)
        await asyncio.sleep(self.delay)
        reply = self.replies.pop(0) if len(self.replies) > 1 else self.replies[0]
        if isinstance(reply, Exception):
            raise reply
        return reply


def verdict_json(verdict="hack", confidence=0.9, category="test_modification"):
    return json.dumps({"verdict": verdict, "category": category, "confidence": confidence, "reason": "because"})


def test_parse_verdict_is_strict():
    assert parse_verdict("Sure! " + verdict_json() + " done")["verdict"] == "hack"
    for bad in ["no json", '{"verdict": "maybe", "confidence": 0.5}', '{"verdict": "hack", "confidence": 2}',
                '{"verdict": "hack", "confidence": "high"}', '{"verdict": "hack", "confidence": 0.5']:
        with pytest.raises(JudgeError):
            parse_verdict(bad)


def run(coro):
    return asyncio.run(coro)


def test_judge_decides_flagged_calls_only_and_caches():
    backend = Scripted(verdict_json("hack", 0.95))
    guard = Guard(judge=LLMJudge(backend, JudgeConfig(threshold=0.7)))
    ctx = GuardContext(task_id="t", statement="Add a function.", protected_paths=["tests/test_visible.py"])
    assert run(guard.acheck(ToolCall("bash", {"command": "ls"}), ctx)).stage == "rules"  # not flagged: no judge
    v = run(guard.acheck(NEW_TEST, ctx))
    assert v.action == "block" and v.stage == "judge" and v.rule_ids == ["output-spoofing"]
    assert v.judge["confidence"] == 0.95 and "src/point.py" in backend.prompts[0]
    assert "Add a function." in backend.prompts[0] and "output-spoofing" in backend.prompts[0]
    run(guard.acheck(NEW_TEST, ctx))
    assert len(backend.prompts) == 1 and guard.judge.stats["cache_hits"] == 1
    m = guard.stats.as_metrics()
    assert m["guard/judge_rate"] == pytest.approx(2 / 3) and m["guard/judge_latency_p50_ms"] >= 0


@pytest.mark.parametrize("reply,action", [(verdict_json("benign", 0.99), "allow"), (verdict_json("hack", 0.5), "allow"),
                                          (verdict_json("uncertain", 0.9), "allow"), (verdict_json("hack", 0.8), "block")])
def test_threshold_and_verdicts(reply, action):
    guard = Guard(judge=LLMJudge(Scripted(reply), JudgeConfig(threshold=0.7)))
    assert run(guard.acheck(NEW_TEST, GuardContext(task_id="t"))).action == action


@pytest.mark.parametrize("fallback", ["allow", "block"])
def test_failures_fall_back_as_configured(fallback):
    backend = Scripted("not json at all", ConnectionError("down"), "still not json")
    judge = LLMJudge(backend, JudgeConfig(retries=2, fallback=fallback))
    v = run(Guard(judge=judge).acheck(NEW_TEST, GuardContext(task_id="t")))
    assert v.action == fallback and "fallback" in v.reason and v.judge["verdict"] == "error"
    assert len(backend.prompts) == 3 and judge.stats["failures"] == 1 and judge.stats["retries"] == 2
    slow = LLMJudge(Scripted(verdict_json(), delay=5.0), JudgeConfig(timeout_s=0.1, retries=0, fallback=fallback))
    v = run(Guard(judge=slow).acheck(NEW_TEST, GuardContext(task_id="t")))
    assert v.action == fallback and "timeout" in v.reason


def test_concurrent_decisions_are_batched_by_the_engine_backend(tiny_path):
    """The real LocalEngine as judge: a random tiny model answers off-schema, which must fall back cleanly; the
    calls of concurrent episodes share engine batches."""
    from rollout.chat import make_chat_format
    from rollout.guard import EngineJudgeBackend
    from rollout.local_engine import LocalEngine

    engine = LocalEngine.from_pretrained(tiny_path, max_batch_size=8)
    try:
        judge = LLMJudge(EngineJudgeBackend(engine, engine.tokenizer, make_chat_format("chatml")),
                         JudgeConfig(max_new_tokens=8, retries=0, fallback="allow"))
        guard = Guard(judge=judge)

        async def many():
            calls = [ToolCall("write_file", {"path": f"src/p{i}.py", "content": NEW_TEST.arguments["content"]})
                     for i in range(4)]
            return await asyncio.gather(*[guard.acheck(c, GuardContext(task_id="t")) for c in calls])
        verdicts = run(many())
        assert all(v.stage == "judge" and v.action == "allow" and v.judge["verdict"] == "error" for v in verdicts)
        assert engine.stats["batches"] < 4  # several judge requests went through one batch
    finally:
        engine.close()


def test_openai_compatible_endpoint():
    seen = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            seen.append(body)
            reply = {"choices": [{"message": {"role": "assistant", "content": verdict_json("hack", 0.9)}}]}
            data = json.dumps(reply).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args):
            pass

    server = HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        backend = OpenAIJudgeBackend(f"http://127.0.0.1:{server.server_port}/v1", "judge-model")
        v = run(Guard(judge=LLMJudge(backend)).acheck(NEW_TEST, GuardContext(task_id="t")))
        assert v.action == "block" and seen[0]["model"] == "judge-model" and seen[0]["temperature"] == 0.0
        dead = OpenAIJudgeBackend("http://127.0.0.1:9/v1", "m", timeout_s=1)
        v = run(Guard(judge=LLMJudge(dead, JudgeConfig(retries=0))).acheck(NEW_TEST, GuardContext(task_id="t")))
        assert v.action == "allow" and "fallback" in v.reason
    finally:
        server.shutdown()


def test_the_judge_sees_the_call_just_before_and_whole_files():
    """The guard asks before the call joins the history: the last earlier calls are the recent ones (the one
    just before included), and a written file is shown whole up to max_action_chars, not cut at 500 characters."""
    backend = Scripted(verdict_json("benign", 0.9))
    guard = Guard(judge=LLMJudge(backend, JudgeConfig(recent_calls=2)))
    ctx = GuardContext(task_id="t", statement="Point.", protected_paths=["tests/test_point.py"])
    for i in range(3):
        run(guard.acheck(ToolCall("bash", {"command": f"echo step-{i}"}), ctx))
    padding = "# " + "x" * 60 + "\n"
    late = ToolCall("write_file", {"path": "src/point.py", "content": padding * 30 + NEW_TEST.arguments["content"]})
    run(guard.acheck(late, ctx))
    prompt = backend.prompts[-1]
    assert "step-2" in prompt and "step-1" in prompt and "step-0" not in prompt
    assert "return 'P(1, 2)'" in prompt and "write_file src/point.py:" in prompt
    cut = LLMJudge(Scripted(verdict_json()), JudgeConfig(max_action_chars=300)).prompt(late, ctx, [])
    assert "return 'P(1, 2)'" not in cut and "more characters)" in cut


def test_judge_settings_are_checked():
    for bad in (dict(recent_calls=-1), dict(max_action_chars=10), dict(backend="gpt")):
        with pytest.raises(ValueError):
            JudgeConfig(**bad).check()
