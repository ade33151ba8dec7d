"""The rollout manager: episodes in flight on every engine at all times, a buffer of finished trajectories, and a
bound on how stale the tokens of a trained batch may be.

    tasks ─► tickets ─► admitted? ─► rollout workers (≤ engine.max_concurrent_episodes each) ─► buffer ─► batch
                ▲                                                                                 │
                └──────────────── a trajectory too stale to train on: its task runs again ◄────────┘

A background thread keeps the workers busy while the driver trains; `next_batch` hands the driver the first
`trainer.episodes_per_step` trajectories to finish. `trainer.max_staleness = K` bounds, in weight versions, how
far any trained token may lag the policy being trained:

* **Admission** (as in AReaL): the episodes are numbered in submission order and grouped in batches of B; batch g
  may start only once step g − K − 1 has ended (its weights are out). K = 0 is the synchronous loop exactly:
  step s's episodes start after step s − 1's update, with the same tasks, seeds and workers as ever, and nothing
  runs while the trainer trains.
* **At the batch**: a trajectory whose oldest action token is more than K versions behind the trained policy is
  dropped and its task runs again on the current weights (`async/dropped_stale`); an episode in flight that has
  become too stale is aborted and re-run the same way (`async/aborted_stale`; judged by the version served when
  it was submitted, a lower bound of its oldest token's). Every task drawn is trained on once, from one complete
  attempt, except a task whose episodes outlast the bound STALE_ATTEMPTS times: it is given up and counted
  (`async/gave_up`), the bias toward shorter episodes that any staleness bound has, made visible. It stands in
  its batch as an aborted trajectory (never trained on): admission counts tickets, so with K = 0 its batch would
  otherwise never fill.

Partial rollouts: weight updates reach the engines while episodes run; their generations pause and continue on
the new weights, each token keeping the version that sampled it (rollout/local_engine.py, rollout/sglang/).

Faults: a rollout worker whose process dies is restarted by Ray (`engine.max_worker_restarts`). A thread of its
own waits for it to come back; the driver's thread then brings it to the current weights (`on_restart(worker)`,
called from `next_batch`, so that it never talks to the trainer group beside the driver's own calls), and only
then does it get episodes again (`rollout/workers_restarted`). A death with no episode in flight is noticed when
the restarted worker refuses its first episode (rollout.worker.WorkerNeedsWeights). The episodes that died with
it are re-run once elsewhere (`rollout/episodes_lost`); one lost a second time is given up, counted
(`async/gave_up`) and stands in its batch as an error trajectory (never trained on), so that no batch waits for
it. A worker out of restarts is left out; the run stops only when none is left.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections import Counter, deque

import ray

from environments import Task
from rl.data import TaskSampler
from rollout.types import Trajectory
from rollout.worker import WorkerNeedsWeights

log = logging.getLogger(__name__)
STALE_ATTEMPTS = 3  # a task whose episodes outlast the bound this many times is given up (async/gave_up)


@dataclasses.dataclass
class Ticket:
    """One episode to run: its place in the submission order decides its batch (admission) and its seed."""

    index: int
    task: Task
    seed: int
    attempt: int = 0
    stale_attempts: int = 0  # attempts dropped or aborted for the staleness bound
    worker: int = -1
    version: int = 0  # the weight version served when it was submitted
    submitted_at: float = 0.0
    incarnation: int = 0  # the worker's restart count when it was submitted
    lost: int = 0  # attempts that died with their worker
    given_up: bool = False  # its place in the buffer holds a placeholder: nothing to run again after a resume

    def rollout_id(self, tag: str) -> str:
        return f"{tag}-{self.index}" + (f"r{self.attempt}" if self.attempt else "")


def episode_seed(base: int, index: int, batch_size: int) -> int:
    """The seed of episode `index`: batch g = index // B gets the synchronous loop's seed for step g."""
    return (base + index // batch_size) * 1_000_003 + index % batch_size


class RolloutManager:
    def __init__(self, workers: list, sampler: TaskSampler, batch_size: int, max_staleness: int,
                 max_concurrent: int, seed: int, tag: str = "ep", start_step: int = 0, version: int = 0,
                 on_restart=None, restart_timeout_s: float = 600.0, on_ready=None):
        self.workers, self.sampler = list(workers), sampler
        self.batch_size, self.max_staleness, self.max_concurrent = batch_size, max_staleness, max_concurrent
        self.seed, self.tag = seed, tag
        self.version = version  # the policy's weight version: what the engines serve
        self._released = start_step  # steps ended: batch g is admitted once g <= released + K
        self._next_index = start_step * batch_size
        self._requeued: deque[Ticket] = deque()  # run before new tasks: re-runs and a checkpoint's unfinished ones
        self._inflight: dict[ray.ObjectRef, Ticket] = {}
        self._ready: list[tuple[Ticket, Trajectory]] = []  # finished, in completion order
        self._load = [0] * len(self.workers)
        self._dead: set[int] = set()
        self._restarting: set[int] = set()  # died; a watcher waits for Ray to restart them
        self._restarted: set[int] = set()  # back, waiting for `on_restart` (the driver's thread) before any episode
        self._incarnation = [0] * len(self.workers)
        self.on_restart, self.restart_timeout_s = on_restart, restart_timeout_s
        # on_ready(trajectory) → anything: called on the manager's thread as each trajectory finishes, before the
        # batch is taken (opd.distill sends it to its teacher there); `take_attached` hands the results over.
        self.on_ready, self._attached = on_ready, {}
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._failure: BaseException | None = None
        self.counts: Counter = Counter()  # dropped_stale, aborted_stale, gave_up, lost, restarts (reset per batch)

    # ---- the driver's side ----------------------------------------------------------------------------
    def start(self) -> "RolloutManager":
        self._thread = threading.Thread(target=self._run, name="rollout-manager", daemon=True)
        self._thread.start()
        return self

    def next_batch(self) -> tuple[list[Trajectory], dict]:
        """The first `batch_size` trajectories to finish that the staleness bound admits (in submission order),
        and the manager's metrics since the last batch. Blocks until they are there."""
        started = time.perf_counter()
        self.refresh_restarted()
        with self._cond:
            while True:
                self._drop_stale()
                if len(self._ready) >= self.batch_size:
                    break
                if self._failure is not None:
                    raise RuntimeError("the rollout manager stopped") from self._failure
                if self._restarted:
                    self._cond.release()
                    try:
                        self.refresh_restarted()
                    finally:
                        self._cond.acquire()
                    continue
                self._cond.wait(0.5)
            taken, self._ready = self._ready[:self.batch_size], self._ready[self.batch_size:]
            counts, self.counts = self.counts, Counter()
            metrics = {"async/trainer_idle_s": time.perf_counter() - started, "async/buffer_size": len(self._ready),
                       "async/inflight": len(self._inflight), "async/dropped_stale": counts["dropped_stale"],
                       "async/aborted_stale": counts["aborted_stale"], "async/gave_up": counts["gave_up"],
                       "rollout/episodes_lost": counts["episodes_lost"],
                       "rollout/workers_restarted": counts["workers_restarted"]}
        taken.sort(key=lambda pair: pair[0].index)
        trajs = [t for _, t in taken]
        metrics.update(staleness_metrics(trajs, self.version))
        return trajs, metrics

    def take_attached(self, trajs: list[Trajectory]) -> list:
        """What `on_ready` returned for each of these trajectories (None where it was not called), forgotten here."""
        with self._cond:
            return [self._attached.pop(t.rollout_id, None) for t in trajs]

    def refresh_restarted(self) -> None:
        """On the driver's thread: bring every worker that Ray restarted to the current weights (`on_restart`),
        then give it episodes again; one that fails it is taken for dead again (and restarted, while it may)."""
        with self._cond:
            workers = sorted(self._restarted)  # they stay out of the placement until their weights are in
        for w in workers:
            try:
                if self.on_restart is not None:
                    self.on_restart(w)
            except Exception as exc:
                with self._cond:
                    self._restarted.discard(w)
                    self._down(w, exc)
                continue
            with self._cond:
                self._restarted.discard(w)
                self.counts["workers_restarted"] += 1
                log.warning("rollout worker %d restarted with weight version %d", w, self.version)
                self._cond.notify_all()

    def set_version(self, version: int) -> None:
        """The engines serve `version` now (right after a sync: episodes submitted from here are on it)."""
        with self._cond:
            self.version = version

    def step_done(self, version: int) -> None:
        """A step ended and the engines serve `version`: admit the next batch; abort what became too stale."""
        with self._cond:
            self._released += 1
            self.version = version
            doomed = [(ref, t) for ref, t in self._inflight.items() if version - t.version > self.max_staleness]
            self._cond.notify_all()
        by_worker: dict[int, list[str]] = {}
        for _, t in doomed:
            by_worker.setdefault(t.worker, []).append(t.rollout_id(self.tag))
        for w, ids in by_worker.items():  # their results come back as "aborted" and their tasks run again
            self.workers[w].abort_episodes.remote(ids, "stale")
        self.refresh_restarted()  # a worker back from a restart gets the weights just pushed

    def stop(self) -> None:
        """Abort what is in flight and end the thread (the unfinished tickets stay in `state_dict`)."""
        with self._cond:
            self._stopping = True
            inflight = list(self._inflight.values())
            self._cond.notify_all()
        for w in {t.worker for t in inflight}:
            self.workers[w].abort_episodes.remote([t.rollout_id(self.tag) for t in inflight if t.worker == w],
                                                  "stopped")
        if self._thread is not None:
            self._thread.join(timeout=60)

    def state_dict(self) -> dict:
        """What a checkpoint needs to go on without losing or repeating a task: the sampler's position and the
        tickets drawn but not yet trained on (in flight or in the buffer), which a resumed run runs again first."""
        with self._cond:
            buffered = [t for t, _ in self._ready if not t.given_up]
            pending = sorted(list(self._inflight.values()) + buffered + list(self._requeued), key=lambda t: t.index)
            return {"sampler": self.sampler.state_dict(), "next_index": self._next_index,
                    "pending": [{"index": t.index, "task": t.task.id, "seed": t.seed} for t in pending]}

    def load_state_dict(self, state: dict, tasks: list[Task]) -> None:
        self.sampler.load_state_dict(state["sampler"])
        if "next_index" not in state:  # a checkpoint of the synchronous loop before the manager: nothing pending
            return
        by_id = {t.id: t for t in tasks}
        self._next_index = state["next_index"]
        self._requeued = deque(Ticket(p["index"], by_id[p["task"]], p["seed"], attempt=1) for p in state["pending"])

    # ---- the thread -----------------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while True:
                with self._cond:
                    if self._stopping:
                        return
                    self._submit_admitted()
                    refs = list(self._inflight)
                    if not refs:
                        self._cond.wait(0.2)
                        continue
                done, _ = ray.wait(refs, num_returns=1, timeout=0.2)
                for ref in done:
                    self._collect(ref)
        except BaseException as exc:  # the driver sees it at its next next_batch
            log.exception("rollout manager failed")
            with self._cond:
                self._failure = exc
                self._cond.notify_all()

    def _collect(self, ref) -> None:
        try:
            traj = ray.get(ref)
        except (ray.exceptions.RayActorError, WorkerNeedsWeights) as exc:
            traj = None
            error = exc
        except Exception as exc:  # the worker survived; the episode did not: an error trajectory, counted
            traj, error = None, exc
        attached = None
        if traj is not None and self.on_ready is not None and traj.grade_details.get("aborted") != "stale":
            attached = self.on_ready(traj)  # outside the lock: the driver may take a batch meanwhile
        with self._cond:
            ticket = self._inflight.pop(ref)
            self._load[ticket.worker] -= 1
            if traj is None:
                if isinstance(error, WorkerNeedsWeights):  # restarted while idle: it ran nothing
                    if ticket.incarnation == self._incarnation[ticket.worker]:
                        self._down(ticket.worker, error)
                    self._requeued.appendleft(ticket)
                    return
                if isinstance(error, ray.exceptions.RayActorError):
                    self._lost(ticket, error)
                    return
                traj = Trajectory(ticket.rollout_id(self.tag), ticket.task.id, [], finish_reason="error",
                                  domain=ticket.task.domain, grade_details={"error": repr(error)})
            if traj.grade_details.get("aborted") == "stale":
                self.counts["aborted_stale"] += 1
                self._rerun_stale(ticket)
            else:
                if attached is not None:
                    self._attached[traj.rollout_id] = attached
                self._ready.append((ticket, traj))
            self._cond.notify_all()

    def _lost(self, ticket: Ticket, error: BaseException) -> None:
        """An episode that died with its worker (the caller holds the lock): re-run once, the worker restarted.
        Lost twice: given up, standing in its batch as an error trajectory (no batch waits for it)."""
        if ticket.incarnation == self._incarnation[ticket.worker]:  # the first news of this death
            self._down(ticket.worker, error)
        self.counts["episodes_lost"] += 1
        if ticket.lost >= 1:
            log.warning("task %s: lost with its worker twice; given up", ticket.task.id)
            self._give_up(ticket, "error", f"lost with its worker twice: {error}")
            return
        self._requeued.appendleft(dataclasses.replace(ticket, attempt=ticket.attempt + 1, lost=ticket.lost + 1))

    def _down(self, w: int, error: BaseException) -> None:
        """Worker w is down (the caller holds the lock): no episodes for it; a watcher waits for Ray's restart."""
        if w in self._dead or w in self._restarting:
            return
        self._incarnation[w] += 1
        self._restarting.add(w)
        self._restarted.discard(w)
        log.error("rollout worker %d is down (%s); waiting for its restart, its episodes run again", w, error)
        threading.Thread(target=self._await_restart, args=(w,), name=f"restart-{w}", daemon=True).start()

    def _await_restart(self, w: int) -> None:
        """Wait for Ray to restart worker w, then hand it to the driver for its weights (`refresh_restarted`); a
        worker out of restarts (or that does not come back) is left out for the rest of the run."""
        deadline = time.monotonic() + self.restart_timeout_s
        try:
            while True:  # "unavailable" while Ray restarts it; "died" when it is out of restarts
                if self._stopping or not ray.is_initialized():  # the run is over: asking would start a new Ray
                    return
                try:
                    ray.get(self.workers[w].health.remote(), timeout=min(max(deadline - time.monotonic(), 0.1), 5))
                    break
                except (ray.exceptions.ActorUnavailableError, ray.exceptions.GetTimeoutError):
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.5)
        except SystemExit:  # Ray shut down under the wait (the run, or the test, is over): nothing to report
            return
        except Exception as exc:  # ActorDiedError: out of restarts; GetTimeoutError: it did not come back
            with self._cond:
                self._restarting.discard(w)
                self._dead.add(w)
                log.error("rollout worker %d is gone for good (%s); %d left", w, exc,
                          len(self.workers) - len(self._dead))
                if len(self._dead) == len(self.workers) and self._failure is None:
                    self._failure = RuntimeError("every rollout worker died")
                self._cond.notify_all()
            return
        with self._cond:
            self._restarting.discard(w)
            self._restarted.add(w)
            self._cond.notify_all()

    def _drop_stale(self) -> None:
        """Buffer entries with a token more than K versions behind the policy: dropped, their tasks re-run."""
        ready, self._ready = self._ready, []
        for ticket, traj in ready:
            oldest = traj.oldest_version()
            if oldest is not None and self.version - oldest > self.max_staleness:
                self.counts["dropped_stale"] += 1
                self._attached.pop(traj.rollout_id, None)
                self._rerun_stale(ticket)  # (a task given up enters the buffer again, as its placeholder)
            else:
                self._ready.append((ticket, traj))

    def _rerun_stale(self, ticket: Ticket) -> None:
        if ticket.stale_attempts + 1 >= STALE_ATTEMPTS:
            log.warning("task %s: %d attempts outlasted trainer.max_staleness=%d; given up", ticket.task.id,
                        STALE_ATTEMPTS, self.max_staleness)
            self._give_up(ticket, "aborted", f"given up: {STALE_ATTEMPTS} attempts outlasted the staleness bound")
            return
        self._requeued.append(dataclasses.replace(ticket, attempt=ticket.attempt + 1,
                                                  stale_attempts=ticket.stale_attempts + 1))

    def _give_up(self, ticket: Ticket, finish_reason: str, why: str) -> None:
        """A task given up (the caller holds the lock): counted, and in the buffer as a trajectory with nothing to
        train on (rl.batch.trainable drops it), which takes its ticket's place so that no batch waits for it."""
        self.counts["gave_up"] += 1
        placeholder = Trajectory(ticket.rollout_id(self.tag), ticket.task.id, [], domain=ticket.task.domain,
                                 finish_reason=finish_reason, grade_details={finish_reason: why})
        self._ready.append((dataclasses.replace(ticket, given_up=True), placeholder))

    def _admitted(self, index: int) -> bool:
        return index // self.batch_size <= self._released + self.max_staleness

    def _submit_admitted(self) -> None:
        """Start every admitted episode that a worker has room for (the caller holds the lock)."""
        live = [w for w in range(len(self.workers))
                if w not in self._dead and w not in self._restarting and w not in self._restarted]
        if not live:
            return
        while True:
            if self._requeued:
                ticket = self._requeued[0]
            elif self._admitted(self._next_index):
                index = self._next_index
                ticket = Ticket(index, self.sampler.next(1)[0], episode_seed(self.seed, index, self.batch_size))
                self._requeued.appendleft(ticket)
                self._next_index += 1
            else:
                return
            if self.max_staleness == 0:  # the synchronous loop's placement: round-robin within the batch
                worker = live[(ticket.index % self.batch_size) % len(live)]
                if self._load[worker] >= self.max_concurrent and any(self._load[w] < self.max_concurrent for w in live):
                    worker = min(live, key=lambda w: self._load[w])
            else:
                worker = min(live, key=lambda w: self._load[w])
            if self._load[worker] >= self.max_concurrent:
                return
            self._requeued.popleft()
            ticket.worker, ticket.version, ticket.submitted_at = worker, self.version, time.perf_counter()
            ticket.incarnation = self._incarnation[worker]
            ref = self.workers[worker].run_episode.remote(ticket.task, "train", ticket.seed, ticket.rollout_id(self.tag))
            self._inflight[ref] = ticket
            self._load[worker] += 1


def staleness_metrics(trajs: list[Trajectory], version: int) -> dict:
    """How far the batch's action tokens lag the policy at `version`: mean, max, and tokens per lag."""
    lags = Counter()
    for t in trajs:
        for s in t.segments:
            for v in s.sampled_versions():
                lags[version - v] += 1
    tokens = sum(lags.values())
    out = {"async/staleness_mean": sum(k * n for k, n in lags.items()) / tokens if tokens else 0.0,
           "async/staleness_max": max(lags) if lags else 0}
    out.update({f"async/tokens_staleness_{k}": n for k, n in sorted(lags.items())})
    return out
