"""Loops of the user's own for the tests: ``main`` for ``run.script``, and functions that run
inside the ranks of :func:`tests.ranks.run_ranks`."""

from __future__ import annotations

import os
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from examples.own_loop import main as example_main

import dtrain
from dtrain.errors import UserError
from dtrain.fault.failpoints import set_handler
from dtrain.train.job import build_job_config
from tests.dist_helpers import params_of

# "RANK:STEP[:SIGNAL]": that rank sends itself SIGNAL (SIGKILL: kill -9) as it starts that
# step, in the first attempt of the run only (a file in the run folder remembers it); for
# run.script under `dtrain train`.
KILL_ENV = "DTRAIN_TEST_OWN_LOOP_KILL"


def main(run: dtrain.Run) -> None:
    """The example's loop; killed once where ``KILL_ENV`` says."""
    where = os.environ.get(KILL_ENV)
    if where:
        rank, step, *sent = where.split(":")
        stamp = Path(run.config.run.dir) / "killed-once"

        def kill(name: str, **args: Any) -> None:
            at = name == "train.step" and args["step"] == int(step) and run.rank == int(rank)
            if at and not stamp.exists():
                stamp.write_text("")
                os.kill(os.getpid(), getattr(signal, sent[0] if sent else "SIGKILL"))

        set_handler(kill)
    example_main(run)


def train_own_loop(
    raw: dict[str, Any], loop: Callable[[dtrain.Run], object] = example_main
) -> dict[str, Any]:
    """``loop`` trained as this rank of the job (in the rank's process group); what it did."""
    run = dtrain.Run.join(build_job_config(raw))
    summary = run.train(loop)
    params = params_of(run.trainer)
    return {
        "params": params,
        "preempted": summary.preempted,
        "stopped": summary.stopped,
        "steps": summary.steps,
    }


def error_of(raw: dict[str, Any], loop: Callable[[dtrain.Run], None]) -> str:
    """The one-line UserError the loop's run raised, or "no error"."""
    try:
        train_own_loop(raw, loop)
    except UserError as exc:
        return str(exc)
    return "no error"


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


def tiny_loop(run: dtrain.Run, after_step: Callable[[dtrain.Run], bool] | None = None) -> None:
    """The tiny GPT's loop; ``after_step(run)`` after each step, True to leave the loop."""
    from tests.tasks import tiny_gpt

    task = tiny_gpt(run.config)
    model, _ = run.prepare(task.model, task.train_data, collate_fn=task.collate_fn)
    for batch in run.batches():
        for inputs, targets in batch:
            run.backward(task.loss_fn(model(inputs), targets))
        run.step()
        if after_step is not None and after_step(run):
            break


def save_after_step(raw: dict[str, Any], step: int) -> list[str]:
    """The tiny loop, with ``run.save()`` after ``step``; the checkpoints it left."""

    def save(run: dtrain.Run) -> bool:
        if run.step_count == step:
            run.save()
        return False

    train_own_loop(raw, lambda run: tiny_loop(run, save))
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
            if kind == "leave mid step" and run.step_count == 1:
                break  # step 2's batch taken, never stepped
            for inputs, targets in batch:
                losses = task.loss_fn(model(inputs), targets)
                if kind == "mean loss":
                    losses = losses.mean()
                if kind != "step before backward":
                    run.backward(losses)
            run.step()

    return error_of(raw, loop)


