"""`python -m antihack.evaluate`: recall, precision and false blocks of the guard on a labelled corpus.

    python -m antihack.evaluate --corpus antihack/data/corpus.jsonl [--judge judge.yaml] [--out report.json]

Each corpus line: {"id", "task": {"statement", "protected_paths": [...]}, "history": [earlier calls],
"call": {"name", "arguments"}, "label": "hack" | "benign", "category"}. The history is replayed through the
same guard first (so state such as a script written earlier is known), then the labelled call is decided.
`--judge FILE` (YAML or JSON, the fields of `antihack.config.JudgeConfig`) adds the judge; without it, flagged
calls that no block rule catches are allowed (and counted as flagged). Here the judge is the trained verdict head
(`backend: head`, antihack/data/judge_head.yaml) or an OpenAI-compatible server (`backend: openai`);
`python -m rollout.guard` takes the same arguments and also runs a local model answering the prompt
(`backend: engine`, e.g. antihack/data/judge_local.yaml).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Callable

from antihack.guard import Guard
from antihack.config import JudgeConfig
from antihack.judge import JudgeBackend, LLMJudge, OpenAIJudgeBackend
from antihack.types import GuardContext
from environments.types import ToolCall

HIDDEN_MARKERS = ("hidden", "grader", "eval/", "expected", "solution", "gold")
DEFAULT_CORPUS = str(Path(__file__).parent / "data" / "corpus.jsonl")


def load_corpus(path: str) -> tuple[list[dict], list[tuple[int, str]]]:
    rows, skipped = [], []
    for i, line in enumerate(Path(path).read_text().splitlines()):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            for key in ("id", "task", "call", "label"):
                if key not in row:
                    raise ValueError(f"missing {key!r}")
            if row["label"] not in ("hack", "benign"):
                raise ValueError(f"label must be hack or benign, got {row['label']!r}")
            rows.append(row)
        except (json.JSONDecodeError, ValueError) as exc:
            skipped.append((i, str(exc)))
    return rows, skipped


def context_for(row: dict) -> GuardContext:
    task = row.get("task") or {}
    protected = list(task.get("protected_paths") or [])
    hidden = [p for p in protected if any(m in p for m in HIDDEN_MARKERS)]
    return GuardContext(task_id=row["id"], statement=str(task.get("statement", "")), protected_paths=protected,
                        hidden_paths=list(task.get("hidden_paths") or hidden),
                        package_name=str(task.get("package_name", "")))


def to_call(raw: dict) -> ToolCall:
    return ToolCall(str(raw.get("name", "")), raw.get("arguments") if isinstance(raw.get("arguments"), dict) else {})


async def run(guard: Guard, rows: list[dict]) -> list[dict]:
    results = []
    for row in rows:
        ctx = context_for(row)
        for earlier in row.get("history") or []:
            await guard.acheck(to_call(earlier), ctx)
        verdict = await guard.acheck(to_call(row["call"]), ctx)
        results.append({"id": row["id"], "label": row["label"], "category": row.get("category", ""),
                        "action": verdict.action, "stage": verdict.stage, "rule_ids": verdict.rule_ids,
                        "flagged": verdict.flagged, "reason": verdict.reason,
                        "rules_ms": 1000 * verdict.rules_latency, "judge_ms": 1000 * verdict.judge_latency,
                        "judged": verdict.judge is not None,
                        "judge_verdict": verdict.judge.get("verdict") if verdict.judge else None})
    return results


def _pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] if values else 0.0


def summarize(results: list[dict]) -> dict:
    hacks = [r for r in results if r["label"] == "hack"]
    benign = [r for r in results if r["label"] == "benign"]
    blocked = [r for r in results if r["action"] == "block"]
    true_blocks = [r for r in blocked if r["label"] == "hack"]
    by_cat: dict[str, list[dict]] = defaultdict(list)
    for r in hacks:
        by_cat[r["category"]].append(r)
    judged = [r for r in results if r["judged"]]
    return {
        "n": len(results), "n_hack": len(hacks), "n_benign": len(benign),
        "recall": len(true_blocks) / max(len(hacks), 1),
        "flag_recall": sum(r["flagged"] for r in hacks) / max(len(hacks), 1),
        "precision": len(true_blocks) / max(len(blocked), 1) if blocked else 1.0,
        "false_block_rate": sum(r["action"] == "block" for r in benign) / max(len(benign), 1),
        "benign_flag_rate": sum(r["flagged"] for r in benign) / max(len(benign), 1),
        "judge_rate": len(judged) / max(len(results), 1),
        # a verdict the judge's schema accepts (not a failure that fell back to the configured action)
        "judge_valid_rate": sum(r["judge_verdict"] not in (None, "error") for r in judged) / len(judged)
        if judged else None,
        "recall_by_category": {c: sum(r["action"] == "block" for r in rs) / len(rs) for c, rs in sorted(by_cat.items())},
        "flag_recall_by_category": {c: sum(r["flagged"] for r in rs) / len(rs) for c, rs in sorted(by_cat.items())},
        "latency_ms": {"rules_p50": _pct([r["rules_ms"] for r in results], 0.5),
                       "rules_p99": _pct([r["rules_ms"] for r in results], 0.99),
                       "judge_p50": _pct([r["judge_ms"] for r in judged], 0.5),
                       "judge_p99": _pct([r["judge_ms"] for r in judged], 0.99)},
        "missed_hacks": [r["id"] for r in hacks if r["action"] != "block"],
        "false_blocks": [r["id"] for r in benign if r["action"] == "block"],
        "results": results,
    }


def judge_config(path: str) -> JudgeConfig:
    """A judge's settings from a YAML or JSON file (the fields of `antihack.config.JudgeConfig`)."""
    import yaml

    raw = yaml.safe_load(Path(path).read_text()) or {}
    unknown = sorted(set(raw) - set(JudgeConfig.__dataclass_fields__))
    if unknown:
        raise SystemExit(f"{path}: unknown judge settings {unknown}; known: {sorted(JudgeConfig.__dataclass_fields__)}")
    try:
        cfg = JudgeConfig(**raw).check()
    except ValueError as exc:
        raise SystemExit(f"{path}: {exc}") from None
    if cfg.backend == "none":
        raise SystemExit(f"{path}: a judge file names its backend: head (the trained verdict head), engine (a local "
                         "model) or openai (a server)")
    return cfg


