"""Rank processes for the tests that train or run one world of N ranks (CPU, gloo).

`spawn` is torch.multiprocessing's spawn through a fork server that imported torch, DeepSpeed, transformers and
our workers once. A spawned rank is a fresh interpreter that imports all of them again (about 7 s of CPU; the
suite starts some 80 ranks, on 2 cores); a rank forked from the server starts in a fraction of a second, in the
state a spawned rank reaches after its imports. The server has run nothing else: no thread, no process group, no
CUDA context, so forking it is safe. It starts at the first call with the environment of that moment (the ranks
set their own rendezvous variables) and lives as long as the test session.
"""

from __future__ import annotations

import multiprocessing

import torch.multiprocessing as mp

PRELOAD = ["torch", "deepspeed", "transformers", "models", "models.deepspeed_worker", "rl.actor", "critic.worker"]


def spawn(fn, args: tuple, nprocs: int) -> None:
    """fn(rank, *args) in `nprocs` processes; returns when all have; a rank's exception is raised here."""
    multiprocessing.set_forkserver_preload(PRELOAD)  # (only the first call's counts: the server starts then)
    mp.start_processes(fn, args=args, nprocs=nprocs, join=True, start_method="forkserver")
