"""Expert parallelism for GLM-5.2's MoE in the trainer: each rank of an expert group holds n_routed_experts / E
experts, and the (token, expert) pairs travel to the rank that owns their expert and back.

Layout (DeepSpeed's, `deepspeed.utils.groups`): the R ranks of a trainer form R / E expert groups of E
consecutive ranks ([0..E-1], [E..2E-1], …); rank r holds experts [(r mod E)·n/E, (r mod E + 1)·n/E). The ranks
that hold the same experts form an expert-data-parallel group ({r, r+E, r+2E, …}). The router, attention, the
indexer, the shared expert and everything else stay data-parallel over all R ranks.

One MoE layer, per rank, after the (data-parallel) router has chosen k experts for each of its N tokens:

    pairs sorted by expert (MoE.forward)  ──all-to-all──▶  the owners' ranks, grouped by source rank
    regroup by local expert, run the local experts (the same grouped GEMMs or loop as without EP)
    back to source order  ──all-to-all──▶  the pairs' ranks, in their original order; gates and the sum there

The split sizes are exchanged first (one small all-to-all of the per-expert counts), so no token is dropped and
no capacity factor changes the math: N ranks with E = N compute exactly what one rank does.

What DeepSpeed provides and what it does not: its expert and expert-data-parallel process groups, its gradient
reduction of expert parameters within their expert-data-parallel group (ZeRO-0) and its ZeRO-1/2 partitioning
of them there (parameters marked `allreduce = False` with their group's name, in an optimizer group of their
own), its expert-aware gradient norm under ZeRO-1/2, and its per-expert checkpoint files. DeepSpeed finds those
layers by their class, so `ExpertShard` subclasses its `MoE` (without its gate or capacity-based layer) and keeps
its local experts where DeepSpeed's checkpointing looks for them (`deepspeed_moe.experts.deepspeed_experts`).
Not used: DeepSpeed's MoE layer itself (its top-k gate with a capacity factor drops tokens and has no selection
bias), and AutoEP (its DeepSeek-V3 router has no aux-free selection bias, which GLM-5.2 routes by, and no
replay of the engine's experts). DeepSpeed's native MoE runs under ZeRO-1/2, not ZeRO-3: so does this (checked in
models.deepspeed_worker.OptimConfig); with the experts split E ways, ZeRO-3's parameter partitioning matters far less.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from deepspeed.moe.layer import MoE as DeepSpeedMoE
from deepspeed.utils import groups
from torch import nn

from models.glm5.checkpoint import AbsentExpert
from models.glm5.moe import MoE, expert_outputs

# Where DeepSpeed's checkpointing finds a MoE layer's local experts (engine._save_moe_checkpoint).
LOCAL_EXPERTS = "deepspeed_moe.experts.deepspeed_experts"


class _AllToAll(torch.autograd.Function):
    """Rows [sum(send), D] out, rows [sum(recv), D] in; the backward sends the gradients back the same way."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, send: list[int], recv: list[int], group) -> torch.Tensor:
        ctx.send, ctx.recv, ctx.group = send, recv, group
        out = x.new_empty(sum(recv), x.shape[-1])
        dist.all_to_all_single(out, x.contiguous(), recv, send, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        back = grad.new_empty(sum(ctx.send), grad.shape[-1])
        dist.all_to_all_single(back, grad.contiguous(), ctx.send, ctx.recv, group=ctx.group)
        return back, None, None, None


class ExpertShard(DeepSpeedMoE):
    """This rank's share of one MoE layer's routed experts (it replaces `MoE.experts`). Called with the layer's
    (token, expert) pair rows sorted by global expert id and the per-expert counts, it returns each pair's expert
    output in the same order, wherever the expert lives."""

    def __init__(self, experts: list[nn.Module], n_experts: int, ep_size: int):
        nn.Module.__init__(self)  # DeepSpeed's MoE.__init__ would build its own gate and experts
        self.num_experts, self.ep_size = n_experts, ep_size
        self.num_local_experts = n_experts // ep_size
        self.expert_group_name = f"ep_size_{ep_size}"
        self.group = groups._get_expert_parallel_group(self.expert_group_name)
        self.ep_rank = dist.get_rank(self.group)
        self.first = self.ep_rank * self.num_local_experts  # global id of local expert 0
        holder = nn.Module()
        holder.experts = nn.Module()
        holder.experts.deepspeed_experts = nn.ModuleList(experts)
        self.deepspeed_moe = holder
        for p in self.parameters():  # DeepSpeed's marks: reduce and partition within the expert-data-parallel group
            p.allreduce, p.group_name = False, self.expert_group_name

    @property
    def local(self) -> nn.ModuleList:
        return self.deepspeed_moe.experts.deepspeed_experts

    def set_deepspeed_parallelism(self, use_data_before_expert_parallel_: bool = False) -> None:
        """DeepSpeed's engine calls this on its MoE layers to make their groups; `shard_experts` made them."""

    def global_names(self, local_suffix: str) -> list[str]:
        """`deepspeed_moe.experts.deepspeed_experts.{j}.rest` → the HF suffix `{e}.rest` of local expert j on every
        rank of the expert group, in expert-group rank order."""
        j, rest = local_suffix[len(LOCAL_EXPERTS) + 1:].split(".", 1)
        return [f"{r * self.num_local_experts + int(j)}.{rest}" for r in range(self.ep_size)]

    def gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Local expert j's `tensor` from every rank of the expert group (a collective), in `global_names` order."""
        parts = [torch.empty_like(tensor) for _ in range(self.ep_size)]
        dist.all_gather(parts, tensor.contiguous(), group=self.group)
        return parts

    def forward(self, rows: torch.Tensor, counts: torch.Tensor, grouped: bool, run_idle: bool) -> torch.Tensor:
        """rows [P, D] sorted by global expert, counts [n_experts] → outputs [P, D] in the same order; `grouped`
        and `run_idle` as in `expert_outputs`."""
        E, n_local = self.ep_size, self.num_local_experts
        send_counts = counts.view(E, n_local)  # to each rank of the group, per its local expert
        recv_counts = torch.empty_like(send_counts)  # from each rank, per local expert of mine
        dist.all_to_all_single(recv_counts.view(-1), send_counts.reshape(-1).contiguous(), group=self.group)
        send, recv = send_counts.sum(1).tolist(), recv_counts.sum(1).tolist()  # the host needs the splits
        got = _AllToAll.apply(rows, send, recv, self.group)  # grouped by source rank, then by local expert
        local_ids = torch.arange(n_local, device=rows.device).repeat(E).repeat_interleave(
            recv_counts.flatten(), output_size=sum(recv))  # the size given: no second host sync
        order = local_ids.argsort(stable=True)
        out = expert_outputs(got[order], local_ids[order], recv_counts.sum(0), self.local, grouped, run_idle)
        back = torch.empty_like(out).index_copy(0, order, out)  # source order again
        return _AllToAll.apply(back, recv, send, self.group)


def expert_groups(ep_size: int) -> None:
    """DeepSpeed's expert and expert-data-parallel groups for `ep_size` (made once per process)."""
    world = dist.get_world_size()
    if ep_size < 1 or world % ep_size:
        raise ValueError(f"expert_parallel={ep_size} must divide the trainer's {world} ranks")
    if f"ep_size_{ep_size}" not in groups._get_expert_parallel_group_dict():
        groups._create_expert_and_data_parallel(ep_size)


def shard_experts(model: nn.Module, ep_size: int) -> int:
    """Keep this rank's experts in every MoE layer of `model` (made identically on every rank: same seed or
    checkpoint) and route through the expert group; returns the layers sharded."""
    layers = [m for m in model.modules() if isinstance(m, MoE)]
    if ep_size <= 1:
        return 0
    if not layers:
        raise ValueError(f"expert_parallel={ep_size}: the model has no MoE layers to split (only GLM-5.2-style "
                         "models do)")
    expert_groups(ep_size)
    rank = dist.get_rank(groups._get_expert_parallel_group(f"ep_size_{ep_size}"))
    for m in layers:
        if m.n_experts % ep_size:
            raise ValueError(f"expert_parallel={ep_size} must divide n_routed_experts={m.n_experts}")
        n_local = m.n_experts // ep_size
        mine = list(m.experts[rank * n_local:(rank + 1) * n_local])
        if any(isinstance(e, AbsentExpert) for e in mine):
            raise ValueError(f"expert-parallel rank {rank} of {ep_size} was loaded with another rank's experts "
                             "(load_model's expert_shard must follow the expert group's ranks)")
        m.experts = ExpertShard(mine, m.n_experts, ep_size)
        m.expert_parallel = True
    return len(layers)


def expert_shards(module: nn.Module) -> dict[str, ExpertShard]:
    """{module path: ExpertShard} of `module` (empty without expert parallelism)."""
    return {name: m for name, m in module.named_modules() if isinstance(m, ExpertShard)}


def global_parameter_names(module: nn.Module) -> dict[str, list[str]]:
    """Every local parameter name → the HF names it stands for: itself, or for a local expert's weight the same
    weight of every expert in its expert group (`ExpertShard.gather` order)."""
    shards = expert_shards(module)
    out = {}
    for name, _ in module.named_parameters():
        owner = next((path for path in shards if name.startswith(f"{path}.{LOCAL_EXPERTS}.")), None)
        if owner is None:
            out[name] = [name]
        else:
            out[name] = [f"{owner}.{suffix}" for suffix in shards[owner].global_names(name[len(owner) + 1:])]
    return out


def shard_of(module: nn.Module, name: str) -> ExpertShard | None:
    """The ExpertShard holding local parameter `name`, if any."""
    path = name.split(f".{LOCAL_EXPERTS}.")[0] if f".{LOCAL_EXPERTS}." in name else None
    return module.get_submodule(path) if path else None
