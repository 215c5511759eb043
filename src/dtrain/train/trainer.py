"""The training loop, and only the loop.

What happens, and where each concern plugs in::

    setup:  strategy.setup(task)                  # wrap the model (ddp, allreduce, fsdp, ...)
            build optimizer, LR schedule, loader   # loader = this rank's share of one stream
            resume(newest valid checkpoint)        # dict of state_dicts -> every component
    loop:   for step in range(start, steps):
              balance.step_started()               # per-rank phase timing (balance/)
              batch = next(loader)                 # micro-batches of (inputs, targets)
              balance.data_ready(batch)            # data wait ends
              forward_backward(batch, items, stop flag)      (dtrain.train.step, every strategy)
                  for each micro-batch: loss_fn(model(x), y).sum().backward(scale)
                  strategy.sync_gradients()        # grads = d(global mean loss), synced;
                                                   # the ranks' agreement on the step (global
                                                   # items, stop) rides in the last bucket
              start the logged step's loss sum and, once a timing window, its gather
                                                   # (both complete during the update)
              norm = strategy.clip_grad_norm()     # global norm: the same on every rank
              if norm is finite: optimizer.step()
              else: skip (NaN guard, dtrain.train.nan_guard); after N in a row roll back to the
                    last checkpoint and never deliver those batches again
              scheduler.step()
              strategy.after_optimizer_step(step)  # localsgd, diloco: sync every H steps
              balance.step_finished(step)          # once a window: gather the ranks'
                                                   # timings, name stragglers, new shares
              every log_every:         a train record to every sink (metrics.jsonl,
                                       progress line, TensorBoard); events as they happen
                                       (all through the RunLog, dtrain.metrics.run_log)
              if any rank was asked to stop: save, exit 0   # all after the same step
              every eval.every:        evaluate (each val sample exactly once)
              every checkpoint.every:  save (async: the loop waits for a snapshot only)
    end:    evaluate, final checkpoint, summary

The trainer never asks which strategy it runs; everything strategy-specific is behind
:class:`dtrain.parallel.base.Strategy` and its capabilities. A collective that fails because
a peer died or hung becomes a :class:`~dtrain.fault.peer_failure.PeerFailure` naming that peer.
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any

from dtrain.balance.balancer import LoadBalancer
from dtrain.checkpoint import layout
from dtrain.checkpoint import state as training_state
from dtrain.checkpoint import write as ckpt
from dtrain.checkpoint.resume import ResumePoint, resolve_resume
from dtrain.checkpoint.rng import rank_seed, seed_everything
from dtrain.comm.agreement import StepAgreement
from dtrain.compute.precision import LossScaler
from dtrain.config import Config
from dtrain.data.build import build_train_loader
from dtrain.data.loader import RankLoader, StepBatch, split_to_device
from dtrain.dist.runtime import Runtime, barrier
from dtrain.errors import UserError
from dtrain.fault.audit import AuditWriter
from dtrain.fault.failpoints import failpoint
from dtrain.fault.liveness import Speed
from dtrain.fault.preempt import PreemptionFlag
from dtrain.fault.watchdog import Watchdog
from dtrain.metrics import records
from dtrain.metrics.run_log import RunLog
from dtrain.metrics.summary import LossWindow, Summary
from dtrain.metrics.tensorboard import check_available as check_tensorboard
from dtrain.parallel import build_strategy
from dtrain.task import Task
from dtrain.train.evaluation import check_metrics, evaluate
from dtrain.train.loss_contract import LossContract
from dtrain.train.nan_guard import NanGuard
from dtrain.train.optim_choice import OptimizerKinds, build_run_optimizer, build_run_scheduler
from dtrain.train.recovery_seam import RecoverySeam
from dtrain.train.step import ForwardBackward


class Trainer:
    def __init__(self, cfg: Config, task: Task, runtime: Runtime) -> None:
        self.cfg = cfg
        self.task = task
        self.runtime = runtime
        self.run_dir = Path(cfg.run.dir)
        self.is_main = runtime.is_main
        if cfg.metrics.tensorboard:  # every rank, before the first collective
            check_tensorboard()
        self.strategy = build_strategy(cfg, runtime)
        self.strategy.setup(task)
        # What the run writes: status, records to rank 0's sinks, log lines (dtrain.metrics).
        self.run_log = RunLog(cfg, runtime, self.strategy, task.item_name)
        # The task's optimizer and schedule, or the config's (dtrain.train.optim_choice).
        self.optimizer = build_run_optimizer(task, self.strategy, cfg)
        self.scheduler = build_run_scheduler(task, self.optimizer, cfg)
        self.step_lr = float("nan")  # the learning rate the last step trained with
        self.loader: RankLoader = build_train_loader(
            task,
            cfg,
            self.strategy.data_parallel_rank,
            self.strategy.data_parallel_size,
            runtime.device,
        )
        # Per-rank phase timing, straggler reports and (balance.mode) per-rank batch shares.
        self.balance = LoadBalancer(
            cfg,
            runtime,
            self.loader,
            self.strategy.comm,
            self.optimizer,
            self.log,
            task.item_name,
        )
        # Counters that are part of the training state (see state_dict).
        self.step = 0
        self.items_seen = 0
        # fp16-mixed: the dynamic loss scale (dtrain.compute.precision), part of the training state.
        self.scaler: LossScaler | None = None
        if self.strategy.recipe.precision.scales_loss:
            self.scaler = LossScaler(
                cfg.train.loss_scale_init, cfg.train.loss_scale_growth_interval
            )
        # What a checkpoint holds, built once: save and load see these parts, not the trainer
        # (whose own part is its counters, see state_dict).
        parts: dict[str, Any] = {
            # First: it refuses another optimizer's or schedule's checkpoint before any part
            # of it is loaded.
            "kinds": OptimizerKinds(self.optimizer, self.scheduler),
            "scheduler": self.scheduler,
            "data": self.loader,
            "trainer": self,
            "balance": self.balance,
        }
        if self.scaler is not None:
            parts["loss_scaler"] = self.scaler
        self.state = training_state.TrainingState(
            strategy=self.strategy,
            optimizer=self.optimizer,
            parts=parts,
            runtime=runtime,
            config=cfg,
            # loss_scaler: from a run in another precision (the scale starts afresh).
            optional=frozenset({"loss_scaler"}),
        )
        self.watchdog = Watchdog(
            runtime.rank,
            runtime.world_size,
            heartbeat_s=cfg.fault.heartbeat_s,
            timeout_s=cfg.dist.timeout_s,
            run_dir=self.run_dir,  # RUN_DIR/liveness/rankN: this rank's liveness record
            stats=self._beat_stats,
        )
        self.checkpointer = ckpt.Checkpointer(
            self.run_dir / "checkpoints",
            rank=runtime.rank,
            world_size=runtime.world_size,
            keep_last=cfg.checkpoint.keep_last,
            keep_every=cfg.checkpoint.keep_every,
            timeout=runtime.timeout,
            log=self.log,
            on_progress=self.watchdog.tick,
        )
        # Skips a step with a non-finite gradient, rolls back after N in a row (its
        # counters are part of the training state, see state_dict).
        self.nan_guard = NanGuard(
            cfg,
            runtime,
            self.strategy,
            self.loader,
            self.state,
            self.checkpointer,
            self.watchdog,
            self.scaler,
            self.run_log,
        )
        self.audit: AuditWriter | None = None
        check_metrics(task.metrics)  # before the first step, not at the first evaluation
        self.val_metrics: dict[str, float] = {}  # of the latest evaluation
        per_sample = task.items_per_sample
        if per_sample is not None and (isinstance(per_sample, bool) or per_sample < 1):
            raise UserError(f"Task.items_per_sample = {per_sample!r}: expected a positive integer")
        # Forward and backward over a step's micro-batches, and the ranks' agreement on it.
        self.forward_backward = ForwardBackward(
            self.strategy, runtime.device, self.scaler, LossContract(task.count_items)
        )
        # fault.recovery = 'inplace': set by the in-place worker, which runs this trainer for one
        # membership generation (train/recovery_seam.py says where the loop calls it).
        self.recovery: RecoverySeam | None = None

    # -- logging -------------------------------------------------------------------------

    # The balancer, the checkpointer and resume log through these (the run log's lines).

    def log(self, text: str) -> None:
        self.run_log.log(text)

    def warn(self, text: str) -> None:
        """A warning from any rank (not only rank 0), tagged with the rank."""
        self.run_log.warn(text)

    # -- training state ------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "items_seen": self.items_seen,
            "skipped_steps": self.nan_guard.skipped_steps,
            "rollbacks": self.nan_guard.rollbacks,
            # The item count the next step's loss scale assumes (dtrain.train.step).
            "expected_items": self.forward_backward.expected,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = int(state["step"])
        self.items_seen = int(state["items_seen"])
        self.nan_guard.skipped_steps = int(state.get("skipped_steps", 0))
        self.nan_guard.rollbacks = int(state.get("rollbacks", 0))
        expected = state.get("expected_items")
        self.forward_backward.expected = None if expected is None else int(expected)

    def save_checkpoint(self, *, blocking: bool) -> None:
        self.watchdog.set_phase("checkpoint")
        training_state.save(self.state, self.checkpointer, self.step, blocking=blocking)
        blocked = self.checkpointer.blocking_seconds[-1]
        self.run_log.event("checkpoint", self.step, blocked_s=blocked, async_save=not blocking)

    def resume(self) -> ResumePoint | None:
        """Load the checkpoint ``run.resume`` asks for, if any; then every RNG either holds
        the saved state or, on a fresh start or at a new world size, a distinct, reproducible
        stream per rank."""
        if self.recovery is not None and self.recovery.heal(self):
            seed_everything(rank_seed(self.cfg.run.seed, self.runtime.rank) + self.step)
            return None  # healed from a peer's memory
        point = resolve_resume(
            self.cfg, self.checkpointer, self.runtime, self.log, watchdog=self.watchdog
        )
        if point is None or not training_state.load(self.state, point):
            seed_everything(rank_seed(self.cfg.run.seed, self.runtime.rank) + self.step)
        if point is not None and point.strategy not in (None, self.strategy.name):
            self.log(
                f"dtrain: {point.path.name} was saved by strategy {point.strategy!r}; "
                f"{self.strategy.name} read its model and optimizer state"
            )
        return point

    # -- the loop ------------------------------------------------------------------------

    def fit(self) -> Summary:
        preempt = PreemptionFlag(self.cfg.fault.preempt_signals)
        self.watchdog.start()
        try:
            return self._fit(preempt)
        except BaseException as exc:
            if self.recovery is not None and self.recovery.recoverable(exc):
                raise  # the survivors go on (in-place recovery): no diagnosis to wait for
            error = self.watchdog.on_error(exc)
            if error is exc:
                raise
            raise error from exc
        finally:
            self.watchdog.stop()
            preempt.restore()
            if self.audit is not None:
                self.audit.close()

    def _fit(self, preempt: PreemptionFlag) -> Summary:
        started = time.perf_counter()
        cfg = self.cfg
        self.watchdog.set_phase("resume")
        point = self.resume()
        summary = Summary(start_step=self.step)
        if self.step >= cfg.train.steps:
            return self._already_finished(summary, started)
        membership = self.recovery.event() if self.recovery is not None else None
        resumed_from = point.path.name if point is not None else None
        in_place = self.recovery is not None
        self.run_log.open(self.step, self.balance.hosts, resumed_from, membership, in_place)
        if cfg.fault.audit_sample_ids:
            self.audit = AuditWriter.open(self.run_dir, self.runtime.rank)
        window = LossWindow(self.runtime.device)
        last_loss = float("nan")
        self.strategy.unwrapped.train()
        while self.step < cfg.train.steps:
            if self.recovery is not None:
                self.recovery.step_starting(self)
            self.watchdog.set_phase("data", self.step + 1)
            self.balance.step_started()
            batch = next(self.loader)
            parts = [split_to_device(self.task, m, self.runtime.device) for m in batch.micro]
            micro = [part for part, _ in parts]
            count = sum(items for _, items in parts)
            self.balance.data_ready(batch, count)
            planned = self._planned_items(batch, count)
            failpoint("train.before_collective", step=self.step + 1)
            logs = (self.step + 1) % cfg.train.log_every == 0 or self.step + 1 == cfg.train.steps
            agreement, norm, overflowed = self._train_step(
                micro, count, preempt, planned, window, logs
            )
            self.step += 1
            self.items_seen += agreement.items  # the step is committed: counters with it
            if self.step == summary.start_step + 1:
                self._first_step_done(time.perf_counter() - started)
            # Strategies that synchronize every few steps (localsgd, diloco) do it here,
            # before a rollback, a checkpoint or an evaluation of this step sees the model.
            self.watchdog.set_phase("after_optimizer_step")
            self.strategy.after_optimizer_step(self.step)
            # Once a timing window: gather the ranks' timings; new shares from the next
            # step on (the same on every rank).
            self.watchdog.set_phase("balance")
            self.run_log.write_records(self.balance.step_finished(self.step))
            if self.audit is not None:
                self.audit.record(
                    self.step,
                    batch.plan.start,
                    batch.plan.end,
                    batch.ids,
                    rollbacks=self.nan_guard.rollbacks,
                    applied=math.isfinite(norm),
                )
            self.nan_guard.after_step(self.step, batch, norm, overflowed)
            error = self.checkpointer.poll()
            if error:
                self.warn(error)
                self.run_log.event("checkpoint_failed", self.step, error=error)
            if logs:
                self.watchdog.set_phase("all_reduce(metrics)")
                last_loss, rate, steps, elapsed = window.flush()
                self.run_log.train(
                    self.step,
                    last_loss,
                    norm,
                    rate,
                    steps,
                    elapsed,
                    lr=self.step_lr,
                    epoch=self.loader.epoch(),
                    items_seen=self.items_seen,
                    skipped_steps=self.nan_guard.skipped_steps,
                )
            if agreement.stop and self.step < cfg.train.steps:
                # Every rank learnt it in the same step's agreement: all stop after this
                # step's update, and the final save follows.
                summary.preempted = preempt.signal_name or "a peer's signal"
                self.run_log.event("preempted", self.step, signal=summary.preempted)
                break
            if cfg.eval.every and self.step % cfg.eval.every == 0 and self.step < cfg.train.steps:
                self.evaluate(cfg.eval.max_samples)
            if (
                cfg.checkpoint.every
                and self.step % cfg.checkpoint.every == 0
                and self.step < cfg.train.steps
            ):
                self.save_checkpoint(blocking=not cfg.checkpoint.async_save)
            if agreement.regroup and self.recovery is not None and self.step < cfg.train.steps:
                # A worker waits to join (fault.recovery = 'inplace'); every rank learnt it in
                # this step's agreement: all leave after it, its evaluation and save done.
                self.recovery.regroup(self.step)
        if not summary.preempted:
            summary.val_loss = self.evaluate()  # the whole validation set
            summary.val_metrics = dict(self.val_metrics)
        self.watchdog.set_phase("checkpoint")  # waiting for the save in flight
        final_error = self.checkpointer.wait()
        if final_error:
            self.warn(final_error)
        if final_error or self.checkpointer.last_saved_step != self.step:
            self.save_checkpoint(blocking=True)
        summary.steps = self.step
        summary.train_loss = last_loss
        summary.skipped_steps = self.nan_guard.skipped_steps
        summary.rollbacks = self.nan_guard.rollbacks
        summary.checkpoint = str(self.run_dir / "checkpoints" / layout.step_dir_name(self.step))
        summary.wall_s = time.perf_counter() - started
        summary.items = self.items_seen
        if self.run_log.comm_counted:
            summary.comm_bytes, summary.comm_wait_s = self.strategy.comm.totals()
        self.run_log.close_progress()
        if not summary.preempted:
            self._after_training(summary)
        self.loader.close()
        self.run_log.finish(summary, self.step)
        self.watchdog.set_phase("barrier(end)")
        barrier()
        self.watchdog.set_phase("done")
        return summary

    def _already_finished(self, summary: Summary, started: float) -> Summary:
        """The run folder holds a run that reached ``train.steps`` before: nothing to train,
        evaluate or save again (its records and checkpoint stand as they are). The task's
        after-training hook runs, as at the end of any run: a restart after the hook failed
        runs it again, as it did before this path existed."""
        self.log(
            f"the run in {self.run_dir} already finished at step {self.step} "
            f"(train.steps = {self.cfg.train.steps}): nothing to train; raise train.steps to "
            "train it further, or give another run.dir for a new run"
        )
        summary.finished_before = True
        summary.steps = self.step
        summary.checkpoint = str(self.run_dir / "checkpoints" / layout.step_dir_name(self.step))
        self._after_training(summary)
        summary.wall_s = time.perf_counter() - started
        self.loader.close()
        self.run_log.finish(summary, self.step)  # the status 'completed'; no sinks were opened
        self.watchdog.set_phase("barrier(end)")
        barrier()
        self.watchdog.set_phase("done")
        return summary

    def _after_training(self, summary: Summary) -> None:
        """The task's after-training hook, on rank 0 with the whole model (collective: every
        rank gives its part); its text goes into the summary."""
        if self.task.after_training is None:
            return
        self.watchdog.set_phase("after_training")
        model = self.strategy.model_for_inference()
        if model is not None:
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

    def _planned_items(self, batch: StepBatch, count: int) -> int | None:
        """The step's global item count from its plan, where the task declares
        ``items_per_sample`` (this rank's ``count`` checked against it); else None."""
        per_sample = self.task.items_per_sample
        if per_sample is None:
            return None
        return batch.planned_items(per_sample, count, self.step + 1)

    def _train_step(
        self,
        micro: list[Any],
        count: int,
        preempt: PreemptionFlag,
        planned: int | None,
        window: LossWindow,
        logs: bool,
    ) -> tuple[StepAgreement, float, bool]:
        """Forward, backward, clip and (when the gradient is finite) update; the step's loss
        goes into ``window``, whose sum over the ranks starts here on a step that logs.
        Returns what the ranks agreed on about the step, the global gradient norm, and whether
        the gradient overflowed because of fp16's loss scale (skipped, the scale halved)."""
        failpoint("train.step", step=self.step + 1)
        self.watchdog.set_phase("forward_backward")
        regroup = self.recovery is not None and self.recovery.joiner_waiting()
        loss_sum, agreement = self.forward_backward(
            micro, self.task.loss_fn, count, preempt.requested, planned, regroup
        )
        # The gradient sync has just brought the ranks together: start the step's small
        # collectives now, to complete during the optimizer step.
        window.add(loss_sum, agreement.items)
        if logs:
            window.start_sum(self.strategy)
        self.balance.backward_done(self.step + 1)
        self.watchdog.set_phase("clip_grad_norm")
        norm = float(self.strategy.clip_grad_norm(self.cfg.train.grad_clip))
        # The norm is global (gradients are synchronized, or the norm is all-reduced), so
        # every rank takes the same branch here without another collective.
        if math.isfinite(norm):
            self.watchdog.set_phase("optimizer")
            self.optimizer.step()
        # What the logged lr is (docs/metrics.md): this step's, before the schedule moves on.
        self.step_lr = float(self.optimizer.param_groups[0]["lr"])
        overflowed = self.nan_guard.loss_scale_overflowed(norm, loss_sum)
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return agreement, norm, overflowed

    def _beat_stats(self) -> Speed:
        """This rank's speed for its liveness record; called on the watchdog's thread (the
        timer replaces its ``last`` dict whole, so reading it there is safe)."""
        last = self.balance.timer.last
        return records.beat_stats(last, self.task.item_name, self.runtime.device)

    def evaluate(self, max_samples: int = 0) -> float | None:
        """Mean validation loss, and the task's metrics; every sample of the set (or of its
        first ``max_samples``) counted exactly once across ranks."""
        if self.task.val_data is None:
            return None
        self.watchdog.set_phase("evaluate")
        batch_size, tick = self.cfg.eval.batch_size, self.watchdog.tick
        result = evaluate(
            self.task, self.strategy, self.runtime.device, batch_size, max_samples, tick
        )
        self.val_metrics = result.metrics
        self.run_log.evaluated(self.step, result.loss, result.items, result.metrics)
        return result.loss
