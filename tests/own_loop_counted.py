"""``run.script`` for tests/test_own_loop_inplace.py: the example's loop (examples/own_loop.py)
with state of the loop's own given to ``run.register``: a count of the steps it began, raised
before each step's first collective, so that a step dropped in flight must take it back."""

from __future__ import annotations

from typing import Any

import dtrain
from dtrain.task import build_task, resolve_task


class Begun:
    """The steps the loop began (each counted before its forward)."""

    def __init__(self) -> None:
        self.steps = 0

    def state_dict(self) -> dict[str, Any]:
        return {"steps": self.steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.steps = int(state["steps"])


def main(run: dtrain.Run) -> None:
    cfg = run.config
    task = build_task(resolve_task(cfg.run.task), cfg)
    model, _ = run.prepare(
        task.model,
        task.train_data,
        collate_fn=task.collate_fn,
        items_per_sample=task.items_per_sample,
        item_name=task.item_name,
    )
    begun = Begun()
    run.register(begun=begun)
    for batch in run.batches():
        begun.steps += 1
        for inputs, targets in batch:
            run.backward(task.loss_fn(model(inputs), targets))
        if run.step():
            break