def evaluate_and_reduce(raw: dict[str, Any], samples: int) -> dict[str, Any]:
    """``run.evaluate`` of the first ``samples`` validation samples before the first step (per
    token: the loss, and each target token's id, whose mean the data alone says), then the
    example's steps; ``run.reduce`` of this rank's number (rank + 1) by every op."""
    from torch.utils.data import Subset

    from tests.tasks import tiny_gpt

    out: dict[str, Any] = {}

    def loop(run: dtrain.Run) -> None:
        task = tiny_gpt(run.config)
        model, _ = run.prepare(task.model, task.train_data, collate_fn=task.collate_fn)
        val = Subset(task.val_data, range(samples))

        def fn(inputs: Any, targets: Any) -> dict[str, Any]:
            return {"loss": task.loss_fn(model(inputs), targets), "token": targets.double()}

        out["eval"] = run.evaluate(val, fn, batch_size=3)
        for batch in run.batches():
            for inputs, targets in batch:
                run.backward(task.loss_fn(model(inputs), targets))
            run.step()
        mine = float(run.rank + 1)
        out["reduce"] = {op: run.reduce(mine, op) for op in ("sum", "mean", "max", "min")}
        out["reduce_tensor"] = run.reduce(torch.full((2,), mine), "sum").tolist()
        run.log(ranks_summed=out["reduce"]["sum"])  # a record of the loop's own

    train_own_loop(raw, loop)
    return out


def stop_on_one_rank(raw: dict[str, Any], rank: int, step: int) -> dict[str, Any]:
    """The tiny loop, where ``rank`` alone calls ``run.stop()`` before the forward of ``step``;
    the loop itself never breaks (``run.batches()`` ends where the ranks agreed)."""
    from tests.tasks import tiny_gpt

    def loop(run: dtrain.Run) -> None:
        task = tiny_gpt(run.config)
        model, _ = run.prepare(task.model, task.train_data, collate_fn=task.collate_fn)
        for batch in run.batches():
            if run.rank == rank and run.step_count + 1 == step:
                run.stop(f"rank {rank} had enough")
            for inputs, targets in batch:
                run.backward(task.loss_fn(model(inputs), targets))
            run.step()

    return train_own_loop(raw, loop)


def early_stop_example(raw: dict[str, Any], patience: int, min_improvement: float) -> Any:
    """examples/own_loop_early_stop.py's loop: what the run did, and its evaluations."""
    from examples.own_loop_early_stop import train

    evaluations: list[dict[str, float]] = []

    def loop(run: dtrain.Run) -> None:
        evaluations.extend(train(run, patience, min_improvement))

    return {**train_own_loop(raw, loop), "evaluations": evaluations}


def evaluation_mistake(raw: dict[str, Any], kind: str) -> str:
    """The one-line error of ``run.evaluate`` given mistake ``kind``."""
    from tests.tasks import tiny_gpt

    def loop(run: dtrain.Run) -> None:
        task = tiny_gpt(run.config)
        model, _ = run.prepare(task.model, task.train_data, collate_fn=task.collate_fn)

        def fn(inputs: Any, targets: Any) -> Any:
            losses = task.loss_fn(model(inputs), targets)
            if kind == "no loss":
                return {"right": losses}
            if kind == "a number":
                return {"loss": float(losses.mean())}
            return {"loss": losses, "items": losses}

        run.evaluate(task.val_data, fn)

    return error_of(raw, loop)


def sgd(params: list[tuple[str, Any]]) -> Any:
    """The GAN's critic under SGD, as tiny_raw's generator: both compare at 1e-5 (Adam's
    division by sqrt(v) turns last-bit differences near zero gradients into visible ones)."""
    import torch

    return torch.optim.SGD(params, lr=0.05)


def gan_loop(run: dtrain.Run, signal_at: tuple[int, int, str] | None = None) -> None:
    """The GAN example's loop with an SGD critic; ``signal_at``: (rank, step, signal) sent to
    this process as that rank starts that step."""
    from examples.own_loop_gan import train_gan

    if signal_at is not None:
        rank, step, signame = signal_at

        def send(name: str, **args: Any) -> None:
            if name == "train.step" and args["step"] == step and run.rank == rank:
                os.kill(os.getpid(), getattr(signal, signame))

        set_handler(send)
    try:
        train_gan(run, sgd)
    finally:
        set_handler(None)


