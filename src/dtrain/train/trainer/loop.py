"""The loop: :class:`Trainer` runs the steps over the components the wiring built (the
package's docstring draws the whole loop)."""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from dtrain.balance.balancer import LoadBalancer, Outcome, loader_weights
from dtrain.checkpoint import layout
from dtrain.checkpoint import state as training_state
from dtrain.checkpoint.publish import publish_records
from dtrain.checkpoint.resume import ResumePoint, resolve_resume
from dtrain.checkpoint.rng import rank_seed, seed_everything
from dtrain.checkpoint.write import Checkpointer
from dtrain.comm.agreement import StepAgreement
from dtrain.compute.precision import LossScaler
from dtrain.config import Config
from dtrain.data.loader import StepBatch, StepLoader, split_to_device
from dtrain.dist.runtime import Runtime, barrier
from dtrain.fault.audit import AuditWriter
from dtrain.fault.failpoints import failpoint
from dtrain.fault.preempt import PreemptionFlag
from dtrain.fault.watchdog import Watchdog
from dtrain.fsutil import local_run_dir
from dtrain.metrics.run_log import RunLog
from dtrain.metrics.summary import LossWindow, Summary
from dtrain.parallel.base import Strategy
from dtrain.task import Task
from dtrain.train.evaluation import evaluate
from dtrain.train.nan_guard import NanGuard
from dtrain.train.profile import StepProfiler
from dtrain.train.recovery_seam import RecoverySeam
from dtrain.train.step import ForwardBackward
from dtrain.train.trainer.counters import Counters
from dtrain.train.trainer.rollback import carry_out


@dataclass
class LoopState:
    """What the loop carries from step to step."""

    summary: Summary
    started: float  # perf_counter() at the start of fit
    window: LossWindow  # the losses since the last metrics line
    last_loss: float = float("nan")  # of the last metrics line


