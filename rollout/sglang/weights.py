"""Trainer → SGLang weight sync, the sending side (the servers receive through their HTTP endpoints).

Three ways, chosen by `engine.sglang.weight_sync`:
- `tensor` (trainer and server on the same GPU, colocated): each bucket is packed into one flat uint8 tensor
  with per-tensor metadata (SGLang's `flattened_bucket` format) and sent as a CUDA IPC handle:
  no bytes cross HTTP, the server copies from our memory. We keep the bucket alive until the server answers.
- `distributed` (trainer and servers on different GPUs or hosts): the trainer is rank 0 of a process group
  with every server rank (`init_weights_update_group`) and broadcasts each bucket over NCCL (gloo on CPU)
  while the servers' `update_weights_from_distributed` calls receive it.
- `disk`: the trainer writes an HF-format folder that every server reloads (`update_weights_from_disk`);
  slowest, but needs nothing shared except a file system.

Each sync is pause → update (every bucket) → flush the prefix cache → resume, and stamps `version` on the
servers, so every later sample carries it.
"""

from __future__ import annotations

import asyncio
import base64
import io
import itertools
import os
import types
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager, contextmanager
from datetime import timedelta
from typing import Iterable, Mapping

import torch

from rollout.sglang.client import SGLangClient

GROUP_NAME = "weight_update_group"
_generations = itertools.count()


# ---- the process group shared with the servers ----------------------------------------------------------
class UpdateGroup:
    """A process group outside the default world (the trainer's own DeepSpeed world is untouched).

    Built the way SGLang 0.5.17 builds its side (`init_custom_process_group`): a TCP rendezvous at
    `tcp://master:port`, the store prefixed with the group name, and a group made by `_new_process_group_helper`,
    so the keys both sides write in the store agree. The trainer is rank 0 and hosts the store.
    """

    def __init__(self, master_address: str, master_port: int, rank: int, world_size: int,
                 group_name: str = GROUP_NAME, backend: str = "nccl", timeout_s: float = 600.0):
        from torch.distributed.distributed_c10d import (Backend, PrefixStore, _new_process_group_helper, _world,
                                                        rendezvous)

        if backend == "nccl":
            # cuMem-backed NCCL buffers cannot be imported by a peer that sees a different set of GPUs (each
            # Ray worker has its own CUDA_VISIBLE_DEVICES): "Cuda failure 'invalid argument'" on the server.
            os.environ.setdefault("NCCL_CUMEM_ENABLE", "0")
        timeout = timedelta(seconds=timeout_s)
        store, rank, world_size = next(rendezvous(f"tcp://{master_address}:{master_port}", rank, world_size,
                                                  timeout=timeout))
        store.set_timeout(timeout)
        store = PrefixStore(group_name, store)
        self.pg, _ = _new_process_group_helper(world_size, rank, [], Backend(backend), store, group_name=group_name,
                                               timeout=timeout)
        _world.pg_group_ranks[self.pg] = {i: i for i in range(world_size)}
        self.rank, self.world_size, self.name = rank, world_size, group_name
        self.broken = False  # a member failed mid-broadcast: the communicator cannot be trusted again

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> None:
        torch.distributed.broadcast(tensor, src=src, group=self.pg)

    def close(self) -> None:
        if self.pg is not None:
            if self.broken and hasattr(self.pg, "abort"):
                self.pg.abort()  # unblocks a broadcast still waiting for a dead peer
            else:
                torch.distributed.destroy_process_group(self.pg)
            self.pg = None


def join_update_group(master_address: str, master_port: int, rank: int, world_size: int,
                      group_name: str = GROUP_NAME, backend: str = "nccl") -> UpdateGroup:
    return UpdateGroup(master_address, master_port, rank, world_size, group_name, backend)


