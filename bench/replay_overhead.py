"""What routed-expert replay costs the trainer: the same forwards with and without the engine's experts replayed.

    python bench/replay_overhead.py --device cuda --config small --rows 16 --seq 1024 [--profile]
    python bench/replay_overhead.py --device cpu --config tiny --rows 4 --seq 128       # a smoke run

A seeded GLM-5.2-architecture policy scores a batch of rows twice per measurement, through the trainer's own
`policy_logprobs`: once routing itself, once with `routed_experts` [B, T, layers, k] replayed. The replayed ids
are the model's own choices (`return_routing="experts"`), so both runs do the same expert work and any gap is
the replay's own cost (the ids' transfer and dtype, the per-layer views, the router's merge). Measured: the
no-grad pass (π_old / π_ref) and forward + backward (the update), median seconds over `--repeats` after a warm-up,
and the ratio replay / own. With `--profile`, torch.profiler's top operators of one replayed and one own
forward + backward are printed side by side (where the difference goes).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from models.glm5.config import Glm5Config  # noqa: E402
from models.glm5.tiny import SMALL_CONFIG, TINY_CONFIG, build_random  # noqa: E402
from models.logprobs import policy_logprobs  # noqa: E402

CONFIGS = {"tiny": dict(TINY_CONFIG, vocab_size=512), "small": dict(SMALL_CONFIG, vocab_size=49152)}


def own_routing(model, ids: torch.Tensor) -> torch.Tensor:
    """The experts the model chooses for `ids`, as an engine reports them: int16 [B, T, layers, k], −1 for dense
    layers (the rollout's layout after `to_samples`)."""
    with torch.no_grad():
        out = model(input_ids=ids, return_routing="experts", use_cache=False, logits_to_keep=1)
    layers, k = model.config.num_hidden_layers, model.config.num_experts_per_tok
    routed = torch.full((*ids.shape, layers, k), -1, dtype=torch.int16)
    for layer, experts in out.routed_experts.items():
        routed[:, :, layer] = experts.to("cpu", torch.int16)
    return routed


def timed(fn, device: str, repeats: int) -> float:
    fn()  # warm-up (kernels compiled, allocator grown)
    times = []
    for _ in range(repeats):
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--config", choices=sorted(CONFIGS), default="small")
    p.add_argument("--rows", type=int, default=16)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--profile", action="store_true")
    p.add_argument("--out", default="")
    args = p.parse_args()
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    model = build_random(Glm5Config(**CONFIGS[args.config]), seed=0).to(args.device, dtype)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(2, model.config.vocab_size, (args.rows, args.seq), generator=g)
    mask = torch.ones_like(ids)
    only = torch.zeros_like(ids, dtype=torch.bool)
    only[:, args.seq // 2:] = True  # the actions: the later half of each row
    ids, mask, only = ids.to(args.device), mask.to(args.device), only.to(args.device)
    model.eval()
    routed = own_routing(model, ids)  # on the host, as a micro-batch's field arrives before it moves

    def score(replay: bool, backward: bool):
        experts = routed.to(args.device) if replay else None
        if backward:
            logp, _ = policy_logprobs(model, ids, mask, only=only, routed_experts=experts)
            (-(logp * only).sum() / only.sum()).backward()
            model.zero_grad(set_to_none=True)
        else:
            with torch.no_grad():
                policy_logprobs(model, ids, mask, only=only, routed_experts=experts)

    with torch.no_grad():  # replaying the model's own choices must give its own logprobs
        a, _ = policy_logprobs(model, ids, mask, only=only)
        b, _ = policy_logprobs(model, ids, mask, only=only, routed_experts=routed.to(args.device))
    result = {"device": args.device, "config": args.config, "rows": args.rows, "seq": args.seq,
              "dtype": str(dtype), "replay_equals_own_max_abs": float((a - b).abs().max()),
              "routed_bytes_per_token": routed[0, 0].numel() * routed.element_size()}
    for phase, backward in (("no_grad", False), ("fwd_bwd", True)):
        own = timed(lambda: score(False, backward), args.device, args.repeats)
        replay = timed(lambda: score(True, backward), args.device, args.repeats)
        result[phase] = {"own_s": own, "replay_s": replay, "replay_over_own": replay / own}
        print(f"{phase:8s} own {own:.4f} s   replay {replay:.4f} s   replay/own {replay / own:.3f}", flush=True)
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if args.device == "cuda" else [])
        key = "cuda_time_total" if args.device == "cuda" else "cpu_time_total"
        for replay in (False, True):
            with profile(activities=activities) as prof:
                score(replay, True)
                if args.device == "cuda":
                    torch.cuda.synchronize()
            print(f"\n=== {'replayed' if replay else 'own routing'}: forward + backward, top operators by {key}")
            print(prof.key_averages().table(sort_by=key, row_limit=15))
    print(json.dumps(result, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
