"""A worker under ``fault.recovery = 'inplace'``: the process's loop across membership
generations (:mod:`dtrain.recovery.inplace` holds what one generation's trainer needs to leave,
heal and go on). It sits above the trainer and the job, as :mod:`dtrain.worker` does, which
calls it.

What trains in a generation is a :class:`GenerationLoop`: dtrain's loop (:class:`TrainerLoop`),
or a loop of the user's own (:mod:`dtrain.loop.inplace`: ``main(run)`` called again in each
generation). Both build one trainer, and recovery reaches it only through its seam
(:mod:`dtrain.train.recovery_seam`), so there is one in-place recovery for both."""

from __future__ import annotations

import gc
import os
import signal
from collections.abc import Callable
from typing import NoReturn, Protocol

from dtrain.checkpoint.layout import committed_steps, step_dir_name
from dtrain.checkpoint.rundir import write_config_of_record
from dtrain.config import Config
from dtrain.console import say_line
from dtrain.dist.runtime import Runtime, barrier
from dtrain.errors import UserError
from dtrain.fault.peer_failure import collective_cause
from dtrain.fault.preempt import early_signal
from dtrain.fault.status import RunStatus, write_status
from dtrain.metrics import records
from dtrain.metrics.sinks import JsonlSink
from dtrain.metrics.summary import Summary, print_summary
from dtrain.recovery.inplace import (
    HeldState,
    Recovery,
    Regroup,
    Retired,
    generation_runtime,
    leave,
)
from dtrain.recovery.membership import (
    COORDINATOR_ENV,
    LOCAL_ENV,
    MEMBER_ENV,
    MEMBERS_ENV,
    PATIENCE_ENV,
    STALE_S,
    Member,
)
from dtrain.train.config_agreement import agree_on_config
from dtrain.train.job import build_agreed_trainer
from dtrain.train.recovery_seam import RecoverySeam
from dtrain.train.trainer import Trainer

# What a generation that must not train (fewer workers than fault.min_replicas) does with its
# trainer once built, before it resumes: heal, save, and end it (raises JobStopped).
Halt = Callable[[Trainer], NoReturn]


class JobStopped(Exception):
    """The job stopped below ``fault.min_replicas``: the survivors saved, and end."""


class GenerationLoop(Protocol):
    """What trains in one membership generation, on a process group that is up."""

    @property
    def trainer(self) -> Trainer | None:
        """The generation's trainer, once built (a regroup holds its state and leaves it)."""

    def fit(self) -> Summary:
        """Resume (heal from the survivors' memory), then train until the run's end; a failed
        collective or an agreed regroup raises (:meth:`RecoverySeam.recoverable`)."""


# How a worker builds a generation's loop: given the config (the ranks agreed on it), the
# generation's runtime, the seam its trainer is given, and the halt it calls instead of
# resuming (None: it trains).
StartLoop = Callable[[Config, Runtime, RecoverySeam, Halt | None], GenerationLoop]


class TrainerLoop:
    """dtrain's loop in one generation: a fresh task and :class:`Trainer` at the generation's
    rank and world size."""

    def __init__(
        self, cfg: Config, runtime: Runtime, recovery: RecoverySeam, halt: Halt | None
    ) -> None:
        self.trainer = build_agreed_trainer(cfg, runtime)
        self.trainer.recovery = recovery
        self._halt = halt

    def fit(self) -> Summary:
        if self._halt is not None:
            self._halt(self.trainer)
        return self.trainer.fit()


def _say(text: str) -> None:
    say_line(f"dtrain: {text}")


