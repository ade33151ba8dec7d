"""One model trained by a group of ranks: N Ray actors forming one DeepSpeed world, placed by a placement group.

`TrainerGroup` is what the drivers (rl/train.py, opd/distill.py) hold for the actor and for the critic: every call
goes to all ranks (each a `DeepSpeedWorker` subclass holding its ZeRO shard), with the step's samples split across
them by token count (each shard a `TokenBatch` of flat tensors through Ray's object store), and comes back as one
answer: rank 0's metrics (already reduced over the ranks), per-sample tensors in the caller's order, the weight
buckets every rank put (each its share). Collectives (the gradient all-reduce, ZeRO-3's parameter gathers, a
checkpoint's save) need every rank, so no method talks to one rank alone.

Placement: one bundle per rank ({CPU: a sliver, GPU: trainer.*_gpus}), packed onto as few nodes as fit and spread
over several when one is not enough; the rendezvous address is rank 0's node. On GPUs each rank sees its own
device (Ray sets CUDA_VISIBLE_DEVICES), so its local rank is 0; NCCL refuses two ranks on one GPU, which
`rl.config.validate` checks.
"""

from __future__ import annotations

import logging

import ray
import torch
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from models.batching import as_token_batch, shard_by_tokens
from models.deepspeed_worker import DistEnv

# A rank's CPU reservation: a sliver, so that the ranks do not compete with the rollout workers for Ray's CPU
# count (the processes use the cores they are given by torch_threads, not Ray's accounting).
CPU_PER_RANK = 0.01

log = logging.getLogger(__name__)


class TrainerRankDied(RuntimeError):
    """A rank of a trainer group died: its DeepSpeed world cannot go on (the others would wait in a collective)."""


def gather(refs: list, role: str) -> list:
    """Every rank's answer. A rank that dies ends the wait at once with TrainerRankDied (the other ranks would sit
    in their next collective until its timeout), saying how to continue."""
    pending = list(refs)
    while pending:
        done, pending = ray.wait(pending, num_returns=1)
        try:
            ray.get(done[0])
        except ray.exceptions.RayActorError as exc:
            article = "an" if role[:1] in "aeiou" else "a"
            raise TrainerRankDied(
                f"{article} {role} rank died ({type(exc).__name__}: {str(exc).splitlines()[0][:200]}); the run stops. "
                "resume=true continues from the last checkpoint (trainer.save_every sets how often one is written)"
            ) from exc
    return ray.get(refs)


class Pending:
    """Calls in flight on every rank of a group; `result()` waits for them and shapes their answers."""

    def __init__(self, refs: list, finish, role: str = "trainer"):
        self.refs, self.finish, self.role = refs, finish, role
        self._answer, self._done = None, False

    def wait(self) -> "Pending":
        """Wait now (before starting anything else); `result()` then returns at once."""
        if not self._done:
            self._answer, self._done = self.finish(gather(self.refs, self.role)), True
        return self

    def result(self):
        return self.wait()._answer


@ray.remote(num_cpus=0)
def _rendezvous() -> tuple[str, int]:
    """Rank 0's address and a free port there (run in rank 0's bundle, so on its node)."""
    import socket

    with socket.socket() as s:
        s.bind(("", 0))
        port = s.getsockname()[1]
    return ray.util.get_node_ip_address(), port


