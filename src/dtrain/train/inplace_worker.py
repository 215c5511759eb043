"""A worker under ``fault.recovery = 'inplace'``: the process's loop across membership
generations (:mod:`dtrain.recovery.inplace` holds what one generation's trainer needs to leave,
heal and go on). It sits above the trainer and the job, as :mod:`dtrain.worker` does, which
calls it."""

from __future__ import annotations

import gc
import os
import signal

from dtrain.checkpoint.layout import committed_steps, step_dir_name
from dtrain.checkpoint.rundir import write_config_of_record
from dtrain.config import Config
from dtrain.console import say_line
from dtrain.dist.runtime import barrier
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
from dtrain.train.job import build_trainer_on
from dtrain.train.trainer import Trainer


def _say(text: str) -> None:
    say_line(f"dtrain: {text}")


def train_in_place(cfg: Config) -> Summary | None:
    """Train as member ``$DTRAIN_INPLACE_MEMBER`` across generations; the summary of the
    generation that finished the run, or None when the run completed before this worker
    could join or stopped below ``fault.min_replicas``."""
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
            trainer: Trainer | None = None
            try:
                runtime = generation_runtime(cfg.dist, generation, member)
                trainer = build_trainer_on(cfg, runtime)
                trainer.recovery = recovery
                if trainer.is_main and generation.number == 0:
                    write_config_of_record(cfg)
                if generation.stop:
                    save_and_stop(trainer, recovery, retired, generation.stop)
                    return None
                summary = trainer.fit()
            except BaseException as exc:
                if not recovery.recoverable(exc):
                    raise
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
                if trainer.is_main:
                    print_summary(summary, trainer.task.item_name, trainer.runtime.world_size)
                return summary
            after = generation.number
            leave(trainer)
            retired.keep(trainer)
            del trainer, recovery
    finally:
        member.close()


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
        event = recovery.event()
        if event is not None:
            sink = JsonlSink(trainer.run_dir / "metrics.jsonl")
            sink.write(records.event("membership", trainer.step, **event, stopped=reason))
            sink.close()
        write_status(trainer.run_dir, RunStatus("stopped", trainer.step, reason))
        _say(f"{reason}: saved {step_dir_name(trainer.step)}; the job stops")
    trainer.loader.close()