def train_in_place(cfg: Config, start: StartLoop = TrainerLoop) -> Summary | None:
    """Train as member ``$DTRAIN_INPLACE_MEMBER`` across generations, each trained by the loop
    ``start`` builds; the summary of the generation that finished the run, or None when the
    run completed before this worker could join or stopped below ``fault.min_replicas``."""
    if not os.environ.get(COORDINATOR_ENV):
        raise UserError(
            "fault.recovery = 'inplace' needs `dtrain train` to start the workers (its "
            "launcher hosts the membership coordinator they join); under torchrun, use "
            "fault.recovery = 'restart'"
        )
    members = int(os.environ.get(MEMBERS_ENV, "1"))
    index, count = os.environ.get(LOCAL_ENV, f"{os.environ[MEMBER_ENV]}/{members}").split("/")
    member = Member(
        os.environ[COORDINATOR_ENV],
        int(os.environ[MEMBER_ENV]),
        members,
        timeout_s=cfg.dist.timeout_s,
        local=(int(index), int(count)),
        patience_s=float(os.environ.get(PATIENCE_ENV, "900")),
    )
    if cfg.strategy.name == "ddp":
        # What building DDP imports on first use (torch._dynamo: 2.5 s here): before this
        # worker asks to join, not while the others wait for it in the new generation.
        import torch._dynamo  # noqa: F401

    held: HeldState | None = None
    after = -1
    retired = Retired(idle_after_s=cfg.dist.timeout_s + 1.0)
    try:
        while True:
            member.ask(after, held.step if held is not None else -1)
            # Before the first generation there is nothing to save: a preemption signal (the
            # launcher's Ctrl-C, a scheduler's SIGTERM) ends the wait at once, not after the
            # launcher's grace of fault.preempt_grace_s and a SIGKILL.
            first = after < 0 and held is None
            generation = member.wait(after, give_up=early_signal if first else None)
            if generation is None and first and early_signal():
                name = signal.Signals(early_signal()).name
                _say(f"member {member.id}: stopped by {name} before the job's first generation")
                return None
            if generation is None:
                stopped = member.stopped()
                why = f"the job stopped ({stopped})" if stopped else "the run completed"
                _say(f"member {member.id}: {why} before this worker could join")
                return None
            # What exists now (imports, the state held) is left out of the cyclic collector's
            # scans from here on: freeing a retired generation scans few objects.
            gc.freeze()
            recovery = Recovery(member, generation, held, retired)
            held = None
            loop: GenerationLoop | None = None
            try:
                runtime = generation_runtime(cfg.dist, generation, member)
                agree_on_config(cfg, runtime)  # one job, one config, on whichever machine
                if runtime.is_main and generation.number == 0:
                    write_config_of_record(cfg)
                loop = start(cfg, runtime, recovery, halt(recovery, retired, generation.stop))
                summary = loop.fit()
            except JobStopped:
                return None
            except BaseException as exc:
                if not recovery.recoverable(exc):
                    raise
                trainer = loop.trainer if loop is not None else None
                if not isinstance(exc, Regroup):
                    recovery.sever()  # first: peers blocked on this rank fail at once
                why = "to admit a worker" if isinstance(exc, Regroup) else collective_cause(exc)
                if recovery.cut_self and not isinstance(exc, Regroup):
                    why = (
                        f"this machine was cut off (silent to the coordinator for "
                        f"{STALE_S:.0f}s): the others went on without it; asking to join"
                    )
                elif recovery.cut_off and not isinstance(exc, Regroup):
                    why = (
                        f"the workers at {', '.join(recovery.cut_off)} fell silent for "
                        f"{STALE_S:.0f}s (cut off, or gone): connections to them shut down"
                    )
                held = recovery.hold(trainer)
                where = f"step {held.step}" if held is not None else "no state yet"
                dropped = " (the step in flight dropped)" if held and held.dropped else ""
                _say(
                    f"member {member.id}: leaving generation {generation.number} at {where}"
                    f"{dropped}: {why}"
                )
            else:
                member.finish()
                done = loop.trainer
                assert done is not None
                if done.is_main:
                    print_summary(summary, done.task.item_name, done.runtime.world_size)
                return summary
            after = generation.number
            leave(trainer)
            retired.keep(trainer)
            del trainer, recovery, loop
    finally:
        member.close()


def halt(recovery: Recovery, retired: Retired, reason: str) -> Halt | None:
    """A generation's halt: None where it trains, else :func:`save_and_stop` (``reason``)."""
    if not reason:
        return None

    def stop(trainer: Trainer) -> NoReturn:
        save_and_stop(trainer, recovery, retired, reason)
        raise JobStopped(reason)

    return stop


def save_and_stop(trainer: Trainer, recovery: Recovery, retired: Retired, reason: str) -> None:
    """A failure left fewer workers than ``fault.min_replicas`` (``reason``): the survivors
    heal as always, save the state they hold as a checkpoint, record that the run stopped
    and end (the launcher says why and exits 1). No step is trained at the smaller size."""
    # An earlier generation's save still being written (or failing, and removing its
    # temporary folder) must not meet this one: each rank waits for its own, then all agree.
    retired.wait_for_saves()
    barrier()
    trainer.resume()  # heals from the survivors' memory
    if trainer.step not in committed_steps(trainer.checkpointer.root):
        trainer.save_checkpoint(blocking=True)
    if trainer.is_main:
        if (event := recovery.event()) is not None:
            sink = JsonlSink(trainer.run_dir / "metrics.jsonl")
            sink.write(records.event("membership", trainer.step, **event, stopped=reason))
            sink.close()
        write_status(trainer.run_dir, RunStatus("stopped", trainer.step, reason))
        _say(f"{reason}: saved {step_dir_name(trainer.step)}; the job stops")
    trainer.loader.close()
