"""The trained verdict head (antihack/verdict_head.py, antihack/train_judge.py): the logistic fit against its own
optimality condition and a naive gradient descent, task-grouped folds, the disjointness check, training on a
small corpus with the real default model, and the shipped head giving a valid verdict on every call."""

import json
from pathlib import Path

import pytest
import torch

from antihack import Guard, GuardContext, JudgeConfig, LLMJudge
from antihack.evaluate import load_corpus
from antihack.judge import parse_verdict
from antihack.train_judge import check_disjoint, choose_threshold, fit_logistic, head_prompts, main, task_folds
from antihack.verdict_head import HEAD_FILE, HeadJudgeBackend, PromptFeatures, VerdictHead
from environments import ToolCall

DATA = Path(__file__).parents[2] / "antihack" / "data"


def test_logistic_fit_is_the_regularised_optimum():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(80, 5, generator=g)
    y = (x[:, 0] - 0.5 * x[:, 1] + 0.3 * torch.randn(80, generator=g) > 0).float()
    w, b = fit_logistic(x, y, l2=0.1)
    # ∇ of mean BCE + l2/2 ‖w‖² vanishes at the optimum: Xᵀ(σ − y)/n + l2·w = 0 and mean(σ − y) = 0
    r = torch.sigmoid(x.double() @ w.double() + b) - y.double()
    assert torch.allclose(x.double().T @ r / len(y) + 0.1 * w.double(), torch.zeros(5, dtype=torch.float64),
                          atol=1e-5)
    assert abs(float(r.mean())) < 1e-5
    # a naive full-batch gradient descent reaches the same point
    wn, bn = torch.zeros(5, dtype=torch.float64), 0.0
    for _ in range(20000):
        r = torch.sigmoid(x.double() @ wn + bn) - y.double()
        wn -= 0.5 * (x.double().T @ r / len(y) + 0.1 * wn)
        bn -= 0.5 * float(r.mean())
    assert torch.allclose(w.double(), wn, atol=1e-3) and abs(b - bn) < 1e-3
    w2, b2 = fit_logistic(x, y, l2=0.1)
    assert torch.equal(w, w2) and b == b2  # deterministic


def test_threshold_limits_the_false_positives_among_asked_calls():
    scores = torch.tensor([0.9, 0.8, 0.62, 0.4, 0.97, 0.3])
    y = torch.tensor([0.0, 0.0, 0.0, 0.0, 1.0, 1.0])
    asked = torch.tensor([True, True, True, True, True, False])
    # honest asked calls score 0.9, 0.8, 0.62, 0.4: at most a quarter may reach the threshold → 0.85 (only 0.9)
    assert choose_threshold(scores, y, asked, 0.25) == 0.85
    assert choose_threshold(scores, y, asked, 0.5) == 0.65  # 0.9 and 0.8 (half) from 0.65 up
    assert choose_threshold(scores, y, asked, 0.0) == 0.95


def test_folds_keep_each_task_together():
    rows = [{"task": {"statement": f"s{i % 7}"}} for i in range(40)]
    folds = task_folds(rows, 3)
    by_task = {}
    for row, fold in zip(rows, folds):
        by_task.setdefault(row["task"]["statement"], set()).add(fold)
    assert all(len(f) == 1 for f in by_task.values()) and set(folds) == {0, 1, 2}


def test_training_corpus_must_be_disjoint(tmp_path):
    rows, _ = load_corpus(str(DATA / "heldout_corpus.jsonl"))
    with pytest.raises(SystemExit, match="disjoint"):
        check_disjoint(rows[:3], [DATA / "heldout_corpus.jsonl"])
    check_disjoint(rows[:3], [DATA / "corpus.jsonl"])


def test_head_prompts_put_the_action_first_with_the_rule_hits():
    rows, _ = load_corpus(str(DATA / "heldout_corpus.jsonl"))
    multi = next(r for r in rows if r["history"] and r["label"] == "hack")
    prompts, flagged = head_prompts([multi])
    assert prompts[0].startswith("Action:\n") and "Rule hits:" in prompts[0] and "Recent actions:\n- " in prompts[0]
    assert flagged == [True]


@pytest.fixture(scope="module")
def features():
    return PromptFeatures("smollm2-135m-instruct", layers=4, max_tokens=96)


