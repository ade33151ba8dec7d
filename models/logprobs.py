"""Per-token log-probabilities and values, computed in sequence chunks.

Full-vocabulary logits for a whole batch are the largest activation of a policy forward ([B, T, V] floats:
4 × 2048 × 49152 × 4 B = 1.6 GB for SmolLM2). We run the backbone once, then the LM head and the log-softmax
chunk by chunk under activation checkpointing, so at most [B, chunk, V] logits live at a time, forward and
backward.

Alignment (docs/ALGORITHMS.md §0.3): position t of the output holds log π(x_t | x_<t), i.e. it comes from the hidden
state at t-1. Position 0 has no prediction and is 0.
"""

from __future__ import annotations

import inspect

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint


def _chunk_logprobs(head: nn.Module, hidden: torch.Tensor, targets: torch.Tensor, inv_temperature: float,
                    with_entropy: bool):
    # The head in the weights' precision even under bf16 autocast (OptimConfig.bf16_autocast): bf16 logits of ~20
    # are off by up to ~0.06, as much as the policy moves in a PPO step; only the action positions reach it.
    with torch.autocast(hidden.device.type, enabled=False):
        logits = head(hidden.to(head.weight.dtype)).float()
    if inv_temperature != 1.0:
        logits = logits * inv_temperature
    if not with_entropy:  # fused log-softmax + gather: the cheapest path through [B, chunk, V]
        logp = -F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="none").view_as(targets)
        return logp, torch.zeros_like(logp)
    logsm = torch.log_softmax(logits, dim=-1)
    logp = logsm.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    entropy = -(logsm.exp() * logsm).sum(-1)
    return logp, entropy


def local_indexer_replay(indexer_topk, sequence):
    """A sequence-parallel rank's share of an indexer replay: its queries' rows (the keys span the sequence)."""
    if indexer_topk is None or isinstance(indexer_topk, dict):
        return {i: sequence.local(t) for i, t in (indexer_topk or {}).items()}
    return indexer_topk.local(sequence.lo, sequence.hi)


def replay_kwargs(routed_experts: torch.Tensor | None, indexer_topk=None) -> dict:
    """The model's replay arguments: `routed_experts` [B, T, layers, k] (the rollout engine's expert ids, −1
    where it ran no position) as {layer index: [B, T, k]}, the model reading its MoE layers' and ignoring the
    rest; `indexer_topk` (sparse rows or {full layer: [B, T, k]}) as it is, if it holds any row."""
    out = {"indexer_topk": indexer_topk} if indexer_topk else {}
    if routed_experts is None:
        return out
    return {**out, "routed_experts": {i: routed_experts[:, :, i] for i in range(routed_experts.shape[2])}}


def _mask_and_positions(attention_mask: torch.Tensor, position_ids: torch.Tensor | None) -> dict:
    """Padded rows: the mask, and positions counted over real tokens. Packed rows: their positions, no mask."""
    if position_ids is not None:
        return {"attention_mask": None, "position_ids": position_ids}
    return {"attention_mask": attention_mask, "position_ids": (attention_mask.long().cumsum(-1) - 1).clamp(min=0)}


