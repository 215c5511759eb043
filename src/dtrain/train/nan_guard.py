"""The NaN guard: a step whose global gradient norm is not finite changes nothing -- the
trainer skips its update on every rank (the norm is global, so every rank takes the same
branch without another collective) -- and after ``fault.nan_rollback_after`` such steps in a
row the run rolls back to the newest checkpoint before them, never to deliver their batches
again.

Under fp16-mixed a non-finite gradient is first the loss scaler's: when every rank's loss was
finite and the scale is above its floor, the scale caused it (an overflow: skipped, the scale
halved, no streak); otherwise it is a divergence, the guard's.
"""

from __future__ import annotations

import math

import torch

from dtrain.checkpoint import state as training_state
from dtrain.checkpoint.resume import rollback_point
from dtrain.checkpoint.write import Checkpointer
from dtrain.compute.precision import LossScaler
from dtrain.config import Config
from dtrain.data.loader import RankLoader, StepBatch
from dtrain.dist.runtime import Runtime
from dtrain.fault.watchdog import Watchdog
from dtrain.metrics.run_log import RunLog
from dtrain.parallel.base import Strategy


class NanGuard:
    """See the module docstring. Its counters are part of the training state: the trainer's
    state_dict holds them (under the keys it always had)."""

    def __init__(
        self,
        cfg: Config,
        runtime: Runtime,
        strategy: Strategy,
        loader: RankLoader,
        state: training_state.TrainingState,
        checkpointer: Checkpointer,
        watchdog: Watchdog,
        scaler: LossScaler | None,
        run_log: RunLog,
    ) -> None:
        self.cfg = cfg
        self.runtime = runtime
        self.strategy = strategy
        self.loader = loader
        self.state = state
        self.checkpointer = checkpointer
        self.watchdog = watchdog
        self.scaler = scaler
        self.run_log = run_log
        self.skipped_steps = 0
        self.rollbacks = 0
        self.streak: list[tuple[int, int]] = []  # stream ranges of consecutive bad steps

    def loss_scale_overflowed(self, norm: float, loss_sum: torch.Tensor) -> bool:
        """After the clip, under fp16-mixed: whether a non-finite ``norm`` is the loss
        scale's overflow; the scaler halves the scale after one, and grows it after enough
        steps without. False without a scaler. Collective after a non-finite norm."""
        if self.scaler is None:
            return False
        overflowed = not math.isfinite(norm) and self._scaler_overflow(loss_sum)
        self.scaler.update(overflowed)
        return overflowed

    def _scaler_overflow(self, loss_sum: torch.Tensor) -> bool:
        """After a non-finite gradient under fp16: whether the loss scale caused it (every
        rank's loss finite, the scale above its floor) -- the scaler's to handle -- rather than
        a divergence, which is the NaN guard's. Collective; the same answer on every rank."""
        assert self.scaler is not None
        if self.scaler.scale <= self.scaler.min_scale:
            return False
        self.watchdog.set_phase("all_reduce(loss check)")
        bad = torch.logical_not(torch.isfinite(loss_sum)).float().reshape(1)
        return float(self.strategy.all_reduce_loss(bad)[0]) == 0.0

    def after_step(self, step: int, batch: StepBatch, norm: float, overflowed: bool) -> None:
        """Step ``step`` is committed: a finite norm ends a streak; an overflow is an event;
        any other non-finite norm a skipped step, and the Nth in a row a rollback (the same
        on every rank: the norm is global)."""
        if math.isfinite(norm):
            self.streak.clear()
        elif overflowed:
            assert self.scaler is not None
            self.run_log.event("overflow", step, loss_scale=self.scaler.scale)
        else:
            self._on_non_finite(step, batch)

    def _on_non_finite(self, step: int, batch: StepBatch) -> None:
        """The step was skipped on every rank; roll back after N in a row."""
        self.skipped_steps += 1
        self.streak.append((batch.plan.start, batch.plan.end))
        self.run_log.event("step_skipped", step, in_a_row=len(self.streak))
        self.run_log.warn(f"step {step}: non-finite loss or gradient; update skipped on every rank")
        limit = self.cfg.fault.nan_rollback_after
        if limit and len(self.streak) >= limit:
            self._rollback(step)

    def _rollback(self, step: int) -> None:
        """Collective: load the newest checkpoint before the streak (the trainer's step and
        counters with it) and skip the streak's batches from now on."""
        bad = list(self.streak)
        self.streak.clear()
        first_bad_step = step - len(bad) + 1
        error = self.checkpointer.wait()
        if error:
            self.run_log.warn(error)
        self.watchdog.set_phase("rollback")
        point = rollback_point(
            self.cfg,
            self.checkpointer,
            self.runtime,
            self.run_log.log,
            first_bad_step,
            step,
            self.watchdog,
        )
        # Counters of what happened stay cumulative; the skip list keeps earlier skips too.
        rollbacks, skipped = self.rollbacks + 1, self.skipped_steps
        earlier_skips = dict(self.loader.skipped)
        training_state.load(self.state, point)
        self.rollbacks, self.skipped_steps = rollbacks, skipped
        for start, end in [*earlier_skips.items(), *bad]:
            self.loader.skip(start, end)
        # At the checkpoint's step, which the trainer's step now is; from the streak's last.
        self.run_log.event("rollback", point.step, from_step=step, checkpoint=point.path.name)
        self.run_log.log(
            f"rolled back to {point.path.name} after {len(bad)} non-finite steps; the "
            f"{sum(e - s for s, e in bad)} samples of those steps will not be delivered again"
        )
