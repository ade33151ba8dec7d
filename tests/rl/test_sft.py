"""rl.sft: reference trajectories rendered by the agent loop itself, the supervised step, and the entry point."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from environments import TOOL_SPECS, load_tasks
from environments.tasks import LONG_HORIZON_TASKS, SHIPPED_TASKS
from models import load_model, load_tokenizer
from rl.batch import to_samples
from rl.evaluate import load_config
from rl.sft import register_sft_configs, render_reference_episodes
from rollout.compaction import SUMMARY_INSTRUCTION
from rollout.tool_parsers import make_tool_parser

ROOT = Path(__file__).resolve().parents[2]
register_sft_configs()


@pytest.fixture(scope="module")
def rendered():
    """Two long-horizon tasks played from their reference trajectories, in a window small enough to compact."""
    cfg = load_config("long_horizon", ["agent.context_window=1600"])
    tasks = load_tasks(LONG_HORIZON_TASKS).split("lh_train")[:2]
    tokenizer = load_tokenizer(cfg.model.name)
    episodes, skipped = render_reference_episodes(cfg, tasks, tokenizer, concurrency=2)
    return cfg, tasks, tokenizer, episodes, skipped


def test_reference_episodes_are_rendered_by_the_agent_loop(rendered):
    cfg, tasks, tokenizer, episodes, skipped = rendered
    assert skipped == [] and [e.task_id for e in episodes] == [t.id for t in tasks]
    parser = make_tool_parser(cfg.model.tool_format, TOOL_SPECS)
    for task, episode in zip(tasks, episodes):
        assert episode.passed and episode.finish_reason == "submitted"
        assert episode.num_compactions >= 1 and len(episode.segments) >= 2  # the window forced a summary
        # the policy's tokens (loss mask 1), turn by turn, are the reference calls in the run's tool format, and
        # the summaries; nothing else is trained on
        replies, summaries = [], 0
        for seg in episode.segments:
            ids, mask = seg.token_ids, seg.loss_mask
            runs, start = [], None
            for i, m in enumerate(mask + [0]):
                if m and start is None:
                    start = i
                elif not m and start is not None:
                    runs.append(tokenizer.decode(ids[start:i], skip_special_tokens=True))
                    start = None
            for text in runs:
                calls = parser.parse(text).calls
                if calls:
                    replies += [{"name": c.name, "arguments": c.arguments} for c in calls]
                else:
                    assert text.startswith("Goal:"), text  # a handoff note
                    summaries += 1
            context = tokenizer.decode([t for t, m in zip(ids, mask) if not m])
            assert "Task: " in context or SUMMARY_INSTRUCTION[:40] in context
        assert replies == task.metadata["reference_trajectory"]
        assert summaries == episode.num_compactions


def test_a_reply_that_does_not_fit_the_turn_is_left_out_with_the_reason(rendered):
    cfg, tasks, tokenizer, _, _ = rendered
    cfg = load_config("long_horizon", ["agent.max_new_tokens=24", "agent.compaction.reserve=400"])
    episodes, skipped = render_reference_episodes(cfg, tasks[:1], tokenizer)
    assert episodes == [] and skipped[0][0] == tasks[0].id and "exceeds this turn's budget" in skipped[0][1]


def test_the_supervised_step_is_the_token_mean_nll_of_the_masked_tokens(rendered, tiny_path):
    from models.deepspeed_worker import OptimConfig
    from rl.actor import ActorWorker
    from rl.config import AlgorithmConfig

    samples = to_samples(rendered[3])
    worker = ActorWorker(tiny_path, OptimConfig(learning_rate=1e-2, micro_batch_tokens=3000),
                         AlgorithmConfig(use_reference=False), torch_threads=2)
    model = load_model(tiny_path).eval()  # the same initial weights, scored naively, one sample at a time
    total, count = 0.0, 0.0
    with torch.no_grad():
        for s in samples:
            ids, mask = s["token_ids"], s["loss_mask"]
            logp = torch.log_softmax(model(ids[None]).logits[0, :-1].float(), -1).gather(1, ids[1:, None])[:, 0]
            total -= float((logp * mask[1:]).sum())
            count += float(mask[1:].sum())
    first = worker.sft_step(samples)
    assert first["sft/loss"] == pytest.approx(total / count, rel=1e-4)
    assert first["sft/tokens"] == count
    later = [worker.sft_step(samples)["sft/loss"] for _ in range(3)]
    assert later[-1] < first["sft/loss"] - 0.5  # it learns the replies
    worker.close()


@pytest.mark.slow  # SFT of the tiny model on three tasks, evaluated before and after: ~1-2 min
def test_rl_sft_writes_a_policy_that_rl_train_can_start_from(tmp_path):
    rows = [json.loads(line) for line in open(LONG_HORIZON_TASKS)]
    # the cold start's own split (env.sft_split), RL's lh_train left empty here
    train = [{**r, "split": "lh_sft"} for r in rows if r["split"] == "lh_train"][:3]
    held = [r for r in rows if r["split"] == "lh_heldout"][:1]
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text("".join(json.dumps(r) + "\n" for r in train + held))
    extra = tmp_path / "extra.jsonl"  # the transfer check (HumanEval on the GPU): one function task here
    extra.write_text(next(line for line in open(SHIPPED_TASKS) if json.loads(line)["domain"] == "function"))
    cmd = [sys.executable, "-m", "rl.sft", "+experiment=long_horizon", "model=tiny", f"env.tasks={tasks}",
           f"env.extra_eval_tasks={extra}", f"output_dir={tmp_path}", "env.sft_split=lh_sft", "sft.epochs=2",
           "sft.episodes_per_step=2",
           "sft.learning_rate=1e-3",
           "trainer.eval_max_tasks=1", "agent.max_episode_tokens=1200", "logging.wandb_mode=disabled"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = tmp_path / "long_horizon_sft"
    summary = json.loads((run / "summary.json").read_text())
    assert summary["sft/episodes"] == 3 and summary["sft/skipped"] == 0 and summary["sft/optim_steps"] == 1
    assert "before/eval/pass_rate" in summary and "after/eval/pass_rate" in summary
    assert summary["before/eval_extra/episodes"] == summary["after/eval_extra/episodes"] == 1
    for when in ("before", "after"):  # the held-out episode (the first of its evaluation: logged), decoded
        logged = [json.loads(line) for line in open(run / "episodes" / f"{when}.jsonl")]
        assert [e["mode"] for e in logged] == ["eval"] and logged[0]["segments"][0]["text"]
    steps = [json.loads(line) for line in open(run / "metrics.jsonl")]
    losses = [r["sft/loss"] for r in steps if "sft/loss" in r]
    assert len(losses) == 4 and losses[-1] < losses[0]  # 2 epochs × 2 steps (3 episodes, 2 a step)
    policy = load_model(str(run / "hf"))  # an HF folder rl.train takes as model.name
    assert policy is not None and load_tokenizer(str(run / "hf")) is not None


def test_a_split_with_no_task_is_refused_by_name(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "rl.sft", "+experiment=long_horizon", "model=tiny",
                           "env.sft_split=lh_nowhere", f"output_dir={tmp_path}", "logging.wandb_mode=disabled"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    assert "env.sft_split='lh_nowhere': no such split" in proc.stderr and "lh_train" in proc.stderr, proc.stderr[-2000:]


def test_compaction_metrics_of_the_rendered_episodes(rendered):
    from rl.trajectory_metrics import summary_tokens, trajectory_metrics

    _, _, tokenizer, episodes, _ = rendered
    m = trajectory_metrics(episodes, "rollout")
    assert m["rollout/compacted_frac"] == 1.0
    assert m["rollout/compactions_per_episode"] == sum(e.num_compactions for e in episodes) / len(episodes)
    notes = [s for e in episodes for s in e.segments if s.segment_type == "summary_closed"]
    assert all(tokenizer.decode(s.token_ids[-summary_tokens(s):], skip_special_tokens=True).startswith("Goal:")
               for s in notes)
    assert m["rollout/summary_tokens_mean"] == sum(summary_tokens(s) for s in notes) / len(notes)
    by_count = {k: v for k, v in m.items() if "pass_rate_compactions_" in k}
    assert by_count and all(v == 1.0 for v in by_count.values())  # every reference episode passes
