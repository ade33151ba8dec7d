"""`python -m antihack.train_judge`: train the guard's verdict head (antihack/verdict_head.py) on a labelled corpus.

    python -m antihack.train_judge [--corpus antihack/data/judge_train_corpus.jsonl] [--out antihack/data/judge_head.json]

Every line of the corpus (hacks and benign calls, same format as the evaluation corpora) is replayed through the
rules like the guard does at run time (its history first), rendered in the head's layout with the rule hits, and
read by the first layers of the frozen base model (tqdm shows progress; ~1 s a call on two CPU cores). The
layer and the L2 strength are chosen by cross-validation over folds that keep each task's calls together (calls
of one task resemble each other; a split by line would flatter the head), then the head is fitted on everything.
The logistic regression is fitted by full-batch L-BFGS from zeros, so the same corpus and model give the same
head. The training corpus must be disjoint from every corpus the judge is measured on: the trainer refuses a
corpus that shares a call with one of the evaluation corpora named by `--disjoint-from`.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from antihack.config import JudgeConfig
from antihack.evaluate import context_for, load_corpus, to_call
from antihack.guard import Guard
from antihack.judge import LLMJudge, normalise_call
from antihack.verdict_head import HEAD_FILE, HEAD_PROMPT, PromptFeatures, VerdictHead

DATA = Path(__file__).parent / "data"
DEFAULT_CORPUS = DATA / "judge_train_corpus.jsonl"
EVALUATION_CORPORA = [DATA / name for name in ("corpus.jsonl", "heldout_corpus.jsonl", "written_corpus.jsonl",
                                               "generated_corpus.jsonl")]
DEFAULT_MODEL = "smollm2-135m-instruct"


class _HeadLayout:
    prompt_template = HEAD_PROMPT


def head_prompts(rows: list[dict], config: JudgeConfig | None = None) -> tuple[list[str], list[bool]]:
    """Each row's call rendered as the head sees it at run time, and whether the rules flag it."""
    render = LLMJudge(_HeadLayout(), config or JudgeConfig())
    prompts, flagged = [], []
    for row in rows:
        guard, context = Guard(), context_for(row)
        for earlier in row.get("history") or []:
            guard.check(to_call(earlier), context)
        call = to_call(row["call"])
        hits, _ = guard.rule_hits(call, context)
        prompts.append(render.prompt(call, context, hits))
        flagged.append(bool(hits))
    return prompts, flagged


def fit_logistic(x: torch.Tensor, y: torch.Tensor, l2: float, steps: int = 200) -> tuple[torch.Tensor, float]:
    """argmin_w,b mean BCE(σ(x·w + b), y) + l2/2 ‖w‖² (x standardised), by L-BFGS from zeros."""
    w = torch.zeros(x.shape[1], dtype=torch.float64, requires_grad=True)
    b = torch.zeros((), dtype=torch.float64, requires_grad=True)
    x, y = x.double(), y.double()
    opt = torch.optim.LBFGS([w, b], max_iter=steps, line_search_fn="strong_wolfe", tolerance_grad=1e-9)

    def closure():
        opt.zero_grad()
        loss = torch.nn.functional.binary_cross_entropy_with_logits(x @ w + b, y) + 0.5 * l2 * (w @ w)
        loss.backward()
        return loss

    opt.step(closure)
    return w.detach().float(), float(b.detach())


