"""Loops of the user's own for the tests: ``main`` for ``run.script``, and functions that run
inside the ranks of :func:`tests.ranks.run_ranks`."""

from __future__ import annotations

import os
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from examples.own_loop import main as example_main

import dtrain
from dtrain.errors import UserError
from dtrain.fault.failpoints import set_handler
from dtrain.train.job import build_job_config
from tests.dist_helpers import params_of

# "RANK:STEP": that rank kills itself (kill -9) as it starts that step, in the first attempt
# of the run only (a file in the run folder remembers it); for run.script under `dtrain train`.
KILL_ENV = "DTRAIN_TEST_OWN_LOOP_KILL"


def main(run: dtrain.Run) -> None:
    """The example's loop; killed once where ``KILL_ENV`` says."""
    where = os.environ.get(KILL_ENV)
    if where:
        rank, step = (int(v) for v in where.split(":"))
        stamp = Path(run.config.run.dir) / "killed-once"

        def kill(name: str, **args: Any) -> None:
            at = name == "train.step" and args["step"] == step and run.rank == rank
            if at and not stamp.exists():
                stamp.write_text("")
                os.kill(os.getpid(), signal.SIGKILL)

        set_handler(kill)
    example_main(run)


def train_own_loop(
    raw: dict[str, Any], loop: Callable[[dtrain.Run], object] = example_main
) -> dict[str, Any]:
    """``loop`` trained as this rank of the job (in the rank's process group); what it did."""
    run = dtrain.Run.join(build_job_config(raw))
    summary = run.train(loop)
    params = params_of(run.trainer)
    return {"params": params, "preempted": summary.preempted, "steps": summary.steps}


def own_loop_params(raw: dict[str, Any]) -> dict[str, np.ndarray]:
    params: dict[str, np.ndarray] = train_own_loop(raw)["params"]
    return params


def signal_at_step(raw: dict[str, Any], rank: int, step: int, signame: str) -> dict[str, Any]:
    """The example's loop, ``signame`` sent to this process on ``rank`` as it starts ``step``."""

    def loop(run: dtrain.Run) -> None:
        def send(name: str, **args: Any) -> None:
            if name == "train.step" and args["step"] == step and run.rank == rank:
                os.kill(os.getpid(), getattr(signal, signame))

        set_handler(send)
        try:
            example_main(run)
        finally:
            set_handler(None)

    return train_own_loop(raw, loop)


def save_after_step(raw: dict[str, Any], step: int) -> list[str]:
    """The example's loop, with ``run.save()`` after ``step``; the checkpoints it left."""

    def loop(run: dtrain.Run) -> None:
        from tests.tasks import tiny_gpt

        task = tiny_gpt(run.config)
        model, _ = run.prepare(task.model, task.train_data, collate_fn=task.collate_fn)
        for batch in run.batches():
            for inputs, targets in batch:
                run.backward(task.loss_fn(model(inputs), targets))
            run.step()
            if run.step_count == step:
                run.save()

    train_own_loop(raw, loop)
    return sorted(p.name for p in (Path(raw["run"]["dir"]) / "checkpoints").iterdir())


def mistake(raw: dict[str, Any], kind: str) -> str:
    """The one-line error of a loop that makes mistake ``kind``."""

    def loop(run: dtrain.Run) -> None:
        from tests.tasks import tiny_gpt

        task = tiny_gpt(run.config)
        model, _ = run.prepare(task.model, task.train_data, collate_fn=task.collate_fn)
        if kind == "register after start":
            for _ in run.batches():
                run.register(extra=model)
        for batch in run.batches():
            for inputs, targets in batch:
                losses = task.loss_fn(model(inputs), targets)
                if kind == "mean loss":
                    losses = losses.mean()
                if kind != "step before backward":
                    run.backward(losses)
            run.step()

    try:
        train_own_loop(raw, loop)
    except UserError as exc:
        return str(exc)
    return "no error"