def policy_logprobs(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    temperature: float = 1.0,
    chunk_size: int = 512,
    with_entropy: bool = False,
    only: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
    routed_experts: torch.Tensor | None = None,
    indexer_topk=None,
    sequence=None,
    head_calls: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """log π(x_t | x_<t) for every position of a right-padded batch → ([B, T], entropy [B, T]).

    `temperature` must equal the rollout temperature: the engine sampled from softmax(logits / T).
    `only` ([B, T], e.g. the loss mask): compute the LM head just at those positions (the others are 0). Agent
    traces are mostly prompt and observations, so this skips most of the [·, V] work and memory.
    `position_ids` (a packed row, models/batching.py): the samples' own positions; the model then gets no
    attention mask (the position resets delimit the samples) and `attention_mask` only says which positions
    are real tokens.
    `routed_experts` [B, T, layers, k] (a MoE policy): the experts the rollout engine chose, replayed so that the
    trainer's forward is the engine's (`replay_kwargs`). `indexer_topk` (a GLM-5.2 policy): the indexer rows the
    engine shipped (rollout/indexer_replay.py), sparse (`IndexerRows`, as micro-batches carry them) or dense
    ({full layer: [B, T, k]}, −1 rows selecting for themselves).
    `sequence` (a `models.glm5.sequence_parallel.SequenceShard`): this rank runs its chunk of the positions; the
    result holds its columns (`sequence.owned`), zeros elsewhere (`sequence.combine` sums the ranks' into the whole).
    `head_calls`: run the LM head exactly this many times (`head_calls_needed`, the most any rank needs): under
    ZeRO-3 each call gathers the head's weight and its backward reduces its gradient, collectives every rank must
    make alike, even a rank with nothing to predict (a sequence chunk of prompt only); by default as many as
    `chunk_size` rows a call take.
    """
    backbone = model.get_decoder() if hasattr(model, "get_decoder") else model.model
    if routed_experts is not None and "routed_experts" not in inspect.signature(backbone.forward).parameters:
        # transformers' MoE models take **kwargs and would drop it without a word
        raise ValueError(f"{type(model).__name__} takes no routed-expert replay (engine.return_routed_experts is "
                         "for GLM-5.2 policies, models/glm5)")
    if indexer_topk and "indexer_topk" not in inspect.signature(backbone.forward).parameters:
        raise ValueError(f"{type(model).__name__} takes no indexer replay (engine.indexer_replay_margin is for "
                         "GLM-5.2 policies, models/glm5)")
    head = model.get_output_embeddings()
    wanted = only if only is not None else attention_mask
    if sequence is None:
        hidden = backbone(input_ids=input_ids, **_mask_and_positions(attention_mask, position_ids), use_cache=False,
                          **replay_kwargs(routed_experts, indexer_topk)).last_hidden_state[:, :-1]
        targets, select = input_ids[:, 1:], wanted[:, 1:] > 0
    else:  # this rank's positions predict the next tokens, the sequence's last one nothing
        hidden = backbone(input_ids=sequence.local(input_ids), cache=sequence,
                          **_local_mask_and_positions(attention_mask, position_ids, sequence),
                          **replay_kwargs(sequence.local(routed_experts), local_indexer_replay(indexer_topk, sequence))
                          ).last_hidden_state
        targets, select = sequence.next_token(input_ids), sequence.next_token(wanted) > 0
    inv_t = 1.0 / max(temperature, 1e-6)
    h, y = hidden[select], targets[select]  # [N, H], [N]: the positions that need a prediction
    out_lp, out_ent = [], []
    calls = head_calls if head_calls is not None else head_calls_needed(select, input_ids.shape[0], chunk_size)
    # (an empty piece still calls the head, and keeps the backbone in the graph of a rank with nothing to predict)
    for piece, target in zip(h.tensor_split(calls), y.tensor_split(calls)) if calls else ():
        args = (head, piece.unsqueeze(0), target.unsqueeze(0), inv_t, with_entropy)
        lp, ent = checkpoint(_chunk_logprobs, *args, use_reentrant=False) if torch.is_grad_enabled() \
            else _chunk_logprobs(*args)
        out_lp.append(lp[0])
        out_ent.append(ent[0])
    logp = torch.zeros(select.shape, dtype=torch.float32, device=input_ids.device)
    entropy = torch.zeros_like(logp)
    if out_lp:
        logp = logp.masked_scatter(select, torch.cat(out_lp))
        entropy = entropy.masked_scatter(select, torch.cat(out_ent))
    if sequence is not None:
        return sequence.place(logp), sequence.place(entropy)
    return F.pad(logp, (1, 0)), F.pad(entropy, (1, 0))


def head_calls_needed(select: torch.Tensor, rows: int, chunk_size: int = 512) -> int:
    """LM-head calls for the positions `select` marks, `chunk_size` a row of the batch's `rows` rows a call."""
    return -(-int(select.sum()) // max(1, chunk_size * rows))


def _local_mask_and_positions(attention_mask: torch.Tensor, position_ids: torch.Tensor | None, sequence) -> dict:
    """`_mask_and_positions` for a sequence-parallel chunk: the mask stays whole (it covers every key), the
    positions are the chunk's."""
    out = _mask_and_positions(attention_mask, position_ids)
    return {**out, "position_ids": sequence.local(out["position_ids"])}


def token_values(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                 position_ids: torch.Tensor | None = None, sequence=None) -> torch.Tensor:
    """V(t) for every position, aligned like `policy_logprobs`: V(t) reads the hidden state at t-1 (the state
    in which the action x_t is chosen). Position 0 is 0. `position_ids`: a packed row, and `sequence`: a
    sequence-parallel chunk, as in `policy_logprobs`."""
    if sequence is not None:
        scores = model(input_ids=sequence.local(input_ids), cache=sequence,
                       **_local_mask_and_positions(attention_mask, position_ids, sequence)).logits
        return sequence.place(scores[..., 0].float())
    scores = model(input_ids=input_ids, **_mask_and_positions(attention_mask, position_ids)).logits
    values = scores[..., 0].float()
    return F.pad(values[:, :-1], (1, 0))