class Trainer:
    """The loop over the components :func:`dtrain.train.wiring.wire_trainer` built (kept here)."""

    def __init__(
        self,
        cfg: Config,
        task: Task,
        runtime: Runtime,
        *,
        strategy: Strategy,
        run_log: RunLog,
        optimizer: torch.optim.Optimizer,
        scheduler: Any,
        loader: StepLoader,
        balance: LoadBalancer,
        scaler: LossScaler | None,
        forward_backward: ForwardBackward,
        counters: Counters,
        state: training_state.TrainingState,
        watchdog: Watchdog,
        checkpointer: Checkpointer,
        nan_guard: NanGuard,
        profiler: StepProfiler,
    ) -> None:
        self.cfg, self.task, self.runtime, self.strategy = cfg, task, runtime, strategy
        # This machine's folder (the run folder, or its local one where that is in a store).
        self.run_dir, self.is_main = local_run_dir(cfg.run.dir, cfg.run.local_dir), runtime.is_main
        self.optimizer, self.scheduler, self.loader = optimizer, scheduler, loader
        self.balance, self.scaler, self.forward_backward = balance, scaler, forward_backward
        self.counters, self.state, self.run_log = counters, state, run_log
        self.watchdog, self.checkpointer = watchdog, checkpointer
        self.nan_guard, self.profiler = nan_guard, profiler  # the profiler: inert outside its steps
        self.phase = watchdog.in_phase  # `with self.phase(name):` the liveness record's phase
        self.step_lr = float("nan")  # the learning rate the last step trained with
        self.val_metrics: dict[str, float] = {}  # of the latest evaluation
        self.audit: AuditWriter | None = None  # fault.audit_sample_ids, opened at the start
        # fault.recovery = 'inplace': set by the in-place worker (see train/recovery_seam.py).
        self.recovery: RecoverySeam | None = None

    @property
    def step(self) -> int:
        return self.counters.step

    @step.setter
    def step(self, value: int) -> None:
        self.counters.step = value

    # -- logging -------------------------------------------------------------------------

    def log(self, text: str) -> None:
        """Resume logs through this (tests wrap it to read what resume said)."""
        self.run_log.log(text)

    def warn(self, text: str) -> None:
        """A warning from any rank (not only rank 0), tagged with the rank."""
        self.run_log.warn(text)

    # -- training state ------------------------------------------------------------------

    def save_checkpoint(self, *, blocking: bool) -> None:
        with self.phase("checkpoint"):
            training_state.save(self.state, self.checkpointer, self.step, blocking=blocking)
        blocked = self.checkpointer.blocking_seconds[-1]
        self.run_log.event("checkpoint", self.step, blocked_s=blocked, async_save=not blocking)
        self.publish_records()

    def publish_records(self) -> None:
        """Records (rank 0's), traces (each rank's) to a store's run folder; a failure warns."""
        try:
            self.profiler.publish()
            if self.is_main:
                publish_records(self.cfg.run.dir, self.cfg.run.local_dir)
        except OSError as exc:
            self.warn(f"the run's records were not uploaded: {exc}")

    def resume(self) -> ResumePoint | None:
        """Load the checkpoint ``run.resume`` asks for, if any; then every RNG either holds
        the saved state or, on a fresh start or at a new world size, a distinct, reproducible
        stream per rank."""
        point = None
        if self.recovery is not None and self.recovery.heal(self):
            seed_everything(rank_seed(self.cfg.run.seed, self.runtime.rank) + self.step)
        else:  # not healed from a peer's memory
            point = resolve_resume(
                self.cfg, self.checkpointer, self.runtime, self.log, watchdog=self.watchdog
            )
            self.warm_loader(point)
            if point is None or not training_state.load(self.state, point):
                seed_everything(rank_seed(self.cfg.run.seed, self.runtime.rank) + self.step)
            if point is not None and point.strategy not in (None, self.strategy.name):
                self.log(
                    f"dtrain: {point.path.name} was saved by strategy {point.strategy!r}; "
                    f"{self.strategy.name} read its model and optimizer state"
                )
        self.loader.set_weights(loader_weights(self.balance.weights))  # the state's shares
        self.warm_loader(None)  # from a peer's position (healed), or with new shares
        return point

    def warm_loader(self, point: ResumePoint | None) -> None:
        """Read ahead of the data position now known (while a checkpoint's rest loads)."""
        try:
            if (point.step if point else self.step) < self.cfg.train.steps:
                self.loader.warm(point.data if point else None)
        except BaseException:
            if point is not None:
                point.loaded()  # what this rank kept of it goes, as after a failed load
            raise

    # -- the loop ------------------------------------------------------------------------

    def fit(self) -> Summary:
        with self.running() as preempt:
            return self._fit(preempt)

    @contextlib.contextmanager
    def running(self) -> Iterator[PreemptionFlag]:
        """While training runs: the watchdog watching, the preemption signals caught (the flag
        given), an error diagnosed by the watchdog. Around :meth:`fit`, and around a loop of
        the user's own (:mod:`dtrain.loop`)."""
        preempt = PreemptionFlag(self.cfg.fault.preempt_signals)
        self.watchdog.start()
        try:
            yield preempt
        except BaseException as exc:
            if self.recovery is not None and self.recovery.recoverable(exc):
                raise  # the survivors go on (in-place recovery): no diagnosis to wait for
            error = self.watchdog.on_error(exc)
            if error is exc:
                raise
            raise error from exc
        finally:
            self.loader.close()  # its prefetch stops on every way out, not only at the end
            self.profiler.discard()  # left inside train.profile's window by an error
            self.watchdog.stop()
            preempt.restore()
            if self.audit is not None:
                self.audit.close()

    def _fit(self, preempt: PreemptionFlag) -> Summary:
        started, steps = time.perf_counter(), self.cfg.train.steps
        with self.phase("resume"):
            point = self.resume()
        summary = Summary(start_step=self.step, start_items=self.counters.items_seen)
        if self.step >= steps:
            return self.already_finished(summary, started)
        with self.phase("train"):  # what a rank between two phases of the loop says
            loop = self.open_loop(point, summary, started)
            while self.step < steps:
                batch, micro, count, planned = self.next_batch()
                logs = self.logs_now()
                failpoint("train.step", step=self.step + 1)
                with self.phase("forward_backward"):
                    loss_sum, agreement = self.forward_backward(
                        micro, self.task.loss_fn, count, preempt.requested, planned, self.regroup()
                    )
                if self.end_step(loop, batch, loss_sum, agreement, logs, preempt):
                    break
            self.finish(summary, loop.last_loss, started)
        self.watchdog.set_phase("done")  # the last word, left by no phase
        return summary

    def open_loop(self, point: ResumePoint | None, summary: Summary, started: float) -> LoopState:
        """Training starts at ``self.step``: the run log's sinks and start record, the audit;
        what the loop carries from step to step."""
        membership = self.recovery.event() if self.recovery is not None else None
        resumed_from = point.path.name if point is not None else None
        in_place, counts = self.recovery is not None, self.strategy.counts_items
        self.run_log.open(self.step, self.balance.hosts, resumed_from, membership, in_place)
        if self.cfg.fault.audit_sample_ids:
            self.audit = AuditWriter.open(self.run_dir, self.runtime.rank, records=counts)
        self.strategy.unwrapped.train()
        return LoopState(summary, started, LossWindow(self.runtime.device))

    def logs_now(self) -> bool:
        """Whether the step about to run writes a metrics line."""
        step = self.step + 1
        return step % self.cfg.train.log_every == 0 or step == self.cfg.train.steps

    def end_step(
        self,
        loop: LoopState,
        batch: StepBatch,
        loss_sum: torch.Tensor,
        agreement: StepAgreement,
        logs: bool,
        preempt: PreemptionFlag,
    ) -> bool:
        """Everything after the step's backward: the update, then what follows a committed
        step (synchronizing strategies, balance, audit, NaN guard, metrics, evaluation,
        checkpoint). Returns whether the ranks agreed to stop (a preemption) after it."""
        steps = self.cfg.train.steps
        norm, overflowed = self._update(loss_sum, agreement, loop.window, logs)
        self.step += 1
        self.counters.items_seen += agreement.items  # committed: counters with it
        if self.audit is not None:
            self.audit.commit(self.step, rollbacks=self.counters.rollbacks)
        if self.step == loop.summary.start_step + 1:
            self._first_step_done(time.perf_counter() - loop.started)
        # Strategies that synchronize every few steps (localsgd, diloco) do it here,
        # before a rollback, a checkpoint or an evaluation of this step sees the model.
        with self.phase("after_optimizer_step"):
            self.strategy.after_optimizer_step(self.step)
        # Once a timing window: the ranks' timings gathered; new shares from the next
        # step on (the same on every rank).
        with self.phase("balance"):
            self._balanced(self.balance.step_finished(self.step))
        span = (batch.plan.start, batch.plan.end)
        carry_out(self, self.nan_guard.decide(self.step, norm, overflowed, span))
        self._poll_checkpoint()
        if logs:
            loop.last_loss = self._log_train(loop.window, norm)
        if agreement.stop and self.step < steps:
            # Every rank learnt it in the same step's agreement: all stop after this
            # step's update, and the final save follows.
            loop.summary.preempted = preempt.signal_name or "a peer's signal"
            self.run_log.event("preempted", self.step, signal=loop.summary.preempted)
            return self._step_ended(stopped=True)
        if self._due(self.cfg.eval.every):
            self.evaluate(self.cfg.eval.max_samples)
        if self._due(self.cfg.checkpoint.every):
            self.save_checkpoint(blocking=not self.cfg.checkpoint.async_save)
        if agreement.regroup and self.recovery is not None and self.step < steps:
            # A worker waits to join (fault.recovery = 'inplace'); every rank learnt it
            # in this step's agreement: all leave after it, its evaluation and save done.
            self.recovery.regroup(self.step)
        return self._step_ended(stopped=False)

    def _step_ended(self, stopped: bool) -> bool:
        """The step has ended, all of it (update, metrics, evaluation, checkpoint):
        ``train.profile``'s window closes here. Returns ``stopped``."""
        if (trace := self.profiler.step_ended(self.step, stopped)) is not None:
            self.log(f"dtrain: profiler traces of {trace.stem} in {trace.parent} (one per rank)")
        return stopped

    # -- the loop's parts, in the order it calls them -------------------------------------

    def next_batch(self) -> tuple[StepBatch, list[Any], int, int | None]:
        """The next step's batch, its micro-batches on the device, this rank's item count, and
        the step's global count from its plan where the task declares ``items_per_sample``
        (this rank's count checked against it), else None. Under in-place recovery the step's
        start is kept first (what a dropped step goes back to): every loop, dtrain's and an own
        loop's (:mod:`dtrain.loop`), starts its steps here."""
        if self.recovery is not None:
            self.recovery.step_starting(self)
        self.profiler.step_starting(self.step + 1)  # an int compare outside its window
        with self.phase("data", self.step + 1):
            self.balance.step_started()
            batch = next(self.loader)
            parts = [split_to_device(self.task, m, self.runtime.device) for m in batch.micro]
            micro = [part for part, _ in parts]
            count = sum(items for _, items in parts)
            self.balance.data_ready(batch, count)
            planned = None
            if (per_sample := self.task.items_per_sample) is not None:
                planned = batch.planned_items(per_sample, count, self.step + 1)
            self._audit(batch)
            failpoint("train.before_collective", step=self.step + 1)
        return batch, micro, count, planned

    def regroup(self) -> bool:
        """Whether this rank asks, in the step's agreement, that every rank leave the generation
        after the step: a worker waits to join (in-place recovery only)."""
        return self.recovery is not None and self.recovery.joiner_waiting()

    def _update(
        self, loss_sum: torch.Tensor, agreement: StepAgreement, window: LossWindow, logs: bool
    ) -> tuple[float, bool]:
        """Clip and (when the gradient is finite) update; the step's loss goes into
        ``window``, whose sum over the ranks starts here on a step that logs. Returns the
        global gradient norm, and whether the gradient overflowed because of fp16's loss scale
        (skipped, the scale halved)."""
        with self.phase("forward_backward"):
            # The gradient sync has just brought the ranks together: start the step's small
            # collectives now, to complete during the optimizer step.
            window.add(loss_sum, agreement.items)
            if logs:
                window.start_sum(self.strategy)
            self.balance.backward_done(self.step + 1)
        with self.phase("clip_grad_norm"):
            norm = float(self.strategy.clip_grad_norm(self.cfg.train.grad_clip))
        with self.phase("optimizer"):
            # The norm is global (gradients are synchronized, or the norm is all-reduced), so
            # every rank takes the same branch here without another collective.
            if math.isfinite(norm):
                self.optimizer.step()
            # What the logged lr is (docs/metrics.md): this step's, before the schedule moves on.
            self.step_lr = float(self.optimizer.param_groups[0]["lr"])
            # fp16-mixed: the scaler halves its scale after an overflow, and grows it after
            # enough steps without (a further optimizer's overflow within the step counts too).
            overflowed = self.scale_overflowed(norm, loss_sum)
            if self.scaler is not None:
                self.scaler.update(overflowed)
            self.scheduler.step()
            self.optimizer.zero_grad(set_to_none=True)
        return norm, overflowed

    def scale_overflowed(self, norm: float, loss_sum: torch.Tensor) -> bool:
        """Whether a non-finite ``norm`` is fp16's loss scale overflowing -- the scaler's to
        handle -- rather than a divergence, the NaN guard's: every rank's ``loss_sum`` finite,
        the scale above its floor. False without a scaler. Collective after a non-finite norm."""
        scaler = self.scaler
        if scaler is None or math.isfinite(norm) or scaler.scale <= scaler.min_scale:
            return False
        with self.phase("all_reduce(loss check)"):
            bad = torch.logical_not(torch.isfinite(loss_sum)).float().reshape(1)
            return float(self.strategy.all_reduce_loss(bad)[0]) == 0.0

    def _balanced(self, outcome: Outcome) -> None:
        """The load balancer's records written; its new weights (the same on every rank)
        cut the loader's batches from the next step on."""
        self.run_log.write_records(outcome.records)
        if outcome.weights is not None:
            self.loader.set_weights(loader_weights(outcome.weights))

    def _audit(self, batch: StepBatch) -> None:
        """The step's sample ids on record before its first collective (its commit follows the
        update): a rank killed once its gradient was summed has its part on record."""
        if self.audit is not None:
            self.audit.record(
                self.step + 1,
                batch.plan.start,
                batch.plan.end,
                batch.ids,
                rollbacks=self.counters.rollbacks,
            )

    def _poll_checkpoint(self) -> None:
        """An asynchronous save that failed since the last step: said, and recorded."""
        if error := self.checkpointer.poll():
            self.warn(error)
            self.run_log.event("checkpoint_failed", self.step, error=error)

    def _log_train(self, window: LossWindow, norm: float) -> float:
        """A train record for the window's steps; returns its mean loss over the ranks."""
        with self.phase("all_reduce(metrics)"):
            loss, rate, steps, elapsed = window.flush()
            self.run_log.train(
                self.step,
                loss,
                norm,
                rate,
                steps,
                elapsed,
                lr=self.step_lr,
                epoch=self.loader.epoch(),
                items_seen=self.counters.items_seen,
                skipped_steps=self.counters.skipped_steps,
            )
        return loss

    def _due(self, every: int) -> bool:
        """Whether a task done every ``every`` steps (0: never) is due after this step; the
        last step's evaluation and save are the end's."""
        return bool(every) and self.step % every == 0 and self.step < self.cfg.train.steps

    def finish(self, summary: Summary, last_loss: float, started: float) -> None:
        """The end of training: the whole validation set, the final checkpoint, the summary."""
        # A loop of the user's own that stopped early inside train.profile's window: its trace
        # holds the steps done (dtrain's loop closes the window at its last step or stop).
        self._step_ended(stopped=True)
        if not summary.preempted:
            summary.val_loss = self.evaluate()  # the whole validation set
            summary.val_metrics = dict(self.val_metrics)
        with self.phase("checkpoint"):  # waiting for the save in flight
            final_error = self.checkpointer.wait()
        if final_error:
            self.warn(final_error)
        if final_error or self.checkpointer.last_saved_step != self.step:
            self.save_checkpoint(blocking=True)
        summary.steps = self.step
        summary.train_loss = last_loss
        summary.skipped_steps = self.counters.skipped_steps
        summary.rollbacks = self.counters.rollbacks
        summary.checkpoint = str(self.checkpointer.root / layout.step_dir_name(self.step))
        summary.wall_s = time.perf_counter() - started
        summary.items = self.counters.items_seen - summary.start_items  # this run's alone
        if self.run_log.comm_counted:
            summary.comm_bytes, summary.comm_wait_s = self.strategy.comm.totals()
        self.run_log.close_progress()
        if not summary.preempted:
            self._after_training(summary)
        self._end(summary)

    def already_finished(self, summary: Summary, started: float) -> Summary:
        """The run folder holds a run that reached ``train.steps`` before: nothing to train,
        evaluate or save again (its records and checkpoint stand as they are). The task's
        after-training hook runs, as at the end of any run: a restart after the hook failed
        runs it again, as it did before this path existed."""
        self.log(
            f"the run in {self.cfg.run.dir} already finished at step {self.step} "
            f"(train.steps = {self.cfg.train.steps}): nothing to train; raise train.steps to "
            "train it further, or give another run.dir for a new run"
        )
        summary.finished_before = True
        summary.steps = self.step
        summary.checkpoint = str(self.checkpointer.root / layout.step_dir_name(self.step))
        self._after_training(summary)
        summary.wall_s = time.perf_counter() - started
        self._end(summary)  # the status 'completed'; no sinks were opened
        self.watchdog.set_phase("done")  # the last word, left by no phase
        return summary

    def _end(self, summary: Summary) -> None:
        """The loader closed, the run's summary recorded, every rank at the end together."""
        self.loader.close()
        self.run_log.finish(summary, self.step)
        self.publish_records()  # the final status and summary record
        with self.phase("barrier(end)"):
            barrier()

    def _after_training(self, summary: Summary) -> None:
        """The task's after-training hook, on rank 0 with the whole model (collective: every
        rank gives its part); its text goes into the summary."""
        if self.task.after_training is None:
            return
        with self.phase("after_training"):
            if (model := self.strategy.model_for_inference()) is not None:
                model.eval()
                text = self.task.after_training(model)
                summary.generated = text if self.is_main else ""

    def _first_step_done(self, seconds: float) -> None:
        """The time from the start of ``fit`` to the end of this process's first step: set-up
        of the loop, resume, and what the first step pays once (torch.compile compiles the
        blocks then)."""
        self.run_log.event("first_step", self.step, seconds=seconds, compile=self.cfg.train.compile)
        if self.cfg.train.compile:
            self.log(f"first step after {seconds:.1f} s (torch.compile compiled the blocks)")

    def evaluate(self, max_samples: int = 0) -> float | None:
        """Mean validation loss, and the task's metrics; every sample of the set (or of its
        first ``max_samples``) counted exactly once across ranks."""
        if self.task.val_data is None:
            return None
        with self.phase("evaluate"):
            batch_size, tick = self.cfg.eval.batch_size, self.watchdog.tick
            result = evaluate(
                self.task, self.strategy, self.runtime.device, batch_size, max_samples, tick
            )
        self.val_metrics = result.metrics
        self.run_log.evaluated(self.step, result.loss, result.items, result.metrics)
        return result.loss