# ---- the flattened bucket of `update_weights_from_tensor` ---------------------------------------------
def flatten_bucket(named: Mapping[str, torch.Tensor]) -> dict:
    """SGLang's `FlattenedTensorBucket`: one uint8 tensor and, per tensor, name/shape/dtype/byte range.

    The metadata are `types.SimpleNamespace` objects: SGLang unpickles with an allow-list that admits builtin
    and torch types only, so a class of ours would be refused.
    """
    flats, metadata, offset = [], [], 0
    for name, tensor in named.items():
        flat = tensor.detach().contiguous().flatten().view(torch.uint8)
        metadata.append(types.SimpleNamespace(name=name, shape=tensor.shape, dtype=tensor.dtype, start_idx=offset,
                                              end_idx=offset + flat.numel(), numel=flat.numel()))
        flats.append(flat)
        offset += flat.numel()
    return {"flattened_tensor": torch.cat(flats) if flats else torch.empty(0, dtype=torch.uint8),
            "metadata": metadata}


def unflatten_bucket(bucket: dict) -> dict[str, torch.Tensor]:
    flat = bucket["flattened_tensor"]
    return {m.name: flat[m.start_idx:m.end_idx].view(m.dtype).reshape(m.shape) for m in bucket["metadata"]}


@contextmanager
def _shareable_cpu_tensors():
    """CPU tensors pickle as file descriptors passed over a socket that only our own children may open; the
    file-system strategy names shared-memory files instead, which an unrelated local server can open."""
    import torch.multiprocessing as mp

    before = mp.get_sharing_strategy()
    mp.set_sharing_strategy("file_system")
    try:
        yield
    finally:
        mp.set_sharing_strategy(before)


def _cuda_ipc_by_uuid() -> None:
    """Name the GPU of a CUDA IPC handle by UUID, not by index: the server may number its GPUs differently
    (its own CUDA_VISIBLE_DEVICES). SGLang patches `rebuild_cuda_tensor` on its side to accept a UUID string
    (sglang/srt/utils/patch_torch.py); the rebuild function itself must stay torch's, since SGLang unpickles
    with an allow-list that refuses any function of ours."""
    from multiprocessing.reduction import ForkingPickler

    from torch.multiprocessing import reductions

    if getattr(reductions, "_agentic_rl_uuid_patch", False):
        return
    original = reductions.reduce_tensor

    def reduce_tensor(tensor):
        rebuild, args = original(tensor)
        if rebuild is reductions.rebuild_cuda_tensor and isinstance(args[6], int):
            args = (*args[:6], str(torch.cuda.get_device_properties(args[6]).uuid), *args[7:])
        return rebuild, args

    for cls in (*torch._tensor_classes, torch.Tensor, torch.nn.parameter.Parameter):
        ForkingPickler.register(cls, reduce_tensor)
    reductions._agentic_rl_uuid_patch = True


def serialize_bucket(named: Mapping[str, torch.Tensor]) -> tuple[str, dict]:
    """(base64 ForkingPickler dump of the flattened bucket, the bucket to keep alive until the server answers)."""
    from multiprocessing.reduction import ForkingPickler

    import torch.multiprocessing  # noqa: F401  (registers the tensor reductions)

    bucket = flatten_bucket(named)
    buf = io.BytesIO()
    if bucket["flattened_tensor"].is_cuda:
        _cuda_ipc_by_uuid()
        ForkingPickler(buf).dump(bucket)
    else:
        with _shareable_cpu_tensors():
            ForkingPickler(buf).dump(bucket)
    return base64.b64encode(buf.getvalue()).decode(), bucket


# ---- one sync ---------------------------------------------------------------------------------------
@asynccontextmanager
async def _clients(urls: list[str]) -> AsyncIterator[list[SGLangClient]]:
    """One SGLang client per url, all closed when the block ends (however it ends)."""
    clients = [SGLangClient(u) for u in urls]
    try:
        yield clients
    finally:
        await asyncio.gather(*(c.close() for c in clients))


async def _paused(clients: list[SGLangClient], mode: str, update) -> None:
    await asyncio.gather(*(c.pause(mode) for c in clients))
    try:
        await update()
    finally:
        await asyncio.gather(*(c.resume() for c in clients))


