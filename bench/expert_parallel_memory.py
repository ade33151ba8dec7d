"""What one rank holds under expert parallelism and ZeRO-2, measured, against the arithmetic docs/SCALING.md uses
for GLM-5.2 at 744B.

    python bench/expert_parallel_memory.py [--ranks 4] [--eps 1 2 4] [--experts 64] [--layers 6]

A GLM-5.2-shaped model scaled down (the routed experts are most of the parameters, as in the real one: 97% there)
is trained one step on R gloo ranks (CPU) with E = each of `--eps`, through the trainer's own DeepSpeed set-up
(models/deepspeed_worker.py, models/glm5/expert_parallel.py). Per rank, measured after the step: the weights it holds
(dense and expert parameters), and the optimizer state ZeRO gave it (the fp32 master partition and Adam's two
moments). Predicted, per rank, from the parameter counts alone:

    weights    = dense + experts / E                       (whole, in the training dtype)
    optimizer  = 3 × trained / R  fp32 numbers   (master, m, v: ZeRO-1/2 partition the trained parameters, all
                                                  but the frozen DSA indexer, over R; the experts within the
                                                  R / E ranks that hold them)

Printed as ratios against E = 1 measured in the same run. Gradients follow the optimizer's partition under ZeRO-2
(one number per partitioned parameter).
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import tempfile

import torch
import torch.multiprocessing as mp


def config(experts: int, layers: int):
    from models.glm5.config import Glm5Config
    from models.glm5.tiny import TINY_CONFIG

    return Glm5Config(vocab_size=2048, **{**TINY_CONFIG, "hidden_size": 128, "moe_intermediate_size": 128,
                                         "n_routed_experts": experts, "num_hidden_layers": layers,
                                         "first_k_dense_replace": 1, "num_nextn_predict_layers": 0})


def _rank(rank: int, world: int, ep: int, experts: int, layers: int, port: int, out: str) -> None:
    from models.glm5.expert_parallel import shard_experts
    from models.glm5.tiny import build_random
    from models.deepspeed_worker import DistEnv, deepspeed_engine, init_distributed

    torch.set_num_threads(1)
    init_distributed(DistEnv(rank=rank, world_size=world, master_port=port))
    model = build_random(config(experts, layers))
    if ep > 1:
        shard_experts(model, ep)
    engine = deepspeed_engine(model, 1e-3, 0.0, 1.0, 2, torch.float32)
    ids = torch.randint(0, 2048, (1, 64), generator=torch.Generator().manual_seed(rank))
    engine.set_gradient_accumulation_boundary(True)
    loss = engine.module(input_ids=ids).logits.float().logsumexp(-1).mean()
    engine.backward(loss)
    engine.step()
    params = list(engine.module.parameters())
    dense = sum(p.numel() for p in params if getattr(p, "allreduce", True))
    local_experts = sum(p.numel() for p in params if not getattr(p, "allreduce", True))
    if ep == 1:  # no shards: count the routed experts' weights by name
        local_experts = sum(p.numel() for n, p in engine.module.named_parameters() if ".mlp.experts." in n)
        dense -= local_experts
    opt = engine.optimizer
    master = sum(t.numel() for t in opt.single_partition_of_fp32_groups)
    moments = sum(v.numel() for t in opt.single_partition_of_fp32_groups
                  for v in opt.optimizer.state[t].values() if torch.is_tensor(v) and v.dim() > 0)
    frozen = sum(p.numel() for p in params if not p.requires_grad)  # the DSA indexer (frozen in RL)
    row = {"rank": rank, "dense": dense, "experts": local_experts, "frozen": frozen,
           "optimizer_fp32": master + moments}
    parts = [None] * world
    torch.distributed.all_gather_object(parts, row)
    if rank == 0:
        with open(out, "wb") as f:
            pickle.dump(parts, f)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--eps", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--layers", type=int, default=6)
    args = parser.parse_args()
    from models.deepspeed_worker import free_port

    results = []
    for ep in args.eps:
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "ranks.pkl")
            mp.spawn(_rank, args=(args.ranks, ep, args.experts, args.layers, free_port(), out), nprocs=args.ranks,
                     join=True)
            with open(out, "rb") as f:
                ranks = pickle.load(f)
        worst = max(ranks, key=lambda r: r["dense"] + r["experts"] + r["optimizer_fp32"])
        results.append({"ep": ep, **{k: worst[k] for k in ("dense", "experts", "frozen", "optimizer_fp32")}})
    base = results[0]
    total_experts, dense = base["experts"] * base["ep"], base["dense"]
    print(f"model: {dense / 1e6:.2f} M dense + {total_experts / 1e6:.2f} M routed-expert parameters "
          f"({total_experts / (dense + total_experts):.1%} experts, {base['frozen'] / 1e6:.2f} M frozen); {args.ranks} "
          "ranks, ZeRO-2, the largest rank")
    print(f"{'E':>3} {'weights M':>10} {'predicted':>10} {'optim fp32 M':>13} {'predicted':>10} "
          f"{'weights vs E=1':>15} {'optim vs E=1':>13}")
    for r in results:
        weights, optim = r["dense"] + r["experts"], r["optimizer_fp32"]
        p_weights = dense + total_experts / r["ep"]
        p_optim = 3 * (dense + total_experts - base["frozen"]) / args.ranks
        print(f"{r['ep']:>3} {weights / 1e6:>10.3f} {p_weights / 1e6:>10.3f} {optim / 1e6:>13.3f} "
              f"{p_optim / 1e6:>10.3f} {weights / (base['dense'] + base['experts']):>15.3f} "
              f"{optim / base['optimizer_fp32']:>13.3f}")
    print(json.dumps({"ranks": args.ranks, "results": results}))


if __name__ == "__main__":
    main()
