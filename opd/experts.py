"""`python -m opd.experts --domain function --out outputs/experts/function`: an expert for the OPD demonstration.

Supervised fine-tuning of the policy on one domain's reference solutions, rendered exactly as the agent would
answer: the episode's first prompt (system prompt + task message, the chat format of the run) followed by the
final solution as one ```python block (which the agent loop writes to the task's main file and submits). The
loss covers the reply only. A few epochs on a dozen tasks turn the default policy into a specialist of that
domain, which is what the distillation then has to merge.
"""

from __future__ import annotations

import argparse
import logging
import random
import time
from pathlib import Path

import torch
from tqdm import tqdm

from environments import TOOL_SPECS, load_tasks
from models import load_model, load_tokenizer, resolve_model_path
from rollout.agent import EpisodeRuntime, system_prompt, task_message
from rollout.chat import Message, make_chat_format
from rollout.config import AgentConfig
from rollout.tool_parsers import make_tool_parser

log = logging.getLogger("opd.experts")


def sft_examples(tasks, tokenizer, chat_format: str = "chatml", tool_format: str = "json") -> list[tuple[list[int], int]]:
    """(token ids, reply start) per task with a reference solution of its main file."""
    chat = make_chat_format(chat_format)
    rt = EpisodeRuntime(engine=None, tokenizer=tokenizer, chat=chat, parser=make_tool_parser(tool_format, TOOL_SPECS),
                        guard=None, config=AgentConfig())
    system = Message("system", system_prompt(rt))
    end = tokenizer.decode(chat.stop_token_ids(tokenizer)[:1]) if chat.stop_token_ids(tokenizer) else ""
    out = []
    for task in tasks:
        solution = next((f.content for f in task.reference_solution if f.path == task.entry_file), None)
        if solution is None:
            continue
        prompt = rt.encode(chat.render([system, Message("user", task_message(task))], add_generation_prompt=True))
        reply = rt.encode(f"```python\n{solution.rstrip()}\n```{end}")
        out.append((prompt + reply, len(prompt)))
    return out


def train_expert(policy: str, domain: str, out: str, epochs: int = 4, lr: float = 2e-5, tasks_source: str = "",
                 split: str = "train", seed: int = 0, chat_format: str = "chatml", device: str = "auto") -> dict:
    """`device`: "auto" trains on the GPU when there is one (fp32 either way), else the named device."""
    torch.manual_seed(seed)
    device = ("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device
    path = str(resolve_model_path(policy))
    tokenizer = load_tokenizer(path)
    task_set = load_tasks(tasks_source) if tasks_source else load_tasks()
    tasks = [t for t in task_set.split(split) if t.domain == domain]
    if not tasks:
        raise SystemExit(f"no {split!r} tasks of domain {domain!r}")
    examples = sft_examples(tasks, tokenizer, chat_format)
    model = load_model(path, "policy", device=device).train()
    optim = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    rng = random.Random(seed)
    losses, started = [], time.perf_counter()
    with tqdm(total=epochs * len(examples), desc=f"SFT {domain}", unit="ex") as bar:
        for _ in range(epochs):
            rng.shuffle(examples)
            for ids, start in examples:
                x = torch.tensor([ids], device=device)
                labels = x.clone()
                labels[:, :start] = -100
                loss = model(input_ids=x, labels=labels).loss
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                optim.step()
                optim.zero_grad(set_to_none=True)
                losses.append(loss.item())
                bar.set_postfix(loss=f"{losses[-1]:.3f}")
                bar.update(1)
    Path(out).mkdir(parents=True, exist_ok=True)
    model.to("cpu").save_pretrained(out)
    tokenizer.save_pretrained(out)
    return {"domain": domain, "examples": len(examples), "epochs": epochs, "first_loss": losses[0],
            "last_epoch_loss": sum(losses[-len(examples):]) / len(examples), "seconds": time.perf_counter() - started}


def main(argv=None) -> dict:
    logging.basicConfig(level=logging.INFO)
    p = argparse.ArgumentParser(prog="python -m opd.experts", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--policy", default="smollm2-135m-instruct")
    p.add_argument("--domain", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--lr", type=float, default=2e-5)
    p.add_argument("--tasks", default="")
    p.add_argument("--split", default="train")
    p.add_argument("--device", default="auto", help="auto: the GPU when there is one")
    args = p.parse_args(argv)
    result = train_expert(args.policy, args.domain, args.out, args.epochs, args.lr, args.tasks, args.split,
                          device=args.device)
    print(result)
    return result


if __name__ == "__main__":
    main()