class TrainerGroup:
    def __init__(self, worker_cls, ranks: int, gpus_per_rank: float, role: str, *args, sequence_parallel: int = 1,
                 **kwargs):
        if ranks < 1 or ranks % sequence_parallel:
            raise ValueError(f"{role}: a trainer group needs at least one rank, a multiple of sequence_parallel="
                             f"{sequence_parallel}; got {ranks}")
        self.role, self.ranks = role, ranks
        # ranks [g·S, (g+1)·S) hold the same shard, each running its chunk of the positions (models/deepspeed_worker.py)
        self.sequence_parallel = sequence_parallel
        self.train_fields: tuple[str, ...] = worker_cls.TRAIN_FIELDS  # the per-token fields train_step reads
        self.logprob_fields: tuple[str, ...] = getattr(worker_cls, "LOGPROB_FIELDS", ("loss_mask",))
        bundle = {"CPU": CPU_PER_RANK, **({"GPU": gpus_per_rank} if gpus_per_rank else {})}
        self.placement = placement_group([dict(bundle) for _ in range(ranks)], strategy="PACK")
        ray.get(self.placement.ready())

        def at(rank: int):
            return PlacementGroupSchedulingStrategy(self.placement, placement_group_bundle_index=rank)

        address, port = ray.get(_rendezvous.options(scheduling_strategy=at(0)).remote())
        remote = ray.remote(worker_cls)
        self.workers = [
            remote.options(num_cpus=CPU_PER_RANK, num_gpus=gpus_per_rank, scheduling_strategy=at(rank)).remote(
                *args, dist=DistEnv(rank=rank, world_size=ranks, master_addr=address, master_port=port), **kwargs)
            for rank in range(ranks)]

    # ---- every rank, one answer ---------------------------------------------------------------------------------
    def _all(self, method: str, *args, **kwargs) -> list:
        return gather([getattr(w, method).remote(*args, **kwargs) for w in self.workers], self.role)

    def _sharded(self, method: str, samples: list[dict], fields: tuple[str, ...], *args,
                 finish=lambda shards, results: results) -> "Pending":
        """Every rank gets its shard as a TokenBatch (flat tensors of `fields`, those the samples have); the
        answer, `finish((sample indices, TokenBatch) per rank, each rank's answer)`, comes from `.result()`."""
        batch = as_token_batch(samples, fields)
        s = self.sequence_parallel
        shards = [(indices, batch.select(indices)) for indices in shard_by_tokens(batch, self.ranks // s)
                  for _ in range(s)]
        refs = [getattr(w, method).remote(shard, *args) for w, (_, shard) in zip(self.workers, shards)]
        return Pending(refs, lambda results: finish(shards, results), self.role)

    @staticmethod
    def _per_sample(count: int, shards: list, flats: list[torch.Tensor]) -> list[torch.Tensor]:
        """Flat per-rank results → one tensor per sample, in the caller's order."""
        out: list = [None] * count
        for (indices, shard), flat in zip(shards, flats):
            for i, v in zip(indices, shard.split(flat)):
                out[i] = v
        return out

    def ready(self) -> None:
        self._all("__ray_ready__")

    def placement_info(self) -> list[dict]:
        """Per rank: its node's address and the GPUs Ray gave it (for the run log)."""
        return self._all("placement_info")

    # The three calls of a step return `Pending`: the driver starts the actor's and the critic's work together
    # (both groups run at once, on their own ranks) and waits when it needs the answers.
    def train_step(self, samples: list[dict], *args) -> "Pending":
        """The update on `samples`; `.result()`: rank 0's metrics."""
        return self._sharded("train_step", samples, self.train_fields, *args,
                             finish=lambda _, results: {**results[0], f"{self.role}/ranks": self.ranks})

    def sft_step(self, samples: list[dict], *args) -> "Pending":
        """Supervised steps on rendered episodes (ActorWorker.sft_step); `.result()`: rank 0's metrics."""
        return self._sharded("sft_step", samples, ("loss_mask",), *args,
                             finish=lambda _, results: {**results[0], f"{self.role}/ranks": self.ranks})

    def compute_logprobs(self, samples: list[dict], with_old: bool = True, with_ref: bool = True) -> "Pending":
        """π_old (unless not `with_old`) and π_ref (if kept, unless not `with_ref`) per sample; `.result()`:
        {name: one 1-D tensor per sample, in the caller's order}."""
        def finish(shards, results):
            return {key: self._per_sample(len(samples), shards, [r[key] for r in results]) for key in results[0]}
        return self._sharded("compute_logprobs", samples, self.logprob_fields, with_old, with_ref, finish=finish)

    def compute_values(self, samples: list[dict]) -> "Pending":
        """V per sample; `.result()`: one 1-D tensor per sample, in the caller's order."""
        return self._sharded("compute_values", samples, (),
                             finish=lambda shards, results: self._per_sample(len(samples), shards, results))

    def weight_bucket_refs(self, bucket_mb: int) -> list:
        """Every bucket's object-store ref, in bucket order; each rank put its own share."""
        return [ref for _, ref in sorted((pair for share in self._all("weight_bucket_refs", bucket_mb)
                                          for pair in share), key=lambda pair: pair[0])]

    def gathered_state(self, names: list[str] | None = None) -> dict:
        """Rank 0's gathered copy of the parameters (all, or `names`)."""
        return self._all("gathered_state", False, names)[0]

    def parameter_shapes(self) -> dict:
        return self._all("parameter_shapes")[0]

    def on_every_rank(self, method: str, *args) -> dict:
        """`method` on every rank (each takes part, e.g. in gathering the weights); rank 0's answer."""
        return self._all(method, *args)[0]

    def save(self, folder: str) -> None:
        self._all("save", folder)

    def load(self, folder: str) -> None:
        self._all("load", folder)

    def save_hf(self, folder: str, tokenizer_from: str | None = None) -> None:
        self._all("save_hf", folder, tokenizer_from)

    def shutdown(self) -> None:
        """Ranks leave their process group together (bounded: a dead rank must not hang the run's exit), then
        the actors go."""
        if len(self.workers) > 1:
            try:
                ray.get([w.close.remote() for w in self.workers], timeout=30)
            except Exception as e:  # noqa: BLE001 - a rank already gone: the kill below ends the rest
                log.warning("%s ranks did not leave their process group cleanly: %s", self.role, e)
        for w in self.workers:
            ray.kill(w)
        remove_placement_group(self.placement)
