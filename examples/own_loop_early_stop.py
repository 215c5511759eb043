"""A training loop of your own with its own evaluation and early stopping: the default job
(``dtrain train``'s GPT) evaluated every ``eval.every`` steps by ``run.evaluate`` -- the mean
loss and the share of next tokens predicted right, each over every token of the validation set
once, whatever the world size -- and stopped by ``run.stop`` once the loss has not improved for
``PATIENCE`` evaluations (docs/own-loop.md).

Run it as examples/own_loop.py runs (from the repository root)::

    dtrain train --run.script=examples/own_loop_early_stop.py --nproc 2 --eval.every=20
    torchrun --nproc-per-node 2 examples/own_loop_early_stop.py --eval.every=20
    python examples/own_loop_early_stop.py --train.steps=100 --eval.every=20

The evaluation's values are reduced over the ranks, so every rank decides alike and asks to
stop at the same step; the wish rides in the next step's agreement, and every rank stops after
that step: the run ends completed, its final checkpoint saved, the reason in its summary.
"""

from __future__ import annotations

import math
from typing import Any

import torch

import dtrain
from dtrain.task import build_task, resolve_task

PATIENCE = 3  # evaluations without a better loss before the loop stops
MIN_IMPROVEMENT = 0.0  # what counts as better: a loss below the best minus this


def main(run: dtrain.Run) -> None:
    train(run)


def train(
    run: dtrain.Run, patience: int = PATIENCE, min_improvement: float = MIN_IMPROVEMENT
) -> list[dict[str, float]]:
    """The loop; returns its evaluations (the same on every rank)."""
    cfg = run.config
    task = build_task(resolve_task(cfg.run.task), cfg)  # the model, the data, the loss
    model, _optimizer = run.prepare(
        task.model,
        task.train_data,
        collate_fn=task.collate_fn,
        items_per_sample=task.items_per_sample,
        item_name=task.item_name,
    )

    def per_token(inputs: Any, targets: Any) -> dict[str, torch.Tensor]:
        logits = model(inputs)  # no gradients, eval mode, the strategy's precision
        right = logits.argmax(dim=-1) == targets
        return {"loss": task.loss_fn(logits, targets), "accuracy": right.flatten().float()}

    evaluations: list[dict[str, float]] = []
    best, waited, samples = math.inf, 0, 0
    for batch in run.batches():
        samples += len(batch.sample_ids)
        for inputs, targets in batch:
            run.backward(task.loss_fn(model(inputs), targets))
        if run.step():  # True once every rank stops: a preemption, or the stop asked below
            break
        if cfg.eval.every and run.step_count % cfg.eval.every == 0:
            # Logged as dtrain's evaluations are (val_loss, val_accuracy in metrics.jsonl).
            values = run.evaluate(task.val_data, per_token, max_samples=cfg.eval.max_samples)
            evaluations.append(values)
            if values["loss"] < best - min_improvement:
                best, waited = values["loss"], 0
            else:
                waited += 1
                if waited >= patience:
                    run.stop(f"val loss {best:.4f} not bettered in the last {waited} evaluation(s)")
    trained = run.reduce(samples, "sum")  # over the ranks: each sample of the stream once
    if run.is_main:
        print(f"{int(trained)} samples trained in this run", flush=True)
    return evaluations


if __name__ == "__main__":
    dtrain.run_main(main)
