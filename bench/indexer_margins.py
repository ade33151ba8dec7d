"""What margin-gated indexer replay would ship at GLM-5.2's top-2048: the indexer's score error between SGLang's
rounding (FP8 q and k, bf16 head gates: `Indexer.engine_rounded`) and fp32, and the rows whose margin is under 2ε.

    python bench/indexer_margins.py --lengths 2560 4096 8192            # both token sets
    python bench/indexer_margins.py --lengths 2200 --sample 32           # a smoke run

One indexer with the dimensions of `glm52-small` (32 heads of 128, q_lora 512, hidden 1024: GLM-5.2's own indexer
shape) and top-k 2,048, random weights, scores sequences of each length on layer 0's inputs (the token embeddings,
RMS-normed; the queries from the q_lora projection, RMS-normed) twice: in fp32, as the trainer does, and rounded as
the engine does. Per length it reports:

- ε: the largest |I_engine − I_fp32| over a sample of queries (the last `--sample` ones) and all their keys, and
  the 99.9th percentile;
- the rows whose two selections differ (as sets) among the rows with a choice (queries past the first k keys),
  and the largest fp32 margin among them: margin gating is sound when it is ≤ 2ε;
- the share of rows with a choice whose margin is under τ = 2ε_max (what the engine would ship) and the bytes a
  token and full layer that costs, against a full replay's 4k bytes; and the share at fixed τ from 1e-6 to 1e-2
  (scores are ~0.15 in the median), to read the cost off for whatever ε the engine's kernel turns out to have.

Two trainers against one engine: the engine scores SGLang's rounded inputs (`Indexer.engine_rounded`) summed in
float64 (another accumulation order); the fp32 trainer scores the unrounded inputs (what `indexer_fp8=false`
does), the FP8 trainer the rounded ones in fp32 (`indexer_fp8=true`). SGLang's real kernel accumulates FP8 tensor-
core products in its own way, so its ε against the FP8 trainer is to be measured on the GPU; this bench bounds
what rounding alone does.

Two token sets, made independently: uniform random ids, and this repository's own docs as text (repeated tokens
give repeated keys, and near-ties). Random weights stand in for a trained model: the figures estimate the
mechanism's cost and soundness, they do not predict a trained GLM-5.2's margins. Results: docs/BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from models.glm5.config import Glm5Config  # noqa: E402
from models.glm5.indexer import Indexer  # noqa: E402
from models.glm5.layers import RMSNorm, rope_angles  # noqa: E402
from models.glm5.tiny import SMALL_CONFIG  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TAUS = (1e-6, 1e-5, 1e-4, 1e-3, 1e-2)


def token_sets(length: int, vocab: int, seed: int) -> dict[str, torch.Tensor]:
    from models import load_tokenizer

    g = torch.Generator().manual_seed(seed)
    text = "\n\n".join(p.read_text() for p in sorted((ROOT / "docs").glob("*.md")))
    ids = load_tokenizer("HuggingFaceTB/SmolLM2-135M-Instruct")(text)["input_ids"]
    if len(ids) < length:
        raise SystemExit(f"docs/ hold {len(ids)} tokens, fewer than --lengths {length}")
    start = int(torch.randint(0, len(ids) - length + 1, (1,), generator=g))
    return {"random": torch.randint(0, vocab, (1, length), generator=g),
            "docs": torch.tensor([ids[start:start + length]])}


def measure(indexer: Indexer, embed: torch.nn.Embedding, norms, q_a: torch.nn.Linear, ids: torch.Tensor,
            sample: int) -> dict:
    cfg_rope, theta = indexer.rope_dim, 8_000_000.0
    s = ids.shape[1]
    positions = torch.arange(s)[None]
    cos, sin = rope_angles(positions, cfg_rope, theta)
    with torch.no_grad():
        x = norms[0](embed(ids))
        c_q = norms[1](q_a(x))
        q, w, k = indexer.queries(c_q, cos, sin), indexer.head_weights(x), indexer.keys(x, cos, sin)
    rq, rw, rk = indexer.engine_rounded(q, w, k)
    started = time.perf_counter()
    fp32, fp32_margin = indexer.select(q, w, k, positions, None, margins=True)
    indexer.fp8 = True  # the trainer scoring as the engine rounds (`indexer_fp8`)
    fp8, fp8_margin = indexer.select(q, w, k, positions, None, margins=True)
    indexer.fp8 = False
    seconds = time.perf_counter() - started
    engine = select_float64(indexer, rq, rw, rk)  # the engine: the same rounded inputs, summed otherwise
    a = s - sample  # ε over the last `sample` queries and every key they see
    visible = (torch.arange(s)[None, :] <= torch.arange(a, s)[:, None])
    with torch.no_grad():
        exact = indexer.scores(q[:, a:], w[:, a:], k)[0][visible]
        trainer_fp8 = indexer.scores(rq[:, a:], rw[:, a:], rk)[0][visible]
        engine_scores = scores_float64(indexer, rq[:, a:], rw[:, a:], rk)[0][visible]
    common = {"length": s, "rows_with_a_choice": int((positions[0] >= indexer.topk).sum()),
              "score_scale_median": float(exact.abs().median()), "select_s": seconds}
    return {**common,
            "fp32_trainer": gate(indexer, fp32, fp32_margin, engine, (engine_scores - exact).abs(), s),
            "fp8_trainer": gate(indexer, fp8, fp8_margin, engine, (engine_scores - trainer_fp8).abs(), s)}


def scores_float64(indexer: Indexer, q: torch.Tensor, w: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """The indexer's scores of already-rounded inputs summed in float64 (another accumulation order than ours)."""
    dots = torch.einsum("bchd,btd->bcht", q.double(), k.double()) * indexer.head_dim ** -0.5
    return torch.einsum("bcht,bch->bct", torch.relu(dots), w.double()).float()