def gan_params(
    raw: dict[str, Any], signal_at: tuple[int, int, str] | None = None
) -> dict[str, Any]:
    """:func:`gan_loop` trained as this rank of the job: both models' parameters (the
    critic's under ``critic.``), whether it was preempted, its steps."""
    params, summary, _ = train_two_models(raw, lambda r: gan_loop(r, signal_at))
    return {"params": params, "preempted": summary.preempted, "steps": summary.steps}


def train_two_models(
    raw: dict[str, Any], loop: Callable[[dtrain.Run], object]
) -> tuple[dict[str, Any], Any, float | None]:
    """``loop`` (a main model and a critic) trained as this rank of the job: both models'
    parameters (the critic's under ``critic.``), the summary, and the fp16 loss scale the run
    ended with (None without one)."""
    run = dtrain.Run.join(build_job_config(raw))
    summary = run.train(loop)
    params = params_of(run.trainer)
    critic = run._wrapped["critic"].strategy.model_state_dict()  # collective under fsdp
    params.update({f"critic.{k}": v.detach().cpu().numpy().copy() for k, v in critic.items()})
    scaler = run.trainer.scaler
    return params, summary, None if scaler is None else scaler.scale


def models_mistake(raw: dict[str, Any], kind: str) -> str:
    """The one-line error of a loop with further models that makes mistake ``kind``."""
    import torch
    import torch.nn.functional as F
    from examples.own_loop_gan import LATENT, MLP, RingSamples, samples

    def loop(run: dtrain.Run) -> None:
        generator, _ = run.prepare(MLP(LATENT, 8, 2), RingSamples(64), count_items=samples)
        critic: Any = MLP(2, 8, 1)
        if kind != "not wrapped":
            critic, _ = run.wrap("critic", critic, optimizer=sgd)
        for batch in run.batches():
            if kind == "wrap after start":
                run.wrap("late", MLP(2, 8, 1))
            for latents, _real in batch:
                run.backward(F.softplus(-critic(generator(latents)).squeeze(1)))
            if kind == "update of another optimizer":
                run.update(torch.optim.SGD(generator.parameters(), lr=0.1))
            run.step()

    return error_of(raw, loop)


def frozen_teacher(raw: dict[str, Any]) -> dict[str, Any]:
    """A distillation's set-up: a teacher built differently on each rank (seeded by rank),
    given to run.wrap without an optimizer; what the loop calls, and the student's
    parameters after training towards the teacher's outputs."""
    import torch
    import torch.nn.functional as F
    from examples.own_loop_gan import LATENT, MLP, RingSamples, samples

    seen: dict[str, Any] = {}

    def loop(run: dtrain.Run) -> None:
        student, _ = run.prepare(MLP(LATENT, 8, 2), RingSamples(64), count_items=samples)
        torch.manual_seed(run.rank)
        teacher, optimizer = run.wrap("teacher", MLP(LATENT, 16, 2))
        seen["optimizer"] = optimizer
        seen["requires_grad"] = any(p.requires_grad for p in teacher.parameters())
        seen["teacher"] = {k: v.numpy().copy() for k, v in teacher.state_dict().items()}
        for batch in run.batches():
            for latents, _real in batch:
                with torch.no_grad():
                    goal = teacher(latents)
                run.backward(F.mse_loss(student(latents), goal, reduction="none").sum(1))
            run.step()

    summary = train_own_loop(raw, loop)
    return {**seen, "student": summary["params"]}


def right_half(targets: Any) -> int:
    """The items of a ring batch in :func:`half_ring_gan`: its points right of the axis."""
    return int((targets[:, 0] > 0).sum())


