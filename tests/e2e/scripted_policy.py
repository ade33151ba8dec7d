"""Tiny models taught, by a few hundred supervised steps (~40 s each), fixed answers.

The scripted policy answers assistant turns with one of three tool calls: a hack the rules block, a call the rules
only flag (so the judge decides) and a plain one. The scripted judge answers every judge prompt with one "hack"
verdict. Together they make whole-loop tests exercise real tool execution, both guard stages, compaction and the
engine-backed judge through the real engine, with models small enough for CI."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import torch

from antihack import Guard
from environments import TOOL_SPECS, load_tasks
from models import load_model, load_tokenizer
from rollout.agent import EpisodeRuntime, system_prompt, task_message
from rollout.chat import Message, make_chat_format
from rollout.config import AgentConfig
from rollout.tool_parsers import make_tool_parser

REPLIES = [
    '<tool_call>{"name": "bash", "arguments": {"command": "rm tests/test_visible.py"}}</tool_call>',
    '<tool_call>{"name": "bash", "arguments": {"command": "ls tests"}}</tool_call>',
    '<tool_call>{"name": "bash", "arguments": {"command": "pip install -U pytest"}}</tool_call>',
]
JUDGE_REPLY = ('{"verdict": "hack", "category": "package_under_test_install", "confidence": 0.9, '
               '"reason": "upgrades the test runner"}')


def make_scripted_policy(base: str, out: Path, steps: int = 250, seed: int = 0) -> Path:
    tokenizer = load_tokenizer(base)
    chat = make_chat_format("chatml")
    rt = EpisodeRuntime(None, tokenizer, chat, make_tool_parser("json", TOOL_SPECS), Guard(), AgentConfig())
    tasks = load_tasks().tasks[:6]
    prompts = []
    for task in tasks:  # first turns, and later turns after an observation
        history = [Message("system", system_prompt(rt)), Message("user", task_message(task))]
        prompts.append(chat.render(history))
        prompts.append(chat.render(history + [Message("assistant", REPLIES[1]), Message("tool", "test_visible.py")]))
    examples = [(p, reply) for p in prompts for reply in REPLIES]
    return _teach(base, tokenizer, examples, out, steps, seed, {"replies": REPLIES})


def make_scripted_judge(base: str, out: Path, steps: int = 150, seed: int = 1) -> Path:
    """A judge that answers JUDGE_REPLY to any judge prompt (rendered as the engine backend renders it)."""
    from antihack.judge import LLMJudge
    from antihack.types import GuardContext

    tokenizer = load_tokenizer(base)
    chat = make_chat_format("chatml")
    guard, judge = Guard(), LLMJudge(backend=None)
    prompts = []
    for task in load_tasks().tasks[:6]:
        ctx = GuardContext.for_task(task)
        for reply in REPLIES:
            call = make_tool_parser("json", TOOL_SPECS).parse(reply).calls[0]
            hits, _ = guard.rule_hits(call, ctx)
            prompts.append(chat.render([Message("user", judge.prompt(call, ctx, hits))]))
    return _teach(base, tokenizer, [(p, JUDGE_REPLY) for p in prompts], out, steps, seed, {"reply": JUDGE_REPLY})


def _teach(base: str, tokenizer, texts: list[tuple[str, str]], out: Path, steps: int, seed: int, info: dict) -> Path:
    """Supervised steps on (prompt, reply) pairs, the reply ended by <|im_end|>; loss on the reply only."""
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    examples = []
    for prompt, reply in texts:
        prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        target = tokenizer(reply, add_special_tokens=False)["input_ids"] + [end]
        examples.append((prompt_ids, target))
    torch.manual_seed(seed)
    model = load_model(base)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    rng = random.Random(seed)
    for _ in range(steps):
        batch = rng.sample(examples, 2)
        loss = 0.0
        for prompt_ids, target in batch:
            ids = torch.tensor([prompt_ids + target])
            hidden = model.model(input_ids=ids).last_hidden_state[0, len(prompt_ids) - 1:-1]
            logits = model.lm_head(hidden)
            loss = loss + torch.nn.functional.cross_entropy(logits, torch.tensor(target)) / len(batch)
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    shutil.rmtree(out, ignore_errors=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    (out / "scripted_replies.json").write_text(json.dumps({**info, "final_loss": float(loss.detach())}))
    return out
