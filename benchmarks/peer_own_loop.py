"""dtrain's own-loop runner of ``benchmarks/peers.py``: the same task as its ``ddp`` row
(``peer_task:build``: model, weights, data, per-item loss), trained in a loop written with
``dtrain.Run`` (docs/own-loop.md) instead of dtrain's loop, launched by ``dtrain train
--run.script=benchmarks/peer_own_loop.py`` with the ddp row's flags.

After the loop it evaluates the whole validation set with ``run.evaluate`` (an own loop runs no
evaluation of dtrain's): its ``val_loss`` is the one peers.py compares with the raw loop's.
"""

from __future__ import annotations

import dtrain
import peer_task as common


def main(run: dtrain.Run) -> None:
    task = common.build(run.config)  # the ddp row's model, data and report
    model, _optimizer = run.prepare(task.model, task.train_data)
    for batch in run.batches():
        for inputs, targets in batch:
            run.backward(common.item_losses(model(inputs), targets))
        if run.step():
            break
    run.evaluate(task.val_data, lambda x, y: common.item_losses(model(x), y), batch_size=64)


if __name__ == "__main__":
    dtrain.run_main(main)
