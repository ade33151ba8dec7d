"""The rollout manager against rollout workers whose episodes take skewed, controllable times (real Ray actors;
the episodes are fakes that stamp every token with the weight version the worker serves at that moment)."""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections import Counter

import pytest
import ray

from rl.data import TaskSampler
from rl.rollout_manager import STALE_ATTEMPTS, RolloutManager, episode_seed
from rollout.types import Segment, Trajectory

TOKENS = 6  # tokens per fake episode, one per tick


@ray.remote(num_cpus=0, max_concurrency=64)
class SkewedWorker:
    """Episode i takes `ticks[i % len(ticks)]` ticks of `tick_s`; an index in `gated` (first attempt only)
    waits, after its first token, until `release()` or an abort. Tokens carry the version at their tick."""

    def __init__(self, ticks: list[int], gated: list[int], tick_s: float = 0.01, gate_retries: bool = False,
                 die_at: int = -1, die_flag: str = "", die_alone: bool = False):
        self.ticks, self.gated, self.tick_s, self.gate_retries = ticks, set(gated), tick_s, gate_retries
        # the process exits at episode `die_at`: once (a flag file marks it), or every time ("always"); with
        # `die_alone` only once no other episode runs on it (so that only that one is lost, however slow they are)
        self.die_at, self.die_flag, self.die_alone = die_at, die_flag, die_alone
        self.running = 0
        self.version = 0
        self.log: list[dict] = []
        self.aborts: dict[str, str] = {}
        self.released = False

    async def run_episode(self, task, mode, seed, rollout_id):
        index = int(rollout_id.split("-")[1].split("r")[0])
        retry = "r" in rollout_id.split("-")[1]
        self.log.append({"event": "start", "id": rollout_id, "index": index, "seed": seed, "task": task.id,
                         "version": self.version})
        if index == self.die_at and (self.die_flag == "always" or not os.path.exists(self.die_flag)):
            if self.die_flag != "always":
                open(self.die_flag, "w").close()
            while self.die_alone and self.running:
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.05)
            os._exit(1)  # the whole process, with every episode in flight on it
        self.running += 1
        try:
            return await self._episode(task, rollout_id, index, retry)
        finally:
            self.running -= 1

    async def _episode(self, task, rollout_id, index, retry):
        versions = []
        for tick in range(TOKENS):
            if rollout_id in self.aborts:
                break
            versions.append(self.version)
            if tick == 0 and index in self.gated and (self.gate_retries or not retry):
                while not self.released and rollout_id not in self.aborts:
                    await asyncio.sleep(0.01)
            await asyncio.sleep(self.tick_s * self.ticks[index % len(self.ticks)] / TOKENS)
        self.log.append({"event": "end", "id": rollout_id, "index": index})
        n = len(versions)
        segment = Segment(rollout_id, 0, [1] * (n + 1), [0] + [1] * n, [0.0] + [-0.5] * n, "final", [-1] + versions)
        traj = Trajectory(rollout_id, task.id, [segment], reward=1.0, finish_reason="submitted")
        if rollout_id in self.aborts:
            traj.finish_reason, traj.grade_details = "aborted", {"aborted": self.aborts[rollout_id]}
        return traj

    async def abort_episodes(self, ids, reason):
        for i in ids:
            self.aborts[i] = reason
        return len(ids)

    def set_version(self, version):
        self.version = version

    def health(self):
        return {"version": self.version}

    def release(self):
        self.released = True

    def events(self):
        return self.log

    def aborted(self):
        return dict(self.aborts)


@pytest.fixture(scope="module")
def ray_session():
    ray.init(num_cpus=2, include_dashboard=False, configure_logging=False, log_to_driver=False)
    yield
    ray.shutdown()


def train_steps(manager, workers, steps, on_batch=None, sync=None):
    """The driver's loop without a model: take a batch, 'train' (a weight version more everywhere), release."""
    batches = []
    for step in range(steps):
        trajs, metrics = manager.next_batch()
        batches.append((trajs, metrics, manager.version))
        if on_batch:
            on_batch(step)
        if sync:
            sync(step + 1)
        else:
            ray.get([w.set_version.remote(step + 1) for w in workers])
        manager.step_done(step + 1)
    return batches