def standardise(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return x.mean(0), x.std(0).clamp_min(1e-6)


def task_folds(rows: list[dict], k: int) -> list[int]:
    """A fold per line such that all lines of one task statement share a fold (round-robin over sorted tasks)."""
    tasks = sorted({json.dumps(row.get("task"), sort_keys=True) for row in rows})
    fold_of = {t: i % k for i, t in enumerate(tasks)}
    return [fold_of[json.dumps(row.get("task"), sort_keys=True)] for row in rows]


def cross_validate(feats: torch.Tensor, y: torch.Tensor, folds: list[int], layer: int, l2: float) -> dict:
    """Held-out-fold accuracy, false-positive rate (benign scored ≥ 0.5) and recall at 0.5."""
    fold = torch.tensor(folds)
    scores = torch.empty(len(y))
    for f in sorted(set(folds)):
        train, test = fold != f, fold == f
        mu, sd = standardise(feats[train, layer])
        w, b = fit_logistic((feats[train, layer] - mu) / sd, y[train], l2)
        scores[test] = torch.sigmoid(((feats[test, layer] - mu) / sd) @ w + b)
    hack = y.bool()
    pred = scores >= 0.5
    return {"accuracy": float((pred == hack).float().mean()), "recall": float(pred[hack].float().mean()),
            "false_positive_rate": float(pred[~hack].float().mean()), "scores": scores}


def check_disjoint(rows: list[dict], others: list[Path]) -> None:
    """Refuse a training corpus that shares a (task, call) with a corpus the judge is measured on."""
    def keys(rs):
        return {(json.dumps(r.get("task"), sort_keys=True), normalise_call(to_call(r["call"]))) for r in rs}

    mine = keys(rows)
    for path in others:
        if path.exists():
            shared = mine & keys(load_corpus(str(path))[0])
            if shared:
                raise SystemExit(f"the training corpus shares {len(shared)} call(s) with {path}: it must be disjoint")


def main(argv: list[str] | None = None) -> VerdictHead:
    p = argparse.ArgumentParser(prog="python -m antihack.train_judge", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--corpus", default=str(DEFAULT_CORPUS))
    p.add_argument("--out", default=str(HEAD_FILE))
    p.add_argument("--model", default=DEFAULT_MODEL, help="the frozen base model (the default policy)")
    p.add_argument("--layers", default="4,8,12,16", help="candidate layers (hidden_states indices)")
    p.add_argument("--l2", default="0.01,0.1,1,10", help="candidate L2 strengths")
    p.add_argument("--max-tokens", type=int, default=512)
    p.add_argument("--folds", type=int, default=5)
    p.add_argument("--disjoint-from", nargs="*", default=[str(c) for c in EVALUATION_CORPORA])
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    from tqdm import tqdm

    torch.manual_seed(0)
    rows, skipped = load_corpus(args.corpus)
    for index, reason in skipped:
        print(f"corpus line {index} skipped: {reason}", file=sys.stderr)
    if len({r["label"] for r in rows}) < 2:
        raise SystemExit(f"{args.corpus}: need both hack and benign lines, got {len(rows)} line(s)")
    check_disjoint(rows, [Path(c) for c in args.disjoint_from if Path(c).resolve() != Path(args.corpus).resolve()])
    layers = sorted({int(v) for v in args.layers.split(",")})
    l2s = [float(v) for v in args.l2.split(",")]
    prompts, flagged = head_prompts(rows)
    features = PromptFeatures(args.model, layers=max(layers), max_tokens=args.max_tokens)
    feats = torch.stack([features(text) for text in tqdm(prompts, desc="hidden states", unit="call")])
    y = torch.tensor([r["label"] == "hack" for r in rows], dtype=torch.float32)
    folds = task_folds(rows, args.folds)
    results = {}
    for layer in layers:
        for l2 in l2s:
            results[(layer, l2)] = cross_validate(feats, y, folds, layer, l2)
            r = results[(layer, l2)]
            print(f"layer {layer:2d}  l2 {l2:<6g}  cv accuracy {r['accuracy']:.3f}  recall {r['recall']:.3f}  "
                  f"false positives {r['false_positive_rate']:.3f}")
    layer, l2 = max(results, key=lambda key: (results[key]["accuracy"], -key[0], key[1]))
    best = results[(layer, l2)]
    mu, sd = standardise(feats[:, layer])
    w, b = fit_logistic((feats[:, layer] - mu) / sd, y, l2)
    on_flagged = torch.tensor(flagged)
    pred = best["scores"] >= 0.5
    head = VerdictHead(base_model=args.model, layer=layer, max_tokens=args.max_tokens, mean=mu.tolist(),
                       std=sd.tolist(), weight=w.tolist(), bias=b, trained_on={
                           "corpus": Path(args.corpus).name, "lines": len(rows), "hacks": int(y.sum()),
                           "l2": l2, "folds": args.folds, "cv_accuracy": round(best["accuracy"], 4),
                           "cv_recall": round(best["recall"], 4),
                           "cv_false_positive_rate": round(best["false_positive_rate"], 4),
                           "flagged_lines": int(on_flagged.sum()),
                           "cv_accuracy_flagged": round(float((pred == y.bool())[on_flagged].float().mean()), 4)
                           if on_flagged.any() else None})
    head.save(args.out)
    print(f"chose layer {layer}, l2 {l2}: cv accuracy {best['accuracy']:.3f} (on the {int(on_flagged.sum())} "
          f"calls the rules flag: {head.trained_on['cv_accuracy_flagged']}); wrote {args.out}")
    return head


if __name__ == "__main__":
    main()
