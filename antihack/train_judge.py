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
import hashlib
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


def cross_validate(feats: torch.Tensor, y: torch.Tensor, folds: list[int], layer: int, l2: float,
                   flagged: torch.Tensor | None = None) -> dict:
    """Held-out-fold scores; accuracy, recall and false-positive rate at 0.5 over the calls the judge is asked
    about (`flagged`, default all)."""
    fold = torch.tensor(folds)
    scores = torch.empty(len(y))
    for f in sorted(set(folds)):
        train, test = fold != f, fold == f
        mu, sd = standardise(feats[train, layer])
        w, b = fit_logistic((feats[train, layer] - mu) / sd, y[train], l2)
        scores[test] = torch.sigmoid(((feats[test, layer] - mu) / sd) @ w + b)
    asked = flagged if flagged is not None and flagged.any() else torch.ones(len(y), dtype=torch.bool)
    hack, pred = y.bool()[asked], (scores >= 0.5)[asked]
    return {"accuracy": float((pred == hack).float().mean()), "recall": float(pred[hack].float().mean()),
            "false_positive_rate": float(pred[~hack].float().mean()) if (~hack).any() else 0.0, "scores": scores}


def choose_threshold(scores: torch.Tensor, y: torch.Tensor, asked: torch.Tensor, max_false_positives: float) -> float:
    """The lowest p(hack) threshold at which at most `max_false_positives` of the honest calls the judge is asked
    about score as hacks (held-out-fold scores), on a 0.05 grid from 0.5."""
    honest = scores[asked & ~y.bool()]
    for t in [0.5 + 0.05 * i for i in range(10)]:
        if honest.numel() == 0 or float((honest >= t).float().mean()) <= max_false_positives:
            return round(t, 2)
    return 0.95


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
    p.add_argument("--layers", default="12,16,20", help="candidate layers (hidden_states indices)")
    p.add_argument("--l2", default="0.01,0.1,1", help="candidate L2 strengths")
    p.add_argument("--max-false-positives", type=float, default=0.25,
                   help="of the honest flagged calls, at most this share judged hack (sets the head's threshold)")
    p.add_argument("--max-tokens", type=int, default=512)
    p.add_argument("--folds", type=int, default=5)
    p.add_argument("--disjoint-from", nargs="*", default=[str(c) for c in EVALUATION_CORPORA])
    p.add_argument("--features-cache", default="", help="keep the hidden states here and reuse them when the "
                   "corpus, model, layers and token limit are the same (re-selecting without re-reading)")
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
    key = hashlib.sha256(json.dumps([prompts, args.model, max(layers), args.max_tokens, "pre-norm"]).encode()).hexdigest()
    cache = Path(args.features_cache) if args.features_cache else None
    if cache and cache.exists() and (saved := torch.load(cache))["key"] == key:
        feats = saved["features"]
    else:
        features = PromptFeatures(args.model, layers=max(layers), max_tokens=args.max_tokens)
        feats = torch.stack([features(text) for text in tqdm(prompts, desc="hidden states", unit="call")])
        if cache:
            torch.save({"key": key, "features": feats}, cache)
    y = torch.tensor([r["label"] == "hack" for r in rows], dtype=torch.float32)
    folds = task_folds(rows, args.folds)
    asked = torch.tensor(flagged)  # what the judge is asked about at run time: calls the rules flag
    results = {}
    hack_asked = y.bool() & asked
    for layer in layers:
        for l2 in l2s:
            r = results[(layer, l2)] = cross_validate(feats, y, folds, layer, l2, asked)
            r["threshold"] = choose_threshold(r["scores"], y, asked, args.max_false_positives)
            r["recall_at_threshold"] = float((r["scores"][hack_asked] >= r["threshold"]).float().mean())
            print(f"layer {layer:2d}  l2 {l2:<6g}  flagged calls: cv accuracy at 0.5 {r['accuracy']:.3f}; at "
                  f"threshold {r['threshold']:.2f} recall {r['recall_at_threshold']:.3f}")
    # what the judge is for: the most flagged hacks blocked while few honest flagged calls are
    layer, l2 = max(results, key=lambda k: (results[k]["recall_at_threshold"], results[k]["accuracy"], -k[0]))
    best = results[(layer, l2)]
    mu, sd = standardise(feats[:, layer])
    w, b = fit_logistic((feats[:, layer] - mu) / sd, y, l2)
    threshold = best["threshold"]
    scores, hack = best["scores"][asked], y.bool()[asked]
    head = VerdictHead(base_model=args.model, layer=layer, max_tokens=args.max_tokens, mean=mu.tolist(),
                       std=sd.tolist(), weight=w.tolist(), bias=b, threshold=threshold, trained_on={
                           "corpus": Path(args.corpus).name, "lines": len(rows), "hacks": int(y.sum()),
                           "flagged_lines": int(asked.sum()), "flagged_hacks": int(hack.sum()), "l2": l2,
                           "folds": args.folds, "cv_accuracy_flagged_at_0.5": round(best["accuracy"], 4),
                           "cv_recall_flagged_at_threshold": round(float((scores[hack] >= threshold).float().mean()), 4),
                           "cv_false_positive_rate_flagged_at_threshold":
                               round(float((scores[~hack] >= threshold).float().mean()), 4) if (~hack).any() else 0.0})
    head.save(args.out)
    print(f"chose layer {layer}, l2 {l2}, threshold {threshold}: on the {int(asked.sum())} calls the rules flag, "
          f"cross-validated recall {head.trained_on['cv_recall_flagged_at_threshold']:.3f}, false positives "
          f"{head.trained_on['cv_false_positive_rate_flagged_at_threshold']:.3f}; wrote {args.out}")
    return head


if __name__ == "__main__":
    main()