async def sync_from_tensors(urls: list[str], buckets: Iterable[Mapping[str, torch.Tensor]], version: int,
                            tp_sizes: list[int] | None = None, pause_mode: str = "abort") -> dict:
    """Colocated servers copy each bucket from our GPU memory (CUDA IPC). Every TP rank of a server gets the
    same handle; each loads its own shard of the full tensors. `buckets` has a length and is walked once, one
    bucket alive at a time (a trainer's stream gathers each bucket as it is reached)."""
    stats = {"buckets": 0, "bytes": 0}
    async with _clients(urls) as clients:

        async def update():
            for i, named in enumerate(buckets):
                payload, keep_alive = serialize_bucket(named)
                last = i == len(buckets) - 1
                await asyncio.gather(*(
                    c.update_weights_from_tensor([payload] * (tp_sizes[k] if tp_sizes else 1),
                                                 version if last else None, "flattened_bucket", flush_cache=last)
                    for k, c in enumerate(clients)))
                stats["buckets"] += 1
                stats["bytes"] += int(keep_alive["flattened_tensor"].numel())
                del keep_alive

        await _paused(clients, pause_mode, update)
    return stats


async def sync_over_group(urls: list[str], buckets: Iterable[Mapping[str, torch.Tensor]], version: int,
                          master_address: str, master_port: int, tp_sizes: list[int] | None = None,
                          backend: str = "nccl", pause_mode: str = "abort", group: UpdateGroup | None = None,
                          device: str | torch.device = "cpu") -> tuple[dict, UpdateGroup]:
    """Broadcast every bucket from rank 0 (us) to every server rank. The group is made on the first call and
    returned for reuse; a server restart needs a fresh group (pass None)."""
    tp_sizes = tp_sizes or [1] * len(urls)
    stats = {"buckets": 0, "bytes": 0}
    async with _clients(urls) as clients:
        if group is None:
            # A fresh name each time: a server that survived a restart of another still holds the old group.
            name = f"{GROUP_NAME}_{next(_generations)}"
            world = 1 + sum(tp_sizes)
            offsets = [1 + sum(tp_sizes[:k]) for k in range(len(urls))]
            joins = [asyncio.create_task(c.init_weights_update_group(master_address, master_port, offsets[k], world,
                                                                     name, backend))
                     for k, c in enumerate(clients)]
            group = await asyncio.to_thread(UpdateGroup, master_address, master_port, 0, world, name, backend)
            await asyncio.gather(*joins)

        async def update():
            for i, named in enumerate(buckets):
                last = i == len(buckets) - 1
                names = list(named)
                tensors = [named[n].detach().to(device).contiguous() for n in names]
                receives = [asyncio.create_task(c.update_weights_from_distributed(
                    names, [str(t.dtype).replace("torch.", "") for t in tensors], [list(t.shape) for t in tensors],
                    group.name, version if last else None, flush_cache=last)) for c in clients]

                def send():
                    for t in tensors:
                        group.broadcast(t, src=0)

                # A server that fails to receive answers 400 while our broadcast would wait for it forever:
                # whichever ends first with an error ends the sync (the group is then unusable: make a new one).
                sender = asyncio.ensure_future(asyncio.to_thread(send))
                done, _ = await asyncio.wait([sender, *receives], return_when=asyncio.FIRST_EXCEPTION)
                failed = [t for t in done if t.exception() is not None]
                if failed:
                    group.broken = True
                    raise failed[0].exception()
                await asyncio.gather(sender, *receives)
                stats["buckets"] += 1
                stats["bytes"] += sum(t.numel() * t.element_size() for t in tensors)

        await _paused(clients, pause_mode, update)
    return stats, group


async def sync_from_disk(urls: list[str], folder: str, version: int, pause_mode: str = "abort") -> dict:
    async with _clients(urls) as clients:

        async def update():
            await asyncio.gather(*(c.update_weights_from_disk(folder, version) for c in clients))

        await _paused(clients, pause_mode, update)
    return {"buckets": 1}