def select_float64(indexer: Indexer, q, w, k, chunk: int = 256) -> torch.Tensor:
    """The top-k of `scores_float64`, causal, [1, S, k] (−1 where fewer keys are visible)."""
    s = q.shape[1]
    out = torch.full((1, s, min(indexer.topk, s)), -1, dtype=torch.long)
    for a in range(0, s, chunk):
        v = scores_float64(indexer, q[:, a:a + chunk], w[:, a:a + chunk], k[:, :a + chunk])
        ok = torch.arange(v.shape[-1])[None, None, :] <= torch.arange(a, a + v.shape[1])[None, :, None]
        vals, idx = v.masked_fill(~ok, float("-inf")).topk(min(indexer.topk, v.shape[-1]), dim=-1)
        out[:, a:a + v.shape[1], :idx.shape[-1]] = idx.masked_fill(vals == float("-inf"), -1)
    return out


def gate(indexer: Indexer, own: torch.Tensor, margin: torch.Tensor, engine: torch.Tensor, err: torch.Tensor,
         s: int) -> dict:
    """A trainer's selection and margins against the engine's, with the score error `err` between them."""
    topk = indexer.topk
    chosen = torch.arange(s) >= topk  # the rows with a choice: more visible keys than k
    differ = (own.sort(-1).values != engine.sort(-1).values).any(-1)[0] & chosen
    eps = float(err.max())
    tau = 2 * eps
    m = margin[0][chosen]
    shipped = float((m < tau).float().mean()) if len(m) else 0.0
    return {"eps_max": eps, "eps_p999": float(err.float().quantile(0.999)) if err.numel() < 2 ** 24 else None,
            "rows_differing": int(differ.sum()),
            "largest_margin_of_a_differing_row": float(margin[0][differ].max()) if bool(differ.any()) else None,
            "sound_at_2eps": bool((margin[0][differ] < tau).all()), "tau": tau,
            "rows_with_margin_0": int((m == 0).sum()),
            "shipped_frac_of_rows_with_a_choice": shipped,
            # whatever ε the engine turns out to have: the share shipped at τ (relative to the median |score|)
            "shipped_frac_at_tau": {f"{t:g}": float((m < t).float().mean()) if len(m) else 0.0 for t in TAUS},
            "shipped_bytes_per_token_per_full_layer": shipped * len(m) / s * (4 + 2 + 4 * topk),
            "full_replay_bytes_per_token_per_full_layer": 4 * topk}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lengths", type=int, nargs="+", default=[2560, 4096, 8192])
    p.add_argument("--topk", type=int, default=2048)
    p.add_argument("--sample", type=int, default=128, help="queries whose scores give ε")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--out", type=str, default="")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    cfg = Glm5Config(**{**SMALL_CONFIG, "vocab_size": 49152, "index_topk": args.topk, "dtype": "float32"})
    torch.manual_seed(args.seed)
    indexer = Indexer(cfg)
    with torch.no_grad():  # the LayerNorm's gain and bias away from 1 and 0, as a trained one's are
        indexer.k_norm.weight.normal_(1.0, 0.1)
        indexer.k_norm.bias.normal_(0.0, 0.05)
    embed = torch.nn.Embedding(cfg.vocab_size, cfg.hidden_size)
    norms = (RMSNorm(cfg.hidden_size, cfg.rms_norm_eps), RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps))
    q_a = torch.nn.Linear(cfg.hidden_size, cfg.q_lora_rank, bias=False)
    results = []
    for length in args.lengths:
        for name, ids in token_sets(length, cfg.vocab_size, args.seed).items():
            r = {"tokens": name, **measure(indexer, embed, norms, q_a, ids, min(args.sample, length))}
            results.append(r)
            for side in ("fp32_trainer", "fp8_trainer"):
                g = r[side]
                print(f"{name:>6} L={length:>5} {side:>12}: ε {g['eps_max']:.2e} (p99.9 {g['eps_p999']:.2e}; "
                      f"median |I| {r['score_scale_median']:.2e}) | rows differing {g['rows_differing']}/"
                      f"{r['rows_with_a_choice']}, all under 2ε: {g['sound_at_2eps']} | margin 0: "
                      f"{g['rows_with_margin_0']} | shipped at τ=2ε: {g['shipped_frac_of_rows_with_a_choice']:.1%},"
                      f" {g['shipped_bytes_per_token_per_full_layer']:.0f} B/token/layer (full replay "
                      f"{g['full_replay_bytes_per_token_per_full_layer']}) | shipped at τ "
                      + ", ".join(f"{t}: {f:.1%}" for t, f in g["shipped_frac_at_tau"].items()), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({"args": vars(args), "results": results}, indent=1))


if __name__ == "__main__":
    main()
