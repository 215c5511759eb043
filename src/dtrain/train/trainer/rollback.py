"""What the NaN guard's decision on a committed step does to the run (the same on every rank):
an overflow said, a skipped update counted, and a rollback -- the newest checkpoint before the
streak loaded and the streak's batches skipped from then on."""

from __future__ import annotations

from typing import Protocol

from dtrain.balance.balancer import LoadBalancer, loader_weights
from dtrain.checkpoint import state as training_state
from dtrain.checkpoint.resume import rollback_point
from dtrain.checkpoint.write import Checkpointer
from dtrain.compute.precision import LossScaler
from dtrain.config import Config
from dtrain.data.loader import StepLoader
from dtrain.dist.runtime import Runtime
from dtrain.fault.watchdog import Watchdog
from dtrain.metrics.run_log import RunLog
from dtrain.train.nan_guard import Decision
from dtrain.train.trainer.counters import Counters


class Trainer(Protocol):
    """What of :class:`dtrain.train.trainer.Trainer` a decision acts on."""

    cfg: Config
    runtime: Runtime
    checkpointer: Checkpointer
    run_log: RunLog
    counters: Counters
    loader: StepLoader
    state: training_state.TrainingState
    balance: LoadBalancer
    watchdog: Watchdog
    scaler: LossScaler | None

    @property
    def step(self) -> int: ...

    def warn(self, text: str) -> None: ...


def carry_out(trainer: Trainer, decision: Decision) -> None:
    """The NaN guard's decision on the step just committed (the same on every rank)."""
    if decision.action == "overflow":
        assert trainer.scaler is not None
        trainer.run_log.event("overflow", trainer.step, loss_scale=trainer.scaler.scale)
    if decision.action not in ("skip", "rollback"):
        return
    trainer.counters.skipped_steps += 1
    trainer.run_log.event("step_skipped", trainer.step, in_a_row=decision.in_a_row)
    trainer.warn(f"step {trainer.step}: non-finite loss or gradient; update skipped on every rank")
    if decision.action == "rollback":
        rollback(trainer, decision)


def rollback(trainer: Trainer, decision: Decision) -> None:
    """Collective: load the newest checkpoint before the streak (the step and counters with
    it) and skip the streak's batches from now on."""
    step, bad = trainer.step, decision.bad
    if error := trainer.checkpointer.wait():
        trainer.warn(error)
    with trainer.watchdog.in_phase("rollback"):
        point = rollback_point(
            trainer.cfg,
            trainer.checkpointer,
            trainer.runtime,
            trainer.run_log.log,
            decision.first_bad,
            step,
            trainer.watchdog,
        )
        # Counters of what happened stay cumulative; the skip list keeps earlier skips too.
        counters = trainer.counters
        rollbacks, skipped = counters.rollbacks + 1, counters.skipped_steps
        earlier_skips = dict(trainer.loader.skipped)
        training_state.load(trainer.state, point)
        counters.rollbacks, counters.skipped_steps = rollbacks, skipped
        for start, end in [*earlier_skips.items(), *bad]:
            trainer.loader.skip(start, end)
        trainer.loader.set_weights(loader_weights(trainer.balance.weights))  # the state's shares
    # At the checkpoint's step, which the trainer's step now is; from the streak's last.
    trainer.run_log.event("rollback", point.step, from_step=step, checkpoint=point.path.name)
    trainer.run_log.log(
        f"rolled back to {point.path.name} after {len(bad)} non-finite steps; the "
        f"{sum(e - s for s, e in bad)} samples of those steps will not be delivered again"
    )