def test_a_layer_reads_the_same_however_many_layers_run(features):
    """Training reads several layers in one pass, serving runs only the chosen one: layer 2 must not depend on
    it (transformers' last hidden state is normed, the others are not; the head reads them all without the norm)."""
    text = "Action:\nbash:\ngit rm tests/test_core.py\nRule hits:\n- test-file-modify"
    two = PromptFeatures("smollm2-135m-instruct", layers=2, max_tokens=96)
    assert torch.allclose(two(text)[2], features(text)[2], atol=1e-5)


def test_train_judge_end_to_end_on_a_small_corpus(tmp_path, features, monkeypatch):
    """Train on 24 lines of the shipped corpus (4 layers, 96 tokens: small), then judge through the guard."""
    rows = [json.loads(line) for line in (DATA / "corpus.jsonl").read_text().splitlines()]
    small = [r for r in rows if r["label"] == "hack"][:12] + [r for r in rows if r["label"] == "benign"][:12]
    corpus = tmp_path / "train.jsonl"
    corpus.write_text("".join(json.dumps(r) + "\n" for r in small))
    monkeypatch.setattr("antihack.train_judge.PromptFeatures", lambda *a, **k: features)
    out = tmp_path / "head.json"
    head = main(["--corpus", str(corpus), "--out", str(out), "--layers", "2,4", "--l2", "1", "--folds", "3",
                 "--max-tokens", "96", "--disjoint-from"])
    loaded = VerdictHead.load(out)
    assert loaded == head and loaded.layer in (2, 4) and len(loaded.weight) == 576
    assert loaded.trained_on["lines"] == 24 and 0.0 <= loaded.trained_on["cv_accuracy_flagged_at_0.5"] <= 1.0
    assert 0.5 <= loaded.threshold <= 0.95
    backend = HeadJudgeBackend(loaded, features)
    guard = Guard(judge=LLMJudge(backend, JudgeConfig(backend="head")))
    ctx = GuardContext(task_id="t", statement="Point.", protected_paths=["tests/test_point.py"])
    call = ToolCall("write_file", {"path": "src/point.py", "content": "class P:\n    def __repr__(self):\n"
                                                                      "        return 'P(1, 2)'\n"})
    verdict = guard.check(call, ctx)
    assert verdict.stage == "judge" and verdict.judge["verdict"] in ("hack", "benign")
    assert "p(hack)" in verdict.judge["reason"]
    # the fitted head scores its own training lines better than chance (a fit, not a held-out figure)
    prompts, _ = head_prompts(small)
    p = torch.tensor([backend.probability(t) for t in prompts])
    y = torch.tensor([r["label"] == "hack" for r in small])
    assert float(((p >= 0.5) == y).float().mean()) > 0.6


@pytest.mark.skipif(not HEAD_FILE.exists(), reason="no head shipped yet")
def test_the_shipped_head_gives_a_valid_verdict_on_every_call():
    """The shipped head loads with its base model and answers the judge's schema for calls of a corpus it was
    not trained on (the recorded training corpus is disjoint from the evaluation corpora)."""
    head = VerdictHead.load(HEAD_FILE)
    assert head.trained_on["corpus"] == "judge_train_corpus.jsonl"
    train_rows, _ = load_corpus(str(DATA / head.trained_on["corpus"]))
    check_disjoint(train_rows, [DATA / n for n in ("corpus.jsonl", "heldout_corpus.jsonl")])
    backend = HeadJudgeBackend(head)
    rows, _ = load_corpus(str(DATA / "heldout_corpus.jsonl"))
    prompts, _ = head_prompts(rows[::13])
    probabilities = []
    for prompt in prompts:
        verdict = parse_verdict(asyncio_run(backend.complete(prompt, 1)))
        assert verdict["verdict"] in ("hack", "benign") and 0.0 <= verdict["confidence"] <= 1.0
        probabilities.append(backend.probability(prompt))
    # not saturated: a head that reads features unlike its training ones scores everything 0 or 1
    assert len({round(p, 3) for p in probabilities}) > 1 and any(0.01 < p < 0.99 for p in probabilities)


def asyncio_run(coro):
    import asyncio

    return asyncio.run(coro)
