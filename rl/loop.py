"""What the driver loops share (rl.train, opd.distill): the run folder, the sandbox check, the guard audit, timers,
the time limit and the evaluation that runs beside training."""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import torch
from omegaconf import OmegaConf

from environments import make_sandbox
from rl.run_log import MetricsLogger

log = logging.getLogger("rl.loop")


def runs_out(limit: float, elapsed: float, step_s: float, eval_s: float, steps_ahead: int = 1) -> bool:
    """Whether `steps_ahead` more steps of `step_s` and then an evaluation of `eval_s` would end past `limit`
    seconds (0: no limit)."""
    return bool(limit) and elapsed + steps_ahead * step_s + eval_s > limit


class TimeLimit:
    """`trainer.time_limit_s` in a driver loop (rl.train, opd.distill), measured from `started`.

    time_limit_action=stop: after a step, checkpoint and stop when one more step like it (plus the final
    evaluation, if the next step is the last) would end past the limit: a job slot, a preemptible node;
    `resume=true` goes on. time_limit_action=finish: before a step, make it the last one (final evaluation
    included) when it and one more would not leave room for the final evaluation: the run ends complete.
    """

    def __init__(self, trainer, started: float):
        self.limit, self.steps, self.started = trainer.time_limit_s, trainer.steps, started
        self.finish = trainer.time_limit_action == "finish"
        self.step_s = 0.0  # the last step's duration: the estimate of the next one's
        self.eval_s = 0.0  # the longest evaluation so far (the first includes the extra set, as the final does)

    def elapsed(self) -> float:
        return time.perf_counter() - self.started

    def saw_evaluation(self, seconds: float) -> None:
        self.eval_s = max(self.eval_s, seconds)

    def is_last(self, step: int) -> bool:
        return step + 1 == self.steps or (
            self.finish and runs_out(self.limit, self.elapsed(), self.step_s, self.eval_s, steps_ahead=2))

    def stops_after(self, step: int, step_s: float, last: bool) -> bool:
        self.step_s = step_s
        return not last and not self.finish and runs_out(
            self.limit, self.elapsed(), step_s, self.eval_s if step + 2 == self.steps else 0.0)

    def ended_early(self, step: int, last: bool, out_of_time: bool, final: dict) -> bool:
        """Logs and records (in `final`) a run that ends before trainer.steps; whether the loop should end."""
        if last and step + 1 < self.steps:
            final["finished_early_at_step"] = step + 1
            log.warning("trainer.time_limit_s=%.0f: finished at step %d of %d (final evaluation done)",
                        self.limit, step + 1, self.steps)
        elif out_of_time:
            final["stopped_early_at_step"] = step + 1
            log.warning("trainer.time_limit_s=%.0f: stopped after step %d (checkpoint saved); continue with "
                        "resume=true", self.limit, step + 1)
        return last or out_of_time


class BackgroundEval:
    """An evaluation running beside training (trainer.max_staleness > 0): one at a time; a request while one
    runs is skipped (and said so). Its metrics join the record of the step in which it is collected, with the
    weight version it started on (`eval/weight_version`): its episodes may continue on newer weights."""

    def __init__(self):
        self._thread: threading.Thread | None = None
        self._out: dict = {}

    def start(self, evaluate, version: int) -> None:
        if self._thread is not None and self._thread.is_alive():
            log.warning("an evaluation is still running; this one is skipped")
            return

        def run():
            try:
                self._out = {**evaluate(), "eval/weight_version": version}
            except Exception:
                log.exception("the background evaluation failed")

        self._thread = threading.Thread(target=run, name="evaluation", daemon=True)
        self._thread.start()

    def results(self, wait: bool = False) -> dict:
        if self._thread is not None and (wait or not self._thread.is_alive()):
            self._thread.join()
            self._thread = None
        out, self._out = (self._out, {}) if self._thread is None else ({}, self._out)
        return out


class Timer:
    def __init__(self):
        self.start = self.mark = time.perf_counter()

    def lap(self) -> float:
        now = time.perf_counter()
        lap, self.mark = now - self.mark, now
        return lap

    def total(self) -> float:
        return time.perf_counter() - self.start


def write_audit(audit, step: int, trajs) -> None:
    for t in trajs:
        for event in t.guard_events:
            audit.write(json.dumps({"step": step, "task": t.task_id, "rollout_id": t.rollout_id, **event}) + "\n")
    audit.flush()


@contextmanager
def driver_threads(threads: int):
    """The driver's torch threads for the run (trainer.driver_torch_threads; 0: every core), the caller's again
    after it: a test or a notebook that runs a loop in its own process keeps its thread count."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads or os.cpu_count() or 1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def check_sandbox(backend: str) -> None:
    """A missing sandbox, or a sandbox Python without pytest, fails the run now, not every episode."""
    with make_sandbox(backend) as box:
        result = box.exec(["python", "-m", "pytest", "--version"], timeout=60)
    if result.exit_code != 0:
        raise RuntimeError(f"the {backend} sandbox cannot run the graders' pytest: {(result.stdout + result.stderr)[-500:]}")


def prepare_run_dir(cfg) -> Path:
    run_dir = Path(cfg.output_dir) / cfg.run_name
    if run_dir.exists() and not cfg.resume:  # a fresh run never overwrites an old one: move it aside
        run_dir.rename(run_dir.with_name(f"{run_dir.name}-{time.strftime('%Y%m%d-%H%M%S')}"))
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(OmegaConf.to_yaml(OmegaConf.structured(cfg)))
    return run_dir


def checkpoint_state(step: int, cfg, workers, rollouts, metrics: dict) -> dict:
    """What a checkpoint holds beside the weights: the step, the weight version, the seed, the rollout manager's
    state, and the step's metrics line so far (a run killed before that line reaches metrics.jsonl gets it back
    on resume: `MetricsLogger(resume_record=...)`)."""
    return {"step": step, "weight_version": workers.weight_version, "seed": cfg.seed,
            "rollout": rollouts.state_dict(), "metrics": MetricsLogger.record(step, metrics)}