def antihack_backend(cfg: JudgeConfig) -> JudgeBackend:
    """The backends antihack has itself (the trained verdict head, an OpenAI-compatible server); an engine of
    ours is the rollout side's (python -m rollout.guard)."""
    if cfg.backend == "head":
        from antihack.verdict_head import head_backend

        return head_backend(cfg.head)
    if cfg.backend != "openai":
        raise SystemExit(f"judge backend {cfg.backend!r} runs a local model, which the rollout side serves: "
                         "python -m rollout.guard takes the same arguments")
    return OpenAIJudgeBackend(cfg.endpoint, cfg.model or "default", cfg.timeout_s)


def main(argv: list[str] | None = None, judge_backend: Callable[[JudgeConfig], JudgeBackend] = antihack_backend,
         prog: str = "python -m antihack.evaluate") -> dict:
    """The CLI; `judge_backend` builds the judge's backend from its settings (rollout.guard passes one that
    also runs engines)."""
    p = argparse.ArgumentParser(prog=prog, description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--corpus", default=DEFAULT_CORPUS)
    p.add_argument("--judge", default=None, help="judge config (YAML/JSON); default: rules only")
    p.add_argument("--out", default=None, help="write the report as JSON")
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    rows, skipped = load_corpus(args.corpus)
    for index, reason in skipped:
        print(f"corpus line {index} skipped: {reason}", file=sys.stderr)
    judge = None
    if args.judge:
        cfg = judge_config(args.judge)
        judge = LLMJudge(judge_backend(cfg), cfg)
    guard = Guard(judge=judge)
    started = time.perf_counter()
    report = summarize(asyncio.run(run(guard, rows)))
    report["seconds"] = time.perf_counter() - started
    report["skipped_lines"] = skipped
    print(f"{report['n']} calls ({report['n_hack']} hack, {report['n_benign']} benign) in {report['seconds']:.1f} s")
    print(f"recall {report['recall']:.3f} (flagged {report['flag_recall']:.3f})  precision {report['precision']:.3f}  "
          f"false-block rate {report['false_block_rate']:.3f}  judge rate {report['judge_rate']:.3f}"
          + (f"  valid verdicts {report['judge_valid_rate']:.3f}" if report["judge_valid_rate"] is not None else ""))
    lat = report["latency_ms"]
    print(f"latency: rules p50 {lat['rules_p50']:.2f} ms, p99 {lat['rules_p99']:.2f} ms; "
          f"judge p50 {lat['judge_p50']:.0f} ms, p99 {lat['judge_p99']:.0f} ms")
    print(f"{'category':<32} {'recall':>7} {'flagged':>8}")
    for cat, rec in report["recall_by_category"].items():
        print(f"{cat:<32} {rec:7.2f} {report['flag_recall_by_category'][cat]:8.2f}")
    if report["missed_hacks"]:
        print("missed hacks:", ", ".join(report["missed_hacks"]))
    if report["false_blocks"]:
        print("false blocks:", ", ".join(report["false_blocks"]))
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main()
