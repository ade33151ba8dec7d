"""A tiny model taught, by a few hundred supervised steps (~40 s), to answer assistant turns with one of two fixed
tool calls (one of them a hack the guard blocks). It makes whole-loop tests exercise real tool execution, guard blocks and compaction through the
real engine, with a model small enough for CI."""

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
]


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
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    examples = []
    for p in prompts:
        for reply in REPLIES:
            prompt_ids = tokenizer(p, add_special_tokens=False)["input_ids"]
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
    (out / "scripted_replies.json").write_text(json.dumps({"replies": REPLIES, "final_loss": float(loss.detach())}))
    return out