def _within(seconds, fn, *args, **kwargs):
    """fn(*args, **kwargs), failing the test if it has not returned within `seconds` (a hang fails fast)."""
    out = []
    thread = threading.Thread(target=lambda: out.append(fn(*args, **kwargs)), daemon=True)
    thread.start()
    thread.join(seconds)
    assert out, f"{fn.__name__} did not return within {seconds} s"
    return out[0]


def train_steps_from(manager, workers, step, sync):
    """One more step of `train_steps`, the step-th."""
    trajs, metrics = manager.next_batch()
    batch = (trajs, metrics, manager.version)
    sync(step + 1)
    manager.step_done(step + 1)
    return [batch]


def test_k0_is_the_synchronous_loop(ray_session, shipped_tasks):
    tasks = shipped_tasks.split("train")
    workers = [SkewedWorker.remote([1, 9, 3], []) for _ in range(2)]
    marks = []
    manager = RolloutManager(workers, TaskSampler(tasks, 7), 3, 0, 8, seed=5).start()
    batches = train_steps(manager, workers, 3, on_batch=lambda s: marks.append(
        sum(len(ray.get(w.events.remote())) for w in workers)))
    manager.stop()
    reference = TaskSampler(tasks, 7)  # what the synchronous loop drew: sampler.next(B) each step, seed + step
    for step, (trajs, metrics, version) in enumerate(batches):
        assert [t.task_id for t in trajs] == [t.id for t in reference.next(3)]
        assert metrics["async/staleness_max"] == 0 and metrics["async/dropped_stale"] == 0
    events = [e for w in workers for e in ray.get(w.events.remote())]
    starts = sorted((e for e in events if e["event"] == "start"), key=lambda e: e["index"])
    assert [e["seed"] for e in starts] == [(5 + i // 3) * 1_000_003 + i % 3 for i in range(9)]
    assert [e["seed"] for e in starts] == [episode_seed(5, i, 3) for i in range(9)]
    for i, w in enumerate(workers):  # round-robin within each batch, as run_episodes placed them
        assert {e["index"] % 3 % 2 for e in ray.get(w.events.remote()) if e["event"] == "start"} == {i}
    # nothing ran while the trainer trained: every batch's episodes had all ended (and no other had started)
    assert marks == [6, 12, 18]
    assert all(e["version"] == e["index"] // 3 for e in starts)  # each batch started on the previous update


def test_the_trainer_never_waits_for_the_slowest_episode(ray_session, shipped_tasks):
    """Episode 1 never ends unless aborted: two steps train without it (K = 1); once it can no longer meet the
    bound it is aborted and its task runs again, so nothing is lost. (Whether the re-run finishes among the next
    eight or is still pending after step 4 depends on timing, as does whether a slow ordinary episode on a busy
    machine is aborted too: every outcome that keeps the bound and loses nothing is right, and all are checked.)"""
    tasks = shipped_tasks.split("train")
    workers = [SkewedWorker.remote([2, 3, 1, 5], [1]) for _ in range(2)]
    manager = RolloutManager(workers, TaskSampler(tasks, 0), 4, 1, 8, seed=0).start()
    batches = train_steps(manager, workers, 4)
    trained = [t.rollout_id for trajs, _, _ in batches for t in trajs]
    assert "ep-1" not in trained  # the straggler itself never reaches a batch
    # the straggler is aborted for staleness; on a loaded machine a slow ordinary episode may be too (as it should)
    aborted = {i: r for w in workers for i, r in ray.get(w.aborted.remote()).items()}
    assert aborted.get("ep-1") == "stale"
    # (its abort is counted in the batch its result comes back with: on a loaded machine that may be after step 4)
    assert sum(m["async/aborted_stale"] for _, m, _ in batches) <= sum(r == "stale" for r in aborted.values())
    for trajs, metrics, version in batches:
        assert metrics["async/staleness_max"] <= 1
        assert all(version - t.oldest_version() <= 1 for t in trajs)
    state = manager.state_dict()
    manager.stop()
    ray.get([w.release.remote() for w in workers])
    # every index drawn is trained once or pending for a resumed run; none twice
    indices = Counter(int(r.split("-")[1].split("r")[0]) for r in trained)
    assert max(indices.values()) == 1
    assert not set(indices) & {p["index"] for p in state["pending"]}
    assert set(indices) | {p["index"] for p in state["pending"]} == set(range(state["next_index"]))
    # the straggler's task: re-run and trained, or re-run (or about to be) and pending for a resumed run
    assert any(r.startswith("ep-1r") for r in trained) or 1 in {p["index"] for p in state["pending"]}


def test_staleness_bound_holds_with_partial_rollouts(ray_session, shipped_tasks):
    """Skewed lengths, K = 1: episodes span weight updates (tokens of two versions) and the batches still never
    hold a token more than one version behind; some are dropped or aborted to keep it so."""
    tasks = shipped_tasks.split("train")
    workers = [SkewedWorker.remote([1, 40, 2, 25, 1, 3], []) for _ in range(2)]
    manager = RolloutManager(workers, TaskSampler(tasks, 1), 4, 1, 4, seed=0).start()
    batches = train_steps(manager, workers, 6)
    manager.stop()
    mixed = 0
    for trajs, metrics, version in batches:
        assert len(trajs) == 4 and metrics["async/staleness_max"] <= 1
        for t in trajs:
            versions = set(t.segments[0].sampled_versions())
            assert min(versions) >= version - 1 and len(t.segments[0].sampled_versions()) == TOKENS
            mixed += len(versions) > 1
    assert mixed > 0, "no episode continued across a weight update"


def test_on_ready_runs_as_each_episode_finishes_and_follows_it_to_its_batch(ray_session, shipped_tasks):
    """opd.distill's hook: `on_ready` sees every trajectory when it finishes (before the batch is taken, while
    slower episodes still run), and `take_attached` hands each batch member what was made of it; a trajectory
    dropped for staleness leaves nothing behind."""
    tasks = shipped_tasks.split("train")
    workers = [SkewedWorker.remote([1, 40, 2, 25, 1, 3], []) for _ in range(2)]
    seen: list[tuple[str, float]] = []

    def on_ready(traj):
        seen.append((traj.rollout_id, time.perf_counter()))
        return f"for {traj.rollout_id}"

    manager = RolloutManager(workers, TaskSampler(tasks, 1), 4, 1, 4, seed=0, on_ready=on_ready).start()
    taken, batches, dropped = [], [], 0
    for step in range(6):
        trajs, metrics = manager.next_batch()
        taken.append(time.perf_counter())
        dropped += metrics["async/dropped_stale"]
        assert manager.take_attached(trajs) == [f"for {t.rollout_id}" for t in trajs]
        assert manager.take_attached(trajs) == [None] * len(trajs)  # handed over once
        batches.append(trajs)
        ray.get([w.set_version.remote(step + 1) for w in workers])
        manager.step_done(step + 1)
    manager.stop()
    when = dict(seen)
    for trajs, end in zip(batches, taken):
        assert all(when[t.rollout_id] <= end for t in trajs)
    assert len(seen) >= 24 + dropped  # every trained one, and those dropped (then forgotten), were seen
    with manager._cond:
        assert set(manager._attached) <= {t.rollout_id for _, t in manager._ready}


def test_resume_reruns_the_pending_episodes_once(ray_session, shipped_tasks):
    tasks = shipped_tasks.split("train")
    workers = [SkewedWorker.remote([1, 6, 2], []) for _ in range(2)]
    first = RolloutManager(workers, TaskSampler(tasks, 3), 3, 2, 8, seed=0).start()
    before = train_steps(first, workers, 2)
    state = first.state_dict()
    first.stop()
    assert state["pending"], "K = 2 should have had episodes in flight or buffered"
    resumed = RolloutManager(workers, TaskSampler(tasks, 3), 3, 2, 8, seed=0, start_step=2, version=2)
    resumed.load_state_dict(state, tasks)
    resumed.start()
    after = train_steps(resumed, workers, 3)
    still_pending = {p["index"] for p in resumed.state_dict()["pending"]}
    resumed.stop()
    index = lambda r: int(r.split("-")[1].split("r")[0])  # noqa: E731
    trained = [index(t.rollout_id) for batches in (before, after) for trajs, _, _ in batches for t in trajs]
    assert len(trained) == len(set(trained)) == 15  # none twice
    pending = {p["index"]: (p["task"], p["seed"]) for p in state["pending"]}
    assert set(pending) <= set(trained[6:]) | still_pending  # the unfinished ones ran again (or still run)
    assert not set(trained) & still_pending
    for trajs, _, _ in after:
        for t in trajs:
            if index(t.rollout_id) in pending:
                assert t.task_id == pending[index(t.rollout_id)][0]


def test_a_task_that_always_outlasts_the_bound_is_given_up_and_counted(ray_session, shipped_tasks):
    tasks = shipped_tasks.split("train")
    workers = [SkewedWorker.remote([1], [2], gate_retries=True)]
    manager = RolloutManager(workers, TaskSampler(tasks, 0), 2, 1, 8, seed=0).start()
    # each attempt is aborted two versions after it started; a re-run submitted a step late (a loaded machine)
    # pushes the last abort later, so step until it is given up (2 · STALE_ATTEMPTS + 2 steps when nothing lags)
    def sync(version):
        ray.get([w.set_version.remote(version) for w in workers])

    batches = []
    while len(batches) < 6 * STALE_ATTEMPTS and not sum(m["async/gave_up"] for _, m, _ in batches):
        batches += train_steps_from(manager, workers, len(batches), sync)
    for _ in range(2):  # and two steps more: it is not given up twice
        batches += train_steps_from(manager, workers, len(batches), sync)
    manager.stop()
    ray.get([w.release.remote() for w in workers])
    # its STALE_ATTEMPTS aborts (and, on a loaded machine, perhaps a slow ordinary episode's)
    assert sum(m["async/aborted_stale"] for _, m, _ in batches) >= STALE_ATTEMPTS
    assert sum(m["async/gave_up"] for _, m, _ in batches) == 1
    # none of its attempts was trained on: its place in the batch holds an aborted placeholder with nothing in it
    held = [t for trajs, _, _ in batches for t in trajs if t.rollout_id.startswith("ep-2")]
    assert [(t.finish_reason, t.segments) for t in held] == [("aborted", [])]
    assert "given up" in held[0].grade_details["aborted"]


def test_with_k0_a_task_given_up_for_staleness_still_lets_its_batch_complete(ray_session, shipped_tasks):
    """K = 0 admits only the step's tickets: a task given up must still fill its place, or the step waits forever.
    Here the weights never reach the engine (a broken sync), so every episode after the first step is stale."""
    tasks = shipped_tasks.split("train")
    workers = [SkewedWorker.remote([1], [])]
    manager = RolloutManager(workers, TaskSampler(tasks, 0), 2, 0, 8, seed=0).start()
    batches = _within(120, train_steps, manager, workers, 2, sync=lambda v: None)
    state = manager.state_dict()
    manager.stop()
    assert [t.finish_reason for t in batches[0][0]] == ["submitted", "submitted"]
    assert [t.finish_reason for t in batches[1][0]] == ["aborted", "aborted"]
    assert batches[1][1]["async/gave_up"] == 2 and batches[1][1]["async/dropped_stale"] == 2 * STALE_ATTEMPTS
    assert {p["index"] for p in state["pending"]} <= {4, 5}  # the given-up tasks are not run again after a resume


def test_a_worker_that_dies_is_restarted_with_the_weights_and_no_episode_is_lost_or_repeated(
        ray_session, shipped_tasks, tmp_path):
    """A rollout worker's process exits mid-episode with others in flight: Ray restarts it, the manager has it
    brought to the current version before it gets work again, the episodes that died with it run once more, and
    every task drawn is trained on exactly once."""
    tasks = shipped_tasks.split("train")
    flag = str(tmp_path / "died")
    workers = [SkewedWorker.options(max_restarts=1, max_task_retries=0).remote([4, 6], [], die_at=5, die_flag=flag)
               for _ in range(2)]
    restored, lock, served = [], threading.Lock(), [0]

    def sync(version):  # ObjectStoreSync.push: every worker that is up gets the version; one restarting does not
        with lock:
            for w in workers:
                try:
                    ray.get(w.set_version.remote(version))
                except ray.exceptions.RayActorError:
                    pass
            served[0] = version

    def on_restart(w):  # ObjectStoreSync.refresh: the restarted worker gets the version the others serve
        with lock:
            ray.get(workers[w].set_version.remote(served[0]))
            restored.append((w, served[0]))

    manager = RolloutManager(workers, TaskSampler(tasks, 2), 4, 1, 8, seed=0, on_restart=on_restart).start()
    batches, back_at, deadline = [], None, time.monotonic() + 120
    while time.monotonic() < deadline:  # steps until the restarted worker has been back in for 3 of them
        batches += train_steps_from(manager, workers, len(batches), sync)
        if back_at is None and sum(m["rollout/workers_restarted"] for _, m, _ in batches):
            back_at = len(batches)
        if back_at is not None and len(batches) >= max(back_at + 3, 4):
            break
        time.sleep(0.2)
    state = manager.state_dict()
    manager.stop()
    assert os.path.exists(flag)
    trained = Counter(int(t.rollout_id.split("-")[1].split("r")[0]) for trajs, _, _ in batches for t in trajs)
    pending = {p["index"] for p in state["pending"]}
    # every ticket drawn trained once or pending for a resumed run: none lost, none twice
    assert max(trained.values()) == 1 and not set(trained) & pending
    assert set(trained) | pending == set(range(state["next_index"]))
    lost = sum(m["rollout/episodes_lost"] for _, m, _ in batches)
    assert lost >= 1 and sum(m["rollout/workers_restarted"] for _, m, _ in batches) == 1
    assert len(restored) == 1
    died, version = restored[0]
    starts = [e for e in ray.get(workers[died].events.remote()) if e["event"] == "start"]
    assert starts and all(e["version"] >= version for e in starts)  # the new process ran nothing on old weights


def test_a_task_lost_twice_stands_as_an_error_so_the_synchronous_batch_completes(ray_session, shipped_tasks):
    """K = 0 admits only the step's batch: a task whose episode kills its worker every time is given up after its
    second loss and stands in the batch as an error trajectory (never trained on), so the step does not wait."""
    tasks = shipped_tasks.split("train")
    workers = [SkewedWorker.options(max_restarts=3, max_task_retries=0).remote([2], [], die_at=1, die_flag="always",
                                                                               die_alone=True)
               for _ in range(2)]
    served = [0]

    def sync(version):  # as ObjectStoreSync.push: a worker that is restarting misses it
        served[0] = version
        for w in workers:
            _try(w.set_version.remote(version))

    def on_restart(w):  # as ObjectStoreSync.refresh: a restarted worker gets the version the others serve
        ray.get(workers[w].set_version.remote(served[0]))

    manager = RolloutManager(workers, TaskSampler(tasks, 4), 4, 0, 8, seed=0, on_restart=on_restart).start()
    batches = _within(600, train_steps, manager, workers, 2, sync=sync)
    manager.stop()
    first = batches[0][0]
    assert len(first) == 4 and [t.finish_reason for t in first].count("error") == 1
    assert "lost with its worker twice" in next(t for t in first if t.finish_reason == "error").grade_details["error"]
    assert sum(m["async/gave_up"] for _, m, _ in batches) == 1 and len(batches[1][0]) == 4


def _try(ref):
    try:
        return ray.get(ref)
    except ray.exceptions.RayActorError:
        return None
