"""DeepSpeed set-up shared by the actor and the critic workers.

Each trainer (actor, critic) is its own DeepSpeed world. On one CPU process it is a world of size 1 on gloo;
the framework sets the rendezvous variables itself so that nobody needs a launcher or mpi4py. On GPU hosts the
Ray placement gives each rank its GPU and the same function is called with the rank's coordinates.
"""

from __future__ import annotations

import logging
import os
import socket
from dataclasses import dataclass

import torch
from torch import nn

log = logging.getLogger(__name__)


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


@dataclass
class DistEnv:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 0


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


def deepspeed_engine(model: nn.Module, learning_rate: float, weight_decay: float, grad_clip: float,
                     zero_stage: int, dtype: torch.dtype):
    """Wrap `model` in a DeepSpeed engine with a torch AdamW client optimizer.

    torch's AdamW needs no JIT build (DeepSpeed's CPU Adam takes 1-2 minutes to compile on first use); ZeRO
    partitions its state all the same. Gradient accumulation is driven by the caller through
    `set_gradient_accumulation_boundary`, because the number of micro-batches per step varies with the
    rollouts (compaction makes the segment count per step unknown in advance).
    """
    import deepspeed

    if zero_stage >= 1 and torch.distributed.is_initialized():
        # ZeRO-1/2 reduce each gradient as backward produces it, ZeRO-3 also gathers each module's weights: the
        # ranks must run the same experts (models/glm5/parallel.py); ZeRO-0 reduces all gradients at the end.
        from models.glm5.parallel import prepare_for_zero3

        prepare_for_zero3(model, torch.distributed.get_world_size())
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=learning_rate, weight_decay=weight_decay, betas=(0.9, 0.999),
                                  eps=1e-8)
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": grad_clip,
        "zero_optimization": {"stage": zero_stage},
        "bf16": {"enabled": dtype == torch.bfloat16},
        "fp16": {"enabled": dtype == torch.float16},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    return engine


def accumulate_and_step(engine, micro_losses) -> float:
    """Backward every micro-batch loss (already scaled by the global denominator), then one optimiser step.

    `micro_losses` is an iterable of zero-argument callables so that each forward runs right before its own
    backward (only one micro-batch's activations alive at a time). Returns the gradient norm.
    """
    losses = list(micro_losses)
    for i, compute in enumerate(losses):
        engine.set_gradient_accumulation_boundary(i == len(losses) - 1)
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


@dataclass
class OptimConfig:
    learning_rate: float = 1e-6
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    zero_stage: int = 0
    micro_batch_tokens: int = 4096  # rows × padded length per forward/backward
    gradient_checkpointing: bool = False


