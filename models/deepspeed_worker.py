"""DeepSpeed set-up shared by the actor and the critic workers.

Each trainer (actor, critic) is its own DeepSpeed world. On one CPU process it is a world of size 1 on gloo;
the framework sets the rendezvous variables itself so that nobody needs a launcher or mpi4py. On GPU hosts the
Ray placement gives each rank its GPU and the same function is called with the rank's coordinates.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from models.batching import MicroBatch, TokenBatch, make_micro_batches, padding_micro_batch, ppo_mini_batches
from models.loading import supports_packed_sequences
from models.weight_stream import WeightBuckets, full_shapes, write_hf_streamed

log = logging.getLogger(__name__)

HF_SHARD_MB = 2048  # the HF export's shard size: one gathered shard in memory at a time


def release_memory() -> None:
    """Give freed activation memory back to the OS. On CPU, glibc keeps large freed blocks in the process, and
    the actor, critic and rollout processes share one machine's RAM."""
    import ctypes
    import gc

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for_count(store, key: str, target: int, increment: int = 1, timeout_s: float = 120.0) -> None:
    """Add `increment` to the store's counter `key`, then wait until it reaches `target` (a barrier over the
    rendezvous store, which needs no process group). A peer that died is reported after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while store.add(key, increment) < target:
        increment = 0
        if time.monotonic() > deadline:
            raise TimeoutError(f"{key}: peers did not arrive within {timeout_s:.0f} s")
        time.sleep(0.01)


@dataclass
class DistEnv:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 0


def expert_shard(dist: DistEnv | None, optim: "OptimConfig") -> tuple[int, int] | None:
    """(this rank's place in its expert-parallel group, E) for a sharded load, or None without expert parallelism.
    The groups are E consecutive ranks (DeepSpeed's `_create_expert_and_data_parallel`); `shard_experts` checks
    that the experts loaded are the ones the group gives the rank."""
    if optim.expert_parallel <= 1:
        return None
    return ((dist.rank if dist else 0) % optim.expert_parallel, optim.expert_parallel)


def init_distributed(env: DistEnv | None = None) -> str:
    """Set the torch.distributed rendezvous variables and initialise DeepSpeed's comm; returns the backend."""
    import deepspeed

    env = env or DistEnv()
    os.environ.update(
        RANK=str(env.rank), WORLD_SIZE=str(env.world_size), LOCAL_RANK=str(env.local_rank),
        MASTER_ADDR=env.master_addr, MASTER_PORT=str(env.master_port or free_port()),
    )
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "gloo":
        # DeepSpeed JIT-compiles a shared-memory allreduce op (about a minute on a fresh machine) for CPU
        # worlds; a world of one process never communicates, and a CPU world of several (tests, the embedded
        # default) is served well by gloo's own allreduce, so declare the op unavailable instead.
        import deepspeed.ops

        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    if not torch.distributed.is_initialized():
        deepspeed.init_distributed(dist_backend=backend, auto_mpi_discovery=False)
    return backend


def optimizer_groups(model: nn.Module, learning_rate: float, head_learning_rate: float = 0.0) -> list[dict]:
    """The trainable parameters as AdamW groups: one at `learning_rate`, and a value head's (`score.*`, the critic's
    one-output layer) at `head_learning_rate` when that is > 0 and differs.

    Why the head may need its own: it starts at zero, and Adam moves each weight by about the step size a step, so
    at a whole-model critic rate (1e-5) V(s) rises ~0.004 a step on a 576-wide SmolLM2 (docs/RESULTS.md: 0.06 after
    14 steps against returns of 0.6); the body's features are pretrained and want the small rate."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    head = [p for n, p in named if n.startswith("score.")] if head_learning_rate > 0 else []
    if head_learning_rate > 0 and not head:
        raise ValueError(f"head_learning_rate={head_learning_rate} for {type(model).__name__}, which has no value "
                         "head (`score.*` parameters): it is the critic's setting")
    if not head or head_learning_rate == learning_rate:
        return [{"params": [p for _, p in named], "name": "dense"}]
    head_ids = {id(p) for p in head}
    return [{"params": [p for _, p in named if id(p) not in head_ids], "name": "dense"},
            {"params": head, "name": "value_head", "lr": head_learning_rate}]


def deepspeed_engine(model: nn.Module, learning_rate: float, weight_decay: float, grad_clip: float,
                     zero_stage: int, dtype: torch.dtype, offload_optimizer: bool = False,
                     offload_params: bool = False, head_learning_rate: float = 0.0):
    """Wrap `model` in a DeepSpeed engine with a torch AdamW client optimizer.

    torch's AdamW needs no JIT build (DeepSpeed's CPU Adam takes 1-2 minutes to compile on first use); ZeRO
    partitions its state all the same. Gradient accumulation is driven by the caller through
    `set_gradient_accumulation_boundary`, because the number of micro-batches per step varies with the
    rollouts (compaction makes the segment count per step unknown in advance).

    `offload_optimizer` (ZeRO >= 1) keeps the fp32 master weights and Adam's moments in host memory and steps
    them there; `offload_params` (ZeRO-3) keeps the parameter shards there between uses. Both trade PCIe
    traffic for accelerator memory; on a CPU world they change nothing but run the same code.
    """
    import deepspeed

    if zero_stage >= 1 and torch.distributed.is_initialized():
        # ZeRO-1/2 reduce each gradient as backward produces it, ZeRO-3 also gathers each module's weights: the
        # ranks must run the same experts (models/glm5/parallel.py); ZeRO-0 reduces all gradients at the end.
        from models.glm5.parallel import prepare_for_zero3

        prepare_for_zero3(model, torch.distributed.get_world_size())
    groups = optimizer_groups(model, learning_rate, head_learning_rate)
    if any(not getattr(p, "allreduce", True) for g in groups for p in g["params"]):
        # expert parallelism (models/glm5/expert_parallel.py): ZeRO reduces and partitions the experts' weights
        # within their expert-data-parallel group, which it takes from optimizer groups marked `moe`
        from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

        groups = split_params_into_different_moe_groups_for_optimizer(groups)
    optimizer = torch.optim.AdamW(groups, lr=learning_rate, weight_decay=weight_decay, betas=(0.9, 0.999),
                                  eps=1e-8)
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": grad_clip,
        "zero_optimization": {"stage": zero_stage,
                              **({"offload_optimizer": {"device": "cpu"}} if offload_optimizer else {}),
                              **({"offload_param": {"device": "cpu"}} if offload_params else {})},
        # torch's AdamW steps the offloaded fp32 state on the host (DeepSpeedCPUAdam would need a JIT build)
        "zero_force_ds_cpu_optimizer": False,
        "bf16": {"enabled": dtype == torch.bfloat16},
        "fp16": {"enabled": dtype == torch.float16},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    return engine


def host_floats(values: list) -> list[float]:
    """`values` (floats and 0-d tensors) as floats, the tensors brought to the host together: one device sync for
    all of a step's statistics instead of one per statistic per micro-batch, each of which left the GPU idle while
    the host queued the next kernels (a dozen per micro-batch in the profiled update, docs/BENCHMARKS.md)."""
    out = list(values)
    at = [i for i, v in enumerate(values) if torch.is_tensor(v)]
    if at:
        device = values[at[0]].device
        host = torch.stack([values[i].detach().to(device, torch.float64).reshape(()) for i in at]).tolist()
        for i, v in zip(at, host):
            out[i] = v
    return [float(v) for v in out]


def forward_precision(device, bf16_autocast: bool):
    """The context of a worker's forward passes: bf16 autocast under OptimConfig.bf16_autocast, else nothing."""
    return torch.autocast(torch.device(device).type, dtype=torch.bfloat16, enabled=bf16_autocast)


def accumulate_and_step(engine, micro_losses, bf16_autocast: bool = False) -> float:
    """Backward every micro-batch loss (already scaled by the global denominator), then one optimiser step.

    `micro_losses` is an iterable of zero-argument callables so that each forward runs right before its own
    backward (only one micro-batch's activations alive at a time). Returns the gradient norm. With
    `bf16_autocast` each forward runs under bf16 autocast (the backward follows the forward's casts by itself).
    """
    losses = list(micro_losses)
    for i, compute in enumerate(losses):
        engine.set_gradient_accumulation_boundary(i == len(losses) - 1)
        # What engine.forward does before a forward and we must do too (our forwards call engine.module): ZeRO-3
        # counts micro-steps there, and at micro-step 0 a backward *replaces* the partitioned gradients instead
        # of adding to them; without it only the last micro-batch's gradient survived.
        if hasattr(engine.optimizer, "clear_backward_seen_flag"):
            engine.optimizer.clear_backward_seen_flag()
        with forward_precision(engine.device, bf16_autocast):
            loss = compute()
        engine.backward(loss, scale_wrt_gas=False)
    norm = engine.get_global_grad_norm() if engine.zero_optimization_stage() > 0 else None
    if norm is None:  # ZeRO-0 keeps plain .grad tensors: measure before the step clips them
        grads = [p.grad.detach().float().norm() for p in engine.module.parameters() if p.grad is not None]
        norm = torch.stack(grads).norm() if grads else torch.tensor(0.0)
    engine.step()
    if engine.zero_optimization_stage() > 0:
        norm = engine.get_global_grad_norm()
    return float(norm) if norm is not None else float("nan")


def to_universal(state: Path, out: Path) -> None:
    """DeepSpeed's conversion of a ZeRO checkpoint (`state`: one tag folder) into a universal one at `out`
    (in this process: no worker pool inside a Ray actor)."""
    import argparse
    import contextlib
    import io
    import shutil

    from deepspeed.checkpoint import ds_to_universal

    if out.exists():
        shutil.rmtree(out)
    args = argparse.Namespace(input_folder=str(state), output_folder=str(out), num_extract_workers=1,
                              num_merge_workers=1, keep_temp_folder=False, strict=True, inject_missing_state=True)
    with contextlib.redirect_stdout(io.StringIO()):  # it prints a line per step
        ds_to_universal.main(args)
    (out / ".complete").touch()


@dataclass
class OptimConfig:
    learning_rate: float = 1e-6
    head_learning_rate: float = 0.0  # a value head's (`score.*`) own step size; 0: learning_rate (optimizer_groups)
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    zero_stage: int = 0
    micro_batch_tokens: int = 4096  # rows × padded length per forward/backward
    gradient_checkpointing: bool = False
    pack_micro_batches: bool = True  # packed rows where the model supports them (models/batching.py), else padded
    offload_optimizer: bool = False  # ZeRO >= 1: optimizer state and master weights in host memory
    offload_params: bool = False  # ZeRO-3: parameter shards in host memory
    expert_parallel: int = 1  # E: each rank holds 1/E of every MoE layer's routed experts (GLM-5.2)
    sequence_parallel: int = 1  # S: groups of S ranks run the same samples, each a chunk of the positions
    # fp32 matmuls on the GPU's TF32 tensor cores (10-bit mantissa, fp32 range and accumulation): several times
    # an fp32 trainer's matmul throughput on Ampere and later; nothing changes on the CPU or for bf16 weights
    tf32: bool = False
    # The forward passes (π_old/π_ref, values, the updates' forwards) under torch.autocast to bf16 while the
    # weights, gradients and Adam stay in `dtype`: attention and matmuls on bf16 tensor cores (fp32 attention over
    # packed rows' masks was 59% of an H100 step, docs/BENCHMARKS.md); the LM head and its log-softmax stay in the
    # weights' precision (models/logprobs.py). Unlike bf16 weights, a checkpoint's HF weights stay exact.
    bf16_autocast: bool = False

    def __post_init__(self):
        if self.expert_parallel > 1 and self.zero_stage not in (1, 2):
            raise ValueError(f"expert_parallel={self.expert_parallel} needs zero_stage 1 or 2 (DeepSpeed reduces "
                             "and partitions expert weights in their own groups under ZeRO-1/2 only; with the "
                             "experts split E ways they are no longer the bulk of a rank's memory)")
        if self.offload_optimizer and self.zero_stage < 1:
            raise ValueError("offload_optimizer needs zero_stage >= 1 (ZeRO partitions the optimizer it offloads)")
        if self.offload_params and self.zero_stage != 3:
            raise ValueError("offload_params needs zero_stage = 3 (only ZeRO-3 partitions the parameters)")


def set_tf32(enabled: bool) -> None:
    """OptimConfig.tf32 for this process (both the matmuls and cuDNN's convolutions)."""
    torch.backends.cuda.matmul.allow_tf32 = enabled
    torch.backends.cudnn.allow_tf32 = enabled


class DeepSpeedWorker:
    """A model wrapped in a DeepSpeed engine, with micro-batching and checkpoint I/O. The actor and the critic
    workers are subclasses; on Ray each is an actor process of its own (its own DeepSpeed world)."""

    def __init__(self, model: nn.Module, optim: OptimConfig, dtype: torch.dtype, seed: int = 0,
                 torch_threads: int = 0, dist: DistEnv | None = None, tokenizer_source: str | None = None):
        # Ray sets OMP_NUM_THREADS=1 in workers without CPUs reserved: choose the thread count ourselves.
        torch.set_num_threads(torch_threads or os.cpu_count() or 1)
        torch.manual_seed(seed)
        set_tf32(optim.tf32)
        self.optim = optim
        self.tokenizer_source = tokenizer_source
        self.rank, self.world_size = (dist.rank, dist.world_size) if dist else (0, 1)
        self.backend = init_distributed(dist)
        self.shard_experts(model)
        self.sequence_group, self.sequence_rank = None, 0
        if optim.sequence_parallel > 1:
            from models.glm5.sequence_parallel import sequence_groups

            if not type(model).__module__.startswith("models.glm5"):
                raise ValueError(f"sequence_parallel={optim.sequence_parallel} needs a GLM-5.2-architecture model "
                                 f"(models/glm5), not {type(model).__name__}")
            self.sequence_group, self.sequence_rank = sequence_groups(optim.sequence_parallel)
        if optim.bf16_autocast and type(model).__module__.startswith("models.glm5"):
            # its sparse attention and indexer mix dtypes their own way (fp32 scores, an fp8 indexer option)
            raise ValueError("trainer.bf16_autocast is for transformers' models; a GLM-5.2-architecture model "
                             "(models/glm5) trains in bf16 with model.dtype=bfloat16")
        if optim.gradient_checkpointing and hasattr(model, "gradient_checkpointing_enable"):
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        self.engine = deepspeed_engine(model, optim.learning_rate, optim.weight_decay, optim.grad_clip,
                                       optim.zero_stage, dtype, optim.offload_optimizer, optim.offload_params,
                                       optim.head_learning_rate)
        self.device = self.engine.device
        self.packed = optim.pack_micro_batches and supports_packed_sequences(model)

    @property
    def module(self) -> nn.Module:
        return self.engine.module

    def forward_precision(self):
        """Where this worker's no-grad passes run (OptimConfig.bf16_autocast); the updates pass the flag to
        `accumulate_and_step`."""
        return forward_precision(self.device, self.optim.bf16_autocast)

    @property
    def head_group(self) -> bool:
        """Whether the value head trains in an optimizer group of its own (a checkpoint resumes only into the
        same grouping)."""
        return any(g.get("name") == "value_head" for g in self.engine.optimizer.param_groups)

    def shard_experts(self, model: nn.Module) -> nn.Module:
        """Keep this rank's share of `model`'s routed experts under `expert_parallel` (the trained model, and any
        frozen copy that runs alongside it, such as the actor's reference); `model` itself otherwise."""
        if self.optim.expert_parallel > 1:
            from models.glm5.expert_parallel import shard_experts

            shard_experts(model, self.optim.expert_parallel)
        return model

    def placement_info(self) -> dict:
        """Where this rank runs: its rank, node address, the GPUs Ray gave it and its torch device."""
        import ray

        gpus = ray.get_gpu_ids() if ray.is_initialized() else []
        node = ray.util.get_node_ip_address() if ray.is_initialized() else socket.gethostname()
        return {"rank": self.rank, "world_size": self.world_size, "node": node, "gpus": [str(g) for g in gpus],
                "device": str(self.device)}

    def micro_batches(self, batch: TokenBatch, fields: tuple[str, ...]) -> list[MicroBatch]:
        """This rank's micro-batches (packed where the model supports it); with several ranks, padded with empty
        ones to the largest count of any rank (`MicroBatch.padding`), so every rank runs the same forwards and
        backwards (ZeRO-3 gathers parameters in each forward, collectively)."""
        batches = make_micro_batches(batch, fields, self.optim.micro_batch_tokens, self.device, self.packed)
        if self.world_size > 1:
            count = int(self.all_reduce([len(batches)], "max")[0])
            batches += [padding_micro_batch(fields, self.device, self.packed) for _ in range(count - len(batches))]
            if self.optim.zero_stage == 3:  # one shape per micro-batch index on every rank (models/glm5/parallel.py)
                widths = self.all_reduce([mb.tensors["input_ids"].shape[1] for mb in batches], "max")
                batches = [mb.widened(int(w)) for mb, w in zip(batches, widths)]
        if self.sequence_group is not None:  # the group's ranks hold the same micro-batches: each takes a chunk
            from models.glm5.sequence_parallel import SequenceShard

            s = self.optim.sequence_parallel
            batches = [mb.widened(-(-mb.tensors["input_ids"].shape[1] // s) * s) for mb in batches]
            for mb in batches:
                width = mb.tensors["input_ids"].shape[1]
                mb.sequence = SequenceShard(self.sequence_group, self.sequence_rank, s, width)
        return batches

    def head_calls(self, mb: MicroBatch, only: torch.Tensor) -> int | None:
        """How many LM-head calls `policy_logprobs` makes on `mb`'s `only` positions: the most any rank needs, the
        same on every rank, where that matters: under ZeRO-3 every call gathers the head's weight (a collective),
        and under sequence parallelism a rank whose chunk predicts nothing must still run its backward through
        the gathers. None (as many as this rank needs) otherwise. Every rank calls it for each micro-batch."""
        if self.world_size == 1 or (self.optim.zero_stage != 3 and mb.sequence is None):
            return None
        from models.logprobs import head_calls_needed

        select = (only[:, 1:] if mb.sequence is None else mb.sequence.next_token(only)) > 0
        return max(1, int(self.all_reduce([head_calls_needed(select, only.shape[0])], "max")[0]))

    @staticmethod
    def owned(mb: MicroBatch, mask: torch.Tensor) -> torch.Tensor:
        """`mask` [b, L] limited to the positions whose predictions this rank computes (all, without sequence
        parallelism): the per-token sums of a group's ranks then add up to the whole."""
        return mask if mb.sequence is None else mask * mb.sequence.owned(mask.shape[1], mask.device)

    @staticmethod
    def whole(mb: MicroBatch, out: torch.Tensor) -> torch.Tensor:
        """A per-position output of `mb` on every position (the ranks' chunks summed under sequence parallelism)."""
        return out if mb.sequence is None else mb.sequence.combine(out)

    def shard_total(self, value: float) -> float:
        """Σ over the ranks of a count of this rank's shard (samples, tokens): a sequence-parallel group's ranks
        hold the same shard, counted once."""
        return self.all_reduce([value])[0] / self.optim.sequence_parallel

    def ppo_steps(self, batch: TokenBatch, mini_batches: int, epochs: int, seed: int):
        """The optimiser steps of an update over this rank's shard: yields (epoch, the step's samples, the step's
        action-token count over all ranks: the token-mean's denominator, docs/ALGORITHMS.md §1.8).

        A mini-batch is every rank's g-th group; the group count is capped by the smallest shard of any rank, so
        that every rank takes the same number of optimiser steps (each a collective)."""
        groups = max(1, min(mini_batches, int(self.all_reduce([len(batch)], "min")[0])))
        for epoch, group in ppo_mini_batches(batch, groups, epochs, seed):
            local = float(group.fields["loss_mask"].sum()) if len(group) else 0.0
            # (a sequence-parallel group's ranks hold the same samples: counted once)
            yield epoch, group, self.shard_total(local) or 1.0

    def all_reduce(self, values: list, op: str = "sum") -> list[float]:
        """Sum (or max, min) of `values` (floats, or 0-d tensors such as statistics summed on the device) over the
        ranks of this model; the values themselves on one rank."""
        values = host_floats(values)
        if self.world_size == 1:
            return values
        ops = {"sum": torch.distributed.ReduceOp.SUM, "max": torch.distributed.ReduceOp.MAX,
               "min": torch.distributed.ReduceOp.MIN}
        t = torch.tensor(values, dtype=torch.float64, device=self.device if self.backend == "nccl" else "cpu")
        torch.distributed.all_reduce(t, op=ops[op])
        return t.cpu().tolist()

    @property
    def loss_scale(self) -> float:
        """DeepSpeed averages gradients over the data-parallel ranks; our losses are already divided by the
        global token count, so each rank's loss is multiplied by the world size to make the average a sum."""
        return float(self.world_size)

    def weight_stream(self, bucket_mb: float, shared: bool = False, on_device: bool = False,
                      names: list[str] | None = None) -> WeightBuckets:
        """The parameters (all, or `names`) as buckets gathered one at a time (models/weight_stream.py); every
        rank must walk it. Rank 0 keeps every bucket, or with `shared` each rank its share (bucket i on rank
        i mod N)."""
        owner = (lambda i: i % self.world_size) if shared else (lambda i: 0)
        return WeightBuckets(self.module, bucket_mb, self.optim.zero_stage == 3, self.rank, owner, on_device, names)

    def gathered_state(self, on_device: bool = False, names: list[str] | None = None) -> dict[str, torch.Tensor]:
        """Full (unpartitioned) parameters (all, or `names`), named as in the HF checkpoint, on rank 0 (empty
        elsewhere; every rank takes part): copies on the CPU, or on the worker's device with `on_device`. For
        checks and tests; syncs and exports walk `weight_stream` instead."""
        stream = self.weight_stream(256, on_device=on_device, names=names)
        return {k: v for bucket in stream for k, v in bucket.items()}

    def parameter_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every parameter's full shape, gathering nothing."""
        return full_shapes(self.module)

    def close(self) -> None:
        """Leave the process group cleanly: every rank waits for the others, then tears its communicators down.
        A rank that simply exits while its peers still talk to it can die of SIGABRT in gloo's or NCCL's
        threads ("terminate called without an active exception"), and NCCL warns of a leaked group.

        A collective barrier alone is not enough: a rank can return from it while a peer still reads the
        barrier's last message, and a socket closed under that read aborts the peer. So the ranks also meet in
        the rendezvous store after the barrier, then all destroy their groups together (NCCL's destroy is itself
        collective within a node: a rank that waited for the others' would hang them), and rank 0, which hosts
        the store, returns (and may exit) only after every other rank has left it."""
        if self.world_size > 1 and torch.distributed.is_initialized():
            from torch.distributed.distributed_c10d import _get_default_store

            torch.distributed.barrier()
            store = _get_default_store()  # held: rank 0's TCPStore server outlives its process group
            wait_for_count(store, "close/passed_barrier", self.world_size)
            torch.distributed.destroy_process_group()
            if self.rank != 0:
                store.add("close/left", 1)
            else:
                wait_for_count(store, "close/left", self.world_size - 1, increment=0)

    def save_hf(self, folder: str, tokenizer_from: str | None = None) -> int:
        """HF-format folder (config.json + safetensors shards) that transformers and our engines load as it is,
        written by rank 0 one gathered shard at a time (never the whole model on one rank). Returns the bytes
        written (0 on the other ranks)."""
        written = write_hf_streamed(self.module, self.weight_stream(HF_SHARD_MB), folder, write=self.rank == 0)
        if self.rank != 0:
            return 0
        if tokenizer_from:
            from models.loading import load_tokenizer

            load_tokenizer(tokenizer_from).save_pretrained(folder)
        Path(folder, ".complete").touch()
        return written

    def save_state(self, folder: str) -> None:
        """Engine state: weights, optimizer moments, step counters (resumable exactly), every rank its own ZeRO
        partition, and `layout.json` (ranks, ZeRO stage) so that a resume on another rank count knows to
        convert it (`load_state`)."""
        import json

        from deepspeed.checkpoint.constants import (UNIVERSAL_CHECKPOINT_INFO, UNIVERSAL_CHECKPOINT_VERSION_KEY,
                                                    UNIVERSAL_CHECKPOINT_VERSION_VALUE)

        info = {UNIVERSAL_CHECKPOINT_INFO: {UNIVERSAL_CHECKPOINT_VERSION_KEY: UNIVERSAL_CHECKPOINT_VERSION_VALUE}}
        if self.optim.expert_parallel > 1:  # DeepSpeed's MoE checkpoints reserve the key (and resume on one layout)
            info = {}
        self.engine.save_checkpoint(folder, tag="state", client_state=info, save_latest=False)
        if self.rank == 0:
            layout = {"world_size": self.world_size, "zero_stage": self.optim.zero_stage,
                      "expert_parallel": self.optim.expert_parallel, "head_group": self.head_group}
            Path(folder, "layout.json").write_text(json.dumps(layout) + "\n")

    def load_state(self, folder: str) -> None:
        """Resume the engine state of `save_state`, on the same rank count or another.

        ZeRO-0 keeps whole states (any rank count loads them); ZeRO-1..3 states are partitioned by rank, so a
        checkpoint from another rank count (or another ZeRO stage >= 1) is first converted by rank 0 into
        DeepSpeed's universal checkpoint (`<folder>/universal`: one fp32 weight, Adam moment and step per
        parameter, kept for later resumes) and every rank loads its new partition from that: weights and Adam
        moments are restored exactly, not reset."""
        import json

        saved = {"world_size": self.world_size, "zero_stage": self.optim.zero_stage}
        if Path(folder, "layout.json").exists():
            saved = json.loads(Path(folder, "layout.json").read_text())
        if saved.get("head_group", False) != self.head_group:  # torch refuses, the universal path would drop state
            raise ValueError(f"{folder}: saved with the value head in {'an' if saved.get('head_group') else 'no'} "
                             f"optimizer group of its own, resuming with{'' if self.head_group else 'out'} one "
                             "(trainer.critic_head_learning_rate): resume with the checkpoint's setting, or start "
                             "from its hf/ export")
        stage = self.optim.zero_stage
        same = saved["world_size"] == self.world_size and saved["zero_stage"] == stage
        ep_saved, ep_now = saved.get("expert_parallel", 1), self.optim.expert_parallel
        if max(ep_saved, ep_now) > 1 and not (same and ep_saved == ep_now):
            raise ValueError(f"{folder}: saved on {saved['world_size']} ranks with expert_parallel="
                             f"{ep_saved}; resuming on {self.world_size} with expert_parallel="
                             f"{self.optim.expert_parallel} is not supported (DeepSpeed keeps each rank's experts and "
                             "their optimizer state in files of their own layout): resume on the same layout, or "
                             "start from its hf/ export")
        if same or (saved["zero_stage"] == 0 and stage == 0):
            path, _ = self.engine.load_checkpoint(folder, tag="state", load_optimizer_states=True,
                                                  load_lr_scheduler_states=True)
        elif saved["zero_stage"] == 0 or stage == 0:
            raise ValueError(f"{folder}: saved with trainer.zero_stage={saved['zero_stage']} on "
                             f"{saved['world_size']} ranks; resuming with zero_stage={stage} on {self.world_size} "
                             "ranks needs the same stage when either is 0 (start from its hf/ export instead)")
        else:
            log.info("%s: saved on %d ranks (ZeRO-%d), resuming on %d (ZeRO-%d) through a universal checkpoint",
                     folder, saved["world_size"], saved["zero_stage"], self.world_size, stage)
            universal = Path(folder, "universal")
            if self.rank == 0 and not (universal / "state" / ".complete").exists():
                to_universal(Path(folder, "state"), universal / "state")
            if self.world_size > 1:
                torch.distributed.barrier()
            self.engine._config.load_universal_checkpoint = True  # read by load_checkpoint and the ZeRO optimizer
            try:
                path, _ = self.engine.load_checkpoint(str(universal), tag="state", load_optimizer_states=True,
                                                      load_lr_scheduler_states=True)
            finally:
                self.engine._config.load_universal_checkpoint = False
        if path is None:
            raise FileNotFoundError(f"no DeepSpeed checkpoint under {folder}")
        # The optimizer's state_dict carries its hyper-parameters; the run's config wins (a resumed run with a
        # new learning rate must train at it, not silently at the checkpoint's). Adam's moments stay restored.
        groups = self.engine.optimizer.param_groups
        if groups and groups[0]["lr"] != self.optim.learning_rate:
            log.warning("resumed with learning_rate %g (the checkpoint's was %g)", self.optim.learning_rate,
                        groups[0]["lr"])
        for group in groups:  # (expert groups split from "dense" carry the body's rate)
            head = group.get("name") == "value_head"
            group["lr"] = self.optim.head_learning_rate if head else self.optim.learning_rate
            group["weight_decay"] = self.optim.weight_decay

    def save(self, folder: str) -> None:
        """A checkpoint: `hf/` for transformers, SGLang and evaluation; `state/` to resume training."""
        self.save_hf(f"{folder}/hf", tokenizer_from=self.tokenizer_source)
        self.save_state(f"{folder}/state")

    def load(self, folder: str) -> None:
        self.load_state(f"{folder}/state")
