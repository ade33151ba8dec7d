"""Which tasks each step trains on: epochs of seeded shuffles, with a position that checkpoints can restore."""

from __future__ import annotations

import random

from environments import Task


class TaskSampler:
    def __init__(self, tasks: list[Task], seed: int = 0):
        if not tasks:
            raise ValueError("no training tasks: check env.tasks and env.train_split")
        self.tasks, self.seed = tasks, seed
        self.epoch, self.position = 0, 0
        self._order = self._shuffle()

    def _shuffle(self) -> list[int]:
        order = list(range(len(self.tasks)))
        random.Random(self.seed * 100_003 + self.epoch).shuffle(order)
        return order

    def next(self, n: int) -> list[Task]:
        out = []
        while len(out) < n:
            if self.position >= len(self._order):
                self.epoch, self.position = self.epoch + 1, 0
                self._order = self._shuffle()
            out.append(self.tasks[self._order[self.position]])
            self.position += 1
        return out

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position, "num_tasks": len(self.tasks)}

    def load_state_dict(self, state: dict) -> None:
        if state.get("num_tasks") != len(self.tasks):
            raise ValueError(f"the task set changed since the checkpoint ({state.get('num_tasks')} tasks then, "
                             f"{len(self.tasks)} now): resuming would not continue the same data order")
        self.epoch, self.position = state["epoch"], state["position"]
        self._order = self._shuffle()