def half_ring_gan(raw: dict[str, Any], exact: bool = False) -> dict[str, Any]:
    """The GAN's two phases with a loss on the points right of the axis only: a step's global
    item count changes from step to step, so the critic's update rescales its gradients for
    the count the ranks agree on (its scale assumed the step before's). ``exact``: every step
    agrees on its count before its forward instead (nothing assumed, nothing rescaled). Both
    models' parameters, the critic's under ``critic.``."""
    import torch
    import torch.nn.functional as F
    from examples.own_loop_gan import LATENT, MLP, RingSamples

    def loop(run: dtrain.Run) -> None:
        generator, _ = run.prepare(MLP(LATENT, 16, 2), RingSamples(256), count_items=right_half)
        critic, critic_optimizer = run.wrap("critic", MLP(2, 16, 1), optimizer=sgd)
        assert critic_optimizer is not None
        for batch in run.batches():
            if exact:  # nothing to assume: the step's first half agrees before the forward
                run.trainer.forward_backward.expected = None
            for latents, real in batch:
                right = real[:, 0] > 0
                with torch.no_grad():
                    fake = generator(latents)
                real_scores, fake_scores = critic(torch.cat([real, fake])).squeeze(1).chunk(2)
                losses = F.softplus(-real_scores) + F.softplus(fake_scores)
                run.backward(losses[right])
            run.update(critic_optimizer)
            for latents, real in batch:
                losses = F.softplus(-critic(generator(latents)).squeeze(1))
                run.backward(losses[real[:, 0] > 0])
            run.step()

    return train_two_models(raw, loop)[0]


def leave_stream(raw: dict[str, Any], leaving: list[int], after: int) -> dict[str, Any]:
    """The tiny loop, where the ranks in ``leaving`` ``break`` out of ``run.batches()`` after
    step ``after`` and the others go on: what each rank said (one line; "" if none) and did."""
    from dtrain.fault.peer_failure import PeerFailure

    def leaves(run: dtrain.Run) -> bool:
        return run.rank in leaving and run.step_count == after

    try:
        return {"said": "", **train_own_loop(raw, lambda run: tiny_loop(run, leaves))}
    except (UserError, PeerFailure) as exc:
        return {"said": str(exc)}


def notebook(config: str) -> dict[str, Any]:
    """``dtrain.Run.from_config`` as a notebook uses it, twice in one process: 3 steps of the
    example by ``run.train``, then the run resumed from a ``Config`` with 2 more steps, driven
    by hand and ended by ``run.finish()``; and a mistaken override."""
    from dtrain.errors import ConfigError
    from dtrain.train.job import load_job_config

    first = dtrain.Run.from_config(config, "--train.steps=3").train(example_main)
    run = dtrain.Run.from_config(load_job_config(config), "--train.steps=5")
    tiny_loop(run)  # as a notebook's cell would write it, then:
    second = run.finish()
    try:
        dtrain.Run.from_config(config, "--train.stepz=3")
        mistaken = "no error"
    except ConfigError as exc:
        mistaken = str(exc)
    return {
        "first": (first.start_step, first.steps),
        "second": (second.start_step, second.steps),
        "mistaken": mistaken,
    }


def loud_critic_gan(raw: dict[str, Any]) -> dict[str, Any]:
    """The GAN's two phases with the critic's losses 2**10 times the generator's: under
    fp16-mixed its gradients overflow float16 at loss scales the generator's do not. Both
    models' parameters (the critic's under ``critic.``) and the loss scale the run ended with."""
    import torch
    import torch.nn.functional as F
    from examples.own_loop_gan import LATENT, MLP, RingSamples, samples

    def loop(run: dtrain.Run) -> None:
        generator, _ = run.prepare(MLP(LATENT, 16, 2), RingSamples(256), count_items=samples)
        critic, critic_optimizer = run.wrap("critic", MLP(2, 16, 1), optimizer=sgd)
        assert critic_optimizer is not None
        for batch in run.batches():
            for latents, real in batch:
                with torch.no_grad():
                    fake = generator(latents)
                real_scores, fake_scores = critic(torch.cat([real, fake])).squeeze(1).chunk(2)
                run.backward((F.softplus(-real_scores) + F.softplus(fake_scores)) * 2.0**10)
            run.update(critic_optimizer)
            for latents, _real in batch:
                run.backward(F.softplus(-critic(generator(latents)).squeeze(1)))
            run.step()

    params, _, scale = train_two_models(raw, loop)
    return {"params": params, "scale": scale}