class DeepSpeedWorker:
    """A model wrapped in a DeepSpeed engine, with micro-batching and checkpoint I/O. The actor and the critic
    workers are subclasses; on Ray each is an actor process of its own (its own DeepSpeed world)."""

    def __init__(self, model: nn.Module, optim: OptimConfig, dtype: torch.dtype, seed: int = 0,
                 torch_threads: int = 0, dist: DistEnv | None = None, tokenizer_source: str | None = None):
        # Ray sets OMP_NUM_THREADS=1 in workers without CPUs reserved: choose the thread count ourselves.
        torch.set_num_threads(torch_threads or os.cpu_count() or 1)
        torch.manual_seed(seed)
        self.optim = optim
        self.tokenizer_source = tokenizer_source
        self.rank, self.world_size = (dist.rank, dist.world_size) if dist else (0, 1)
        if optim.zero_stage == 3 and any(getattr(m, "indexer", None) is not None for m in model.modules()):
            raise ValueError("a GLM-5.2 model with DSA indexer layers cannot be trained with trainer.zero_stage=3 "
                             "yet (models/glm5/parallel.py says why); use trainer.zero_stage <= 2")
        self.backend = init_distributed(dist)
        if optim.gradient_checkpointing and hasattr(model, "gradient_checkpointing_enable"):
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        self.engine = deepspeed_engine(model, optim.learning_rate, optim.weight_decay, optim.grad_clip,
                                       optim.zero_stage, dtype)
        self.device = self.engine.device

    @property
    def module(self) -> nn.Module:
        return self.engine.module

    def placement_info(self) -> dict:
        """Where this rank runs: its rank, node address, the GPUs Ray gave it and its torch device."""
        import ray

        gpus = ray.get_gpu_ids() if ray.is_initialized() else []
        node = ray.util.get_node_ip_address() if ray.is_initialized() else socket.gethostname()
        return {"rank": self.rank, "world_size": self.world_size, "node": node, "gpus": [str(g) for g in gpus],
                "device": str(self.device)}

    def micro_batches(self, samples: list[dict], fields: tuple[str, ...]):
        """This rank's micro-batches; with several ranks, padded with empty ones to the largest count of any rank
        (`MicroBatch.padding`), so every rank runs the same forwards and backwards (ZeRO-3 gathers parameters
        in each forward, collectively)."""
        from models.batching import make_micro_batches, padding_micro_batch

        batches = make_micro_batches(samples, fields, self.optim.micro_batch_tokens, self.device)
        if self.world_size > 1:
            count = int(self.all_reduce([len(batches)], "max")[0])
            batches += [padding_micro_batch(fields, self.device) for _ in range(count - len(batches))]
            if self.optim.zero_stage == 3:  # one shape per micro-batch index on every rank (models/glm5/parallel.py)
                widths = self.all_reduce([mb.tensors["input_ids"].shape[1] for mb in batches], "max")
                batches = [mb.widened(int(w)) for mb, w in zip(batches, widths)]
        return batches

    def all_reduce(self, values: list[float], op: str = "sum") -> list[float]:
        """Sum (or max, min) of `values` over the ranks of this model; the values themselves on one rank."""
        if self.world_size == 1:
            return [float(v) for v in values]
        ops = {"sum": torch.distributed.ReduceOp.SUM, "max": torch.distributed.ReduceOp.MAX,
               "min": torch.distributed.ReduceOp.MIN}
        t = torch.tensor([float(v) for v in values], dtype=torch.float64,
                         device=self.device if self.backend == "nccl" else "cpu")
        torch.distributed.all_reduce(t, op=ops[op])
        return t.cpu().tolist()

    @property
    def loss_scale(self) -> float:
        """DeepSpeed averages gradients over the data-parallel ranks; our losses are already divided by the
        global token count, so each rank's loss is multiplied by the world size to make the average a sum."""
        return float(self.world_size)

    def gathered_state(self, on_device: bool = False) -> dict[str, torch.Tensor]:
        """Full (unpartitioned) parameters, named as in the HF checkpoint: copies on the CPU, or on the
        worker's device with `on_device` (an engine sharing the GPU reads them there)."""
        import deepspeed

        params = dict(self.module.named_parameters())

        def copy(v: torch.Tensor) -> torch.Tensor:
            return v.detach().clone() if on_device else v.detach().cpu().clone()

        if self.optim.zero_stage == 3:  # collective: every rank gathers, rank 0 keeps the copy
            with deepspeed.zero.GatheredParameters(list(params.values()), modifier_rank=None):
                return {k: copy(v) for k, v in params.items()} if self.rank == 0 else {}
        return {k: copy(v) for k, v in params.items()} if self.rank == 0 else {}

    def save_hf(self, folder: str, tokenizer_from: str | None = None) -> None:
        """HF-format folder (config.json + safetensors) that transformers and our engines load as it is."""
        from pathlib import Path

        state = self.gathered_state()  # every rank takes part (ZeRO-3); rank 0 writes
        if self.rank != 0:
            return
        self.module.save_pretrained(folder, state_dict=state, safe_serialization=True)
        if tokenizer_from:
            from models.loading import load_tokenizer

            load_tokenizer(tokenizer_from).save_pretrained(folder)
        Path(folder, ".complete").touch()

    def save_state(self, folder: str) -> None:
        """Engine state: weights, optimizer moments, step counters (resumable exactly)."""
        self.engine.save_checkpoint(folder, tag="state", save_latest=False)

    def load_state(self, folder: str) -> None:
        path, _ = self.engine.load_checkpoint(folder, tag="state", load_optimizer_states=True,
                                              load_lr_scheduler_states=True)
        if path is None:
            raise FileNotFoundError(f"no DeepSpeed checkpoint under {folder}")
        # The optimizer's state_dict carries its hyper-parameters; the run's config wins (a resumed run with a
        # new learning rate must train at it, not silently at the checkpoint's). Adam's moments stay restored.
        groups = self.engine.optimizer.param_groups
        if groups and groups[0]["lr"] != self.optim.learning_rate:
            log.warning("resumed with learning_rate %g (the checkpoint's was %g)", self.optim.learning_rate,
                        groups[0]["lr"])
        for group in groups:
            group["lr"], group["weight_decay"] = self.optim.learning_rate, self.optim.weight_decay

    def save(self, folder: str) -> None:
        """A checkpoint: `hf/` for transformers, SGLang and evaluation; `state/` to resume training."""
        self.save_hf(f"{folder}/hf", tokenizer_from=self.tokenizer_source)
        self.save_state(f"{folder}/state")

    def load(self, folder: str) -> None:
        self.load_state(f"{folder}/state")
