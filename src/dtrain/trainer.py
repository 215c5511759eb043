"""The training loop, and only the loop.

What happens, and where each concern plugs in::

    setup:  strategy.setup(task)                  # wrap the model (ddp, allreduce, fsdp, ...)
            build optimizer, LR schedule, loader   # loader = this rank's share of one stream
            resume(newest valid checkpoint)        # dict of state_dicts -> every component
    loop:   for step in range(start, steps):
              balance.step_started()               # per-rank phase timing (balance/)
              batch = next(loader)                 # micro-batches of (inputs, targets)
              balance.data_ready(step, batch)      # data wait ends; the slowdown aid arms
              forward_backward(batch, items, stop flag)      (dtrain.step, every strategy)
                  for each micro-batch: loss_fn(model(x), y).sum().backward(scale)
                  strategy.sync_gradients()        # grads = d(global mean loss), synced;
                                                   # the ranks' agreement on the step (global
                                                   # items, stop) rides in the last bucket
              start the logged step's loss sum and, once a timing window, its gather
                                                   # (both complete during the update)
              norm = strategy.clip_grad_norm()     # global norm: the same on every rank
              if norm is finite: optimizer.step()
              else: skip (NaN guard); after N in a row roll back to the last checkpoint
                    and never deliver those batches again
              scheduler.step()
              strategy.after_optimizer_step(step)  # localsgd, diloco: sync every H steps
              balance.step_finished(step)          # once a window: gather the ranks'
                                                   # timings, name stragglers, new shares
              every log_every:         a train record to every sink (metrics.jsonl,
                                       progress line, TensorBoard); events as they happen
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

import torch

from dtrain.balance.balancer import LoadBalancer, Record
from dtrain.checkpoint import layout
from dtrain.checkpoint import state as training_state
from dtrain.checkpoint import write as ckpt
from dtrain.checkpoint.resume import ResumePoint, resolve_resume, rollback_point
from dtrain.checkpoint.rng import rank_seed, seed_everything
from dtrain.comm.agreement import StepAgreement
from dtrain.config import Config
from dtrain.data.build import build_train_loader
from dtrain.data.loader import RankLoader, StepBatch, split_to_device
from dtrain.errors import UserError
from dtrain.evaluation import check_metrics, evaluate
from dtrain.fault import inplace
from dtrain.fault.audit import AuditWriter
from dtrain.fault.failpoints import failpoint
from dtrain.fault.liveness import Speed
from dtrain.fault.preempt import PreemptionFlag
from dtrain.fault.status import RunStatus, write_status
from dtrain.fault.watchdog import Watchdog
from dtrain.loss_contract import LossContract
from dtrain.metrics import records
from dtrain.metrics.sinks import Progress, Sinks, open_sinks
from dtrain.metrics.summary import LossWindow, Summary
from dtrain.metrics.tensorboard import check_available as check_tensorboard
from dtrain.optim_choice import OptimizerKinds, build_run_optimizer, build_run_scheduler
from dtrain.parallel import build_strategy
from dtrain.parallel.base import ShardedState
from dtrain.precision import LossScaler
from dtrain.runtime import Runtime, barrier
from dtrain.step import ForwardBackward
from dtrain.task import Task


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
        # The task's optimizer and schedule, or the config's (dtrain.optim_choice).
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
            self.strategy.unwrapped,
            self.log,
            task.item_name,
        )
        # Counters that are part of the training state (see state_dict).
        self.step = 0
        self.items_seen = 0
        self.skipped_steps = 0
        self.rollbacks = 0
        self.nan_streak: list[tuple[int, int]] = []  # stream ranges of consecutive bad steps
        # fp16-mixed: the dynamic loss scale (dtrain.precision), part of the training state.
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
            # balance: checkpoints from before load balancing; loss_scaler: from a run in
            # another precision (the scale starts afresh); kinds: from before they were kept.
            optional=frozenset({"balance", "loss_scaler", "kinds"}),
        )
        self.progress: Progress | None = None
        self.metrics: Sinks | None = None  # rank 0's: metrics.jsonl, progress, TensorBoard
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
        # This rank's communication totals at the last metrics line; set-up's (the broadcast
        # of rank 0's parameters) belongs to no step.
        self._comm_mark = self.strategy.comm.totals()
        # This rank's parameter bytes, for the start and train records (sizes do not change).
        self.param_bytes = self.strategy.parameter_bytes()
        # fault.recovery = 'inplace': set by dtrain.fault.inplace, which runs this trainer for
        # one membership generation (heals it at resume, keeps each step's start).
        self.recovery: inplace.Recovery | None = None

    # -- logging -------------------------------------------------------------------------

    def log(self, text: str) -> None:
        if self.progress is not None:
            self.progress.message(text)
        elif self.is_main:
            print(text, flush=True)

    def warn(self, text: str) -> None:
        """A warning from any rank (not only rank 0), tagged with the rank."""
        if self.is_main:
            self.log(f"warning: {text}")
        else:
            print(f"[rank {self.runtime.rank}] warning: {text}", flush=True)

    # -- training state ------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "items_seen": self.items_seen,
            "skipped_steps": self.skipped_steps,
            "rollbacks": self.rollbacks,
            # The item count the next step's loss scale assumes (dtrain.step).
            "expected_items": self.forward_backward.expected,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = int(state["step"])
        self.items_seen = int(state["items_seen"])
        self.skipped_steps = int(state.get("skipped_steps", 0))
        self.rollbacks = int(state.get("rollbacks", 0))
        expected = state.get("expected_items")
        self.forward_backward.expected = None if expected is None else int(expected)

    def save_checkpoint(self, *, blocking: bool) -> None:
        self.watchdog.set_phase("checkpoint")
        training_state.save(self.state, self.checkpointer, self.step, blocking=blocking)
        blocked = self.checkpointer.blocking_seconds[-1]
        self._event("checkpoint", blocked_s=blocked, async_save=not blocking)

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
        return point

    # -- the loop ------------------------------------------------------------------------

    def fit(self) -> Summary:
        preempt = PreemptionFlag(self.cfg.fault.preempt_signals)
        self.watchdog.start()
        try:
            return self._fit(preempt)
        except BaseException as exc:
            if self.recovery is not None and self.recovery.recoverable(exc):
                raise  # the survivors go on (dtrain.fault.inplace): no diagnosis to wait for
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
        attempt = records.group_restart_attempt(self.runtime)  # a collective: every rank
        if self.is_main:
            write_status(self.run_dir, RunStatus("running", self.step))
            self.progress = Progress(cfg.train.steps, self.step, self.task.item_name, True)
            self.metrics = open_sinks(
                self.run_dir, self.progress, tensorboard=cfg.metrics.tensorboard
            )
            hosts, item_name = self.balance.hosts, self.task.item_name
            self.metrics.write(
                records.start_record(
                    cfg,
                    self.runtime,
                    self.strategy,
                    item_name,
                    hosts,
                    self.step,
                    self.param_bytes,
                    attempt,
                )
            )
            if attempt and self.recovery is None:  # in place: a membership event instead
                self._event("restart", attempt=attempt)
            if point is not None:
                self._event("resumed", checkpoint=point.path.name)
            membership = self.recovery.event() if self.recovery is not None else None
            if membership is not None:
                self._event("membership", **membership)
            where = f"resumed from {point.path.name}" if point else "from scratch"
            if membership is not None:
                where = f"healed from member {membership['healed_from']}'s memory"
            self.log(
                f"dtrain: training {self.strategy.name} on {self.runtime.world_size} "
                f"rank(s), {self.runtime.device.type}, {where}; run folder {self.run_dir}"
            )
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
            self.balance.data_ready(self.step + 1, batch, count)
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
            self._write_records(self.balance.step_finished(self.step))
            if self.audit is not None:
                self.audit.record(
                    self.step,
                    batch.plan.start,
                    batch.plan.end,
                    batch.ids,
                    rollbacks=self.rollbacks,
                    applied=math.isfinite(norm),
                )
            if overflowed:
                assert self.scaler is not None
                self._event("overflow", loss_scale=self.scaler.scale)
            elif not math.isfinite(norm):
                self._on_non_finite(batch)
            error = self.checkpointer.poll()
            if error:
                self.warn(error)
                self._event("checkpoint_failed", error=error)
            if logs:
                self.watchdog.set_phase("all_reduce(metrics)")
                last_loss, rate, steps, elapsed = window.flush()
                self._log_train(last_loss, norm, rate, steps, elapsed)
            if agreement.stop and self.step < cfg.train.steps:
                # Every rank learnt it in the same step's agreement: all stop after this
                # step's update, and the final save follows.
                summary.preempted = preempt.signal_name or "a peer's signal"
                self._event("preempted", signal=summary.preempted)
                break
            if cfg.eval.every and self.step % cfg.eval.every == 0 and self.step < cfg.train.steps:
                self.evaluate(cfg.eval.max_samples)
            if (
                cfg.checkpoint.every
                and self.step % cfg.checkpoint.every == 0
                and self.step < cfg.train.steps
            ):
                self.save_checkpoint(blocking=not cfg.checkpoint.async_save)
            if agreement.regroup and self.step < cfg.train.steps:
                # A worker waits to join (fault.recovery = 'inplace'); every rank learnt it in
                # this step's agreement: all leave after it, its evaluation and save done.
                raise inplace.Regroup(f"after step {self.step}")
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
        summary.skipped_steps = self.skipped_steps
        summary.rollbacks = self.rollbacks
        summary.checkpoint = str(self.run_dir / "checkpoints" / layout.step_dir_name(self.step))
        summary.wall_s = time.perf_counter() - started
        summary.items = self.items_seen
        if not isinstance(self.strategy, ShardedState):
            summary.comm_bytes, summary.comm_wait_s = self.strategy.comm.totals()
        if self.progress is not None:
            self.progress.close()
        if not summary.preempted:
            self._after_training(summary)
        self.loader.close()
        self._finish_records(summary)
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
        if self.is_main:
            write_status(self.run_dir, RunStatus("completed", self.step))
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
        self._event("first_step", seconds=seconds, compile=self.cfg.train.compile)
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
            self.nan_streak.clear()
        # What the logged lr is (docs/metrics.md): this step's, before the schedule moves on.
        self.step_lr = float(self.optimizer.param_groups[0]["lr"])
        overflowed = False
        if self.scaler is not None:
            overflowed = not math.isfinite(norm) and self._scaler_overflow(loss_sum)
            self.scaler.update(overflowed)
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return agreement, norm, overflowed

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

    def _on_non_finite(self, batch: StepBatch) -> None:
        """NaN guard: the step was skipped on every rank; roll back after N in a row."""
        self.skipped_steps += 1
        self.nan_streak.append((batch.plan.start, batch.plan.end))
        self._event("step_skipped", in_a_row=len(self.nan_streak))
        self.warn(f"step {self.step}: non-finite loss or gradient; update skipped on every rank")
        limit = self.cfg.fault.nan_rollback_after
        if limit and len(self.nan_streak) >= limit:
            self._rollback()

    def _rollback(self) -> None:
        bad = list(self.nan_streak)
        self.nan_streak.clear()
        first_bad_step = self.step - len(bad) + 1
        error = self.checkpointer.wait()
        if error:
            self.warn(error)
        self.watchdog.set_phase("rollback")
        point = rollback_point(
            self.cfg,
            self.checkpointer,
            self.runtime,
            self.log,
            first_bad_step,
            self.step,
            self.watchdog,
        )
        # Counters of what happened stay cumulative; the skip list keeps earlier skips too.
        rollbacks, skipped = self.rollbacks + 1, self.skipped_steps
        earlier_skips = dict(self.loader.skipped)
        training_state.load(self.state, point)
        self.rollbacks, self.skipped_steps = rollbacks, skipped
        for start, end in [*earlier_skips.items(), *bad]:
            self.loader.skip(start, end)
        self._event("rollback", from_step=first_bad_step + len(bad) - 1, checkpoint=point.path.name)
        self.log(
            f"rolled back to {point.path.name} after {len(bad)} non-finite steps; the "
            f"{sum(e - s for s, e in bad)} samples of those steps will not be delivered again"
        )

    def _finish_records(self, summary: Summary) -> None:
        if not self.is_main:
            return
        state = "preempted" if summary.preempted else "completed"
        write_status(self.run_dir, RunStatus(state, self.step, summary.preempted))
        if self.metrics is not None:
            self.metrics.write(records.summary_record(summary, state, self.step))
            self.metrics.close()

    def _write_records(self, records: list[Record]) -> None:
        if self.metrics is not None:
            for record in records:
                self.metrics.write(record)

    def _event(self, name: str, **fields: Any) -> None:
        """An event record (docs/metrics.md) at the current step; rank 0 writes it."""
        if self.metrics is not None:
            self.metrics.write(records.event(name, self.step, **fields))

    def _beat_stats(self) -> Speed:
        """This rank's speed for its liveness record; called on the watchdog's thread (the
        timer replaces its ``last`` dict whole, so reading it there is safe)."""
        last = self.balance.timer.last
        return records.beat_stats(last, self.task.item_name, self.runtime.device)

    def _log_train(
        self, loss: float, grad_norm: float, rate: float, steps: int, elapsed: float
    ) -> None:
        # This rank's communication since the last line (every rank counts its own; rank 0's
        # is logged: data-parallel ranks send alike).
        total_sent, total_waited = self.strategy.comm.totals()
        sent, waited = total_sent - self._comm_mark[0], total_waited - self._comm_mark[1]
        self._comm_mark = (total_sent, total_waited)
        if not self.is_main:
            return
        window = records.TrainWindow(loss, grad_norm, rate, steps, elapsed, sent, waited)
        record = records.train_record(
            self.step,
            window,
            lr=self.step_lr,
            item_name=self.task.item_name,
            global_batch_size=self.cfg.data.global_batch_size,
            epoch=self.loader.epoch(),
            items_seen=self.items_seen,
            skipped_steps=self.skipped_steps,
            param_bytes=self.param_bytes,
            counted=not isinstance(self.strategy, ShardedState),
        )
        assert self.metrics is not None
        self.metrics.write(record)  # the progress line is one of the sinks

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
        if self.is_main:
            assert self.metrics is not None
            self.metrics.write(
                records.eval_record(self.step, result.loss, result.items, result.metrics)
            )
            extra = "".join(f", {name} {value:.4f}" for name, value in result.metrics.items())
            self.log(
                f"step {self.step}: val_loss {result.loss:.4f} over {result.items} "
                f"{self.task.item_name}{extra}"
            )
        return result.loss
