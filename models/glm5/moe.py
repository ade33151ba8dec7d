"""GLM/DeepSeek-V3 mixture of experts: fp32 sigmoid router with a bias used for selection only, shared expert.

Routing (docs/GLM52.md §4.6), per token with hidden x (post-attention-normed):

    ℓ = x W_gᵀ (fp32),  σ = sigmoid(ℓ),  u = σ + b          (b = e_score_correction_bias, an fp32 buffer)
    groups: split the E experts into n_group groups, score a group by the sum of its top-2 u, keep the best
            topk_group groups, set u = −∞ elsewhere                         (a no-op for GLM: n_group = 1)
    E_t = TopK_{k_e}(u)
    g_e = σ_e / (Σ_{e'∈E_t} σ_{e'} + 1e-20) · routed_scaling_factor   (norm_topk_prob; else σ_e · factor)
    y = Σ_{e∈E_t} g_e FFN_e(x) + FFN_shared(x)

The bias moves *which* experts are picked, never the weights. It must stay fp32: GLM-5.2's bias values sit where
bf16 has only a few ULPs of spread and rounding reorders the top-k (SGLang's warning), so `Router` keeps the
buffer in fp32 through `model.to(bfloat16)`. It is a frozen buffer (the aux-free update rule is a pretraining
mechanism). The router weight may be stored in any dtype; its matmul runs in fp32.

Replay: given the expert ids the rollout engine chose ([B, S, k_e]), those replace the selection and the gates
are recomputed from σ at those ids (so the router still gets gradients); a token whose row holds −1 (a position
the engine never ran) keeps its own selection.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from models.glm5.config import Glm5Config
from models.glm5.layers import SwiGLU


class Router(nn.Module):
    def __init__(self, config: Glm5Config):
        super().__init__()
        self.top_k = config.num_experts_per_tok
        self.n_experts = config.n_routed_experts
        self.n_group, self.topk_group = config.n_group, config.topk_group
        self.norm_topk_prob = config.norm_topk_prob
        self.scaling = config.routed_scaling_factor
        self.weight = nn.Parameter(torch.empty(self.n_experts, config.hidden_size))
        self.register_buffer("e_score_correction_bias", torch.zeros(self.n_experts, dtype=torch.float32))

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)
        bias = self._buffers["e_score_correction_bias"]
        if bias is not None and bias.dtype != torch.float32 and bias.device.type != "meta":
            self._buffers["e_score_correction_bias"] = bias.float()
        return self

    def select(self, u: torch.Tensor) -> torch.Tensor:
        """Group-limited top-k on the selection scores u [N, E] → expert ids [N, k_e]."""
        if self.n_group > 1:
            grouped = u.view(-1, self.n_group, self.n_experts // self.n_group)
            group_score = grouped.topk(min(2, grouped.shape[-1]), dim=-1).values.sum(-1)  # [N, n_group]
            keep = torch.zeros_like(group_score, dtype=torch.bool)
            keep.scatter_(1, group_score.topk(self.topk_group, dim=-1).indices, True)
            u = grouped.masked_fill(~keep[..., None], float("-inf")).view_as(u)
        return u.topk(self.top_k, dim=-1).indices

    def forward(self, x: torch.Tensor, replay: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """x [N, D] → (gates [N, k_e] fp32, expert ids [N, k_e])."""
        sigma = torch.nn.functional.linear(x.float(), self.weight.float()).sigmoid()
        with torch.no_grad():
            ids = self.select(sigma + self.e_score_correction_bias.float())
            if replay is not None:
                # a token the engine never ran (−1: padding, a trajectory's last token) keeps its own choice; the
                # own choice is always computed, as asking whether any is missing would cost a host sync
                replay = replay.to(device=x.device, dtype=torch.long)
                ids = torch.where((replay < 0).any(-1, keepdim=True), ids, replay)
        gates = sigma.gather(1, ids)
        if self.norm_topk_prob:
            gates = gates / (gates.sum(-1, keepdim=True) + 1e-20)
        return gates * self.scaling, ids


class MoE(nn.Module):
    def __init__(self, config: Glm5Config):
        super().__init__()
        self.n_experts = config.n_routed_experts
        self.gate = Router(config)
        self.experts = nn.ModuleList(
            SwiGLU(config.hidden_size, config.moe_intermediate_size) for _ in range(config.n_routed_experts))
        self.shared_experts = (SwiGLU(config.hidden_size, config.moe_intermediate_size * config.n_shared_experts)
                               if config.n_shared_experts > 0 else None)
        # Under ZeRO-3 over several ranks every rank must call every expert, in the same order, even on zero
        # tokens: each call gathers that expert's shards (a collective) and its backward reduces its gradient.
        # Set by models.glm5.parallel.prepare_for_zero3; off otherwise (idle experts cost kernel launches).
        self.run_idle_experts = False
        if config.moe_impl not in ("auto", "loop", "grouped"):
            raise ValueError(f"moe_impl must be 'auto', 'loop' or 'grouped', got {config.moe_impl!r}")
        self.impl = config.moe_impl
        # Expert parallelism (models/glm5/expert_parallel.py) replaces `experts` with this rank's share of them
        self.expert_parallel = False

    def use_grouped(self, x: torch.Tensor) -> bool:
        """Grouped GEMMs on a GPU ("auto"), never under ZeRO-3 (its parameters are gathered by each expert
        module's forward hook, whatever the world size, so the stacked weights would be empty placeholders), and
        wherever asked ("grouped", also on the CPU: how the tests compare the two)."""
        if self.impl == "loop" or not hasattr(torch, "_grouped_mm"):
            return False
        if not self.expert_parallel:  # (expert parallelism runs under ZeRO-1/2 only: models/deepspeed_worker.py)
            zero3 = self.run_idle_experts or hasattr(self.experts[0].gate_proj.weight, "ds_id")  # DeepSpeed's mark
            if zero3:
                return False
        return self.impl == "grouped" or x.is_cuda

    def forward(self, x: torch.Tensor, replay: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """x [B, S, D] → (y [B, S, D], expert ids [B, S, k_e]). `replay` [B, S, k_e]: expert ids to use."""
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        gates, ids = self.gate(flat, None if replay is None else replay.reshape(-1, replay.shape[-1]))
        k = ids.shape[-1]
        # dispatch: sort the N·k (token, expert) pairs by expert, run each expert once on its tokens
        flat_ids = ids.flatten()
        order = flat_ids.argsort(stable=True)
        # counted by a scatter, not bincount: bincount reads its maximum to the host, a sync in every MoE layer
        counts = flat_ids.new_zeros(self.n_experts).scatter_add_(0, flat_ids, torch.ones_like(flat_ids))
        tokens = order // k
        weights = gates.flatten()[order]
        rows = flat[tokens]  # the (token, expert) pairs' inputs, sorted by expert
        if self.expert_parallel:  # models/glm5/expert_parallel.py: to the experts' ranks and back
            out = self.experts(rows, counts, self.use_grouped(flat), self.run_idle_experts)
        else:
            out = expert_outputs(rows, flat_ids[order], counts, self.experts,
                                 self.use_grouped(flat), self.run_idle_experts)
        y = torch.zeros_like(flat).index_add_(0, tokens, (out * weights[:, None]).to(flat.dtype))
        if self.shared_experts is not None:
            y = y + self.shared_experts(flat)
        return y.view(shape), ids.view(*shape[:-1], k)


def expert_outputs(rows: torch.Tensor, expert: torch.Tensor, counts: torch.Tensor, experts, grouped: bool,
                   run_idle: bool = False) -> torch.Tensor:
    """Each expert's SwiGLU on its rows: `rows` [P, D] sorted by expert (`expert` [P] their ids, `counts` [E] how
    many each has) → [P, D] in the same order. One loop over the experts, or (`grouped`) two grouped GEMMs;
    `run_idle` calls an expert with no rows too (on zero rows), for the collectives of ZeRO-3 and the gradient
    buckets of ZeRO-1/2, which every rank must reach alike."""
    if grouped:
        return _grouped_swiglu(rows, expert, counts, experts)
    outs, start = [], 0
    for e, n in enumerate(counts.tolist()):
        if n or run_idle:
            outs.append(experts[e](rows[start:start + n]))
        start += n
    return torch.cat(outs) if outs else rows[:0].clone()


def _grouped_swiglu(rows: torch.Tensor, expert: torch.Tensor, counts: torch.Tensor, experts) -> torch.Tensor:
    """`expert_outputs` as two grouped GEMMs over the stacked expert weights instead of 3·E small ones.

    Why: E separate matmuls with a different row count each cost a cuBLAS heuristic lookup and a launch per call
    (on the H200 the 8-layer kernel config spent more host time in aten::mm than the GPU spent on the whole step),
    and need the per-expert counts on the host (a sync). Each expert's rows start at a multiple of 16, the
    alignment the grouped GEMM kernels want (padding rows are zero, belong to a group and are never read back);
    the buffer has a fixed upper size, so nothing here reads back to the host (expert parallelism's all-to-all
    needs its split sizes there, once a layer). Every expert's weights take part (one without rows gets a zero
    gradient)."""
    n_pairs, dim, align, n_experts = rows.shape[0], rows.shape[-1], 16, len(experts)
    padded = (counts + align - 1) // align * align
    pad_end = padded.cumsum(0)
    first = counts.cumsum(0) - counts  # each expert's first pair in the sorted order
    pos = (pad_end - padded)[expert] + torch.arange(n_pairs, device=rows.device) - first[expert]
    total = n_pairs + (align - 1) * n_experts
    x = rows.new_zeros(total, dim).index_copy(0, pos, rows)
    offs = F.pad(pad_end[:-1], (0, 1), value=total).to(torch.int32)  # the tail rows: the last expert's
    w_gate_up = torch.stack([torch.cat([e.gate_proj.weight, e.up_proj.weight]) for e in experts])
    w_down = torch.stack([e.down_proj.weight for e in experts])
    gate, up = torch._grouped_mm(x, w_gate_up.transpose(1, 2), offs=offs).chunk(2, dim=-1)
    h = torch._grouped_mm(torch.nn.functional.silu(gate) * up, w_down.transpose(1, 2), offs=offs)
    return h[pos]
