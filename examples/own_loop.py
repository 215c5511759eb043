"""A training loop of your own with dtrain: the default job (the byte-level GPT of
``dtrain train``), its loop written out, with dtrain's guarantees kept -- the exact global mean,
the exactly-once data stream, checkpoints, resume and preemption (docs/own-loop.md).

Three ways to run it (from the repository root)::

    dtrain train --run.script=examples/own_loop.py --nproc 2   # dtrain's launcher, restarts
    torchrun --nproc-per-node 2 examples/own_loop.py             # plain torchrun
    python examples/own_loop.py --train.steps=50                 # one process

Every ``--section.key=value`` of ``dtrain train`` applies. The model, the data and the loss are
those of the task the config names (``run.task``, the GPT by default), so the same script trains
any task's model in this loop; write your own in their place.
"""

from __future__ import annotations

import dtrain
from dtrain.task import build_task, resolve_task


def main(run: dtrain.Run) -> None:
    cfg = run.config
    task = build_task(resolve_task(cfg.run.task), cfg)  # the model, the data, the loss
    model, _optimizer = run.prepare(  # the optimizer: run.step() steps it
        task.model,
        task.train_data,
        collate_fn=task.collate_fn,
        items_per_sample=task.items_per_sample,
        item_name=task.item_name,
    )
    for batch in run.batches():  # the step's batch of the global stream, resumed
        for inputs, targets in batch:  # its micro-batches, gradients synced on the last
            run.backward(task.loss_fn(model(inputs), targets))  # per-token losses
        if run.step():  # clip, update, schedule, metrics, checkpoints; True: every rank stops
            break


if __name__ == "__main__":
    dtrain.run_main(main)
