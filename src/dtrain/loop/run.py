"""dtrain in a loop of the user's own: :class:`Run`, what ``main(run)`` trains with.

The loop is the user's; every guarantee is the trainer's, built by the same wiring
(:func:`dtrain.train.job.wire_task`) and run by the same pieces -- the step's two halves
(:meth:`ForwardBackward.begin <dtrain.train.step.ForwardBackward.begin>`, ``finish``), the
trainer's update and what follows it (``Trainer.end_step``), its resume and its end::

    def main(run: dtrain.Run) -> None:
        model, optimizer = run.prepare(model, dataset)  # wrapped; the config's optimizer
        critic, critic_opt = run.wrap("critic", critic, optimizer=build)  # a further model
        run.register(ema=ema)                           # more state to checkpoint
        for batch in run.batches():                     # resumed; until train.steps or a stop
            for inputs, targets in batch:               # its micro-batches, gradient sync last
                run.backward(loss_fn(model(inputs), targets))  # per-item losses
            if run.step():                              # clip, update, agreement, metrics, save
                break                                   # every rank agreed to stop

``run.step()`` is True on the step after which every rank stops; ``main`` returning writes the
final checkpoint. Exact reductions: :mod:`dtrain.loop.evaluate`; further models (``run.wrap``,
``run.update``; ``examples/own_loop_gan.py``): :mod:`dtrain.loop.models`; leaving the loop early
on some ranks only: :mod:`dtrain.loop.stream_exit`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from dtrain.checkpoint.rng import seed_everything
from dtrain.checkpoint.rundir import write_config_of_record
from dtrain.config import Config, validate_own_loop
from dtrain.dist.runtime import Runtime
from dtrain.errors import UserError
from dtrain.fault.failpoints import failpoint
from dtrain.fault.preempt import PreemptionFlag
from dtrain.loop.batch import Batch, output_sum, own_task
from dtrain.loop.early_stop import stop_causes
from dtrain.loop.evaluate import EvalFn, ReduceOp, evaluate_in_loop, reduce_over_ranks
from dtrain.loop.models import (
    BuildOptimizer,
    WithModels,
    Wrapped,
    check_further,
    place_frozen,
    update_wrapped,
    wrap_trained,
    zero_gradients,
)
from dtrain.loop.stream_exit import check_left
from dtrain.loop.unwrapped import UnwrappedWatch
from dtrain.metrics.summary import Summary
from dtrain.parallel.base import Strategy
from dtrain.train.config_agreement import agree_on_config
from dtrain.train.job import PathLike, checked_job_config, join_job, wire_task
from dtrain.train.recovery_seam import RecoverySeam
from dtrain.train.step import backward_scaled
from dtrain.train.trainer import Trainer
from dtrain.train.trainer.loop import LoopState


class Run:
    """A training run in a loop of the user's own (see the module's docstring): set up from
    the job's config, one model and its optimizer (:meth:`prepare`), the rest of its state
    (:meth:`register`), the data stream (:meth:`batches`), the loss (:meth:`backward`) and the
    step (:meth:`step`)."""

    def __init__(
        self,
        cfg: Config,
        runtime: Runtime,
        recovery: RecoverySeam | None = None,
        before_resume: Callable[[Trainer], None] | None = None,
    ) -> None:
        validate_own_loop(cfg)
        self.config, self.runtime = cfg, runtime
        # fault.recovery = 'inplace': one generation's run, its trainer given the seam (.inplace)
        self._recovery, self._before_resume = recovery, before_resume
        self._trainer: Trainer | None = None
        self._registered: dict[str, Any] = {}
        self._wrapped: dict[str, Wrapped] = {}  # further models with optimizers (run.wrap)
        # Their strategies by name: every step's, fixed before the loop starts (as _wrapped).
        self._further: list[Strategy] = []
        self._frozen: dict[str, nn.Module] = {}  # further models without
        self._watch: UnwrappedWatch | None = None  # the process's first step: unwrapped models
        self._running = contextlib.ExitStack()  # Trainer.running(): watchdog, signals
        self._in_train = contextlib.ExitStack()  # the watchdog's phase "train"
        self._preempt: PreemptionFlag | None = None
        self._loop: LoopState | None = None
        self._batch: Batch | None = None  # the step in progress
        self._planned: int | None = None  # its global item count from the plan (next_batch)
        self._scale = torch.ones(())
        self._loss_sum: torch.Tensor | None = None
        self._stopped = False
        self._wish = ""  # run.stop()'s reason, until a step's agreement carries it
        self._left: int | None = None  # the step after which run.batches() was left early
        self._started_at = -1  # the step the loop started from in this process
        self.summary: Summary | None = None  # once the run has ended

    @classmethod
    def join(cls, cfg: Config) -> Run:
        """In a worker: join the job (process group, run folder, the config every rank
        holds), and seed every rank alike, so that the model ``main`` builds starts equal."""
        runtime = join_job(cfg)
        agree_on_config(cfg, runtime)
        seed_everything(cfg.run.seed)
        return cls(cfg, runtime)

    @classmethod
    def from_config(cls, config: Config | PathLike | None = None, *overrides: str) -> Run:
        """A run without ``dtrain train`` (a notebook, one process): a config file or ``Config``
        (None: the defaults) and ``--section.key=value`` overrides, checked as a worker checks
        it, then :meth:`join`. Drive it by :meth:`train`, or the loop then :meth:`finish`."""
        run = cls.join(checked_job_config(config, overrides))
        if run.is_main:
            write_config_of_record(run.config)  # RUN_DIR/config.toml, as a worker writes it
        return run

    # -- what the loop reads ---------------------------------------------------------------

    @property
    def trainer(self) -> Trainer:
        if self._trainer is None:
            raise UserError("call run.prepare(model, dataset) first: it sets the run up")
        return self._trainer

    @property
    def built(self) -> Trainer | None:  # the trainer, once prepare() built it
        return self._trainer

    @property
    def rank(self) -> int:
        return self.runtime.rank

    @property
    def world_size(self) -> int:
        return self.runtime.world_size

    @property
    def device(self) -> torch.device:
        return self.runtime.device

    @property
    def is_main(self) -> bool:
        return self.runtime.is_main

    @property
    def step_count(self) -> int:
        """Optimizer steps done, counted from the start of the run (resumed runs too)."""
        return self.trainer.step

    @property
    def scheduler(self) -> Any:
        """The learning-rate schedule, stepped by :meth:`step`."""
        return self.trainer.scheduler

    @property
    def item_name(self) -> str:
        return self._trainer.task.item_name if self._trainer is not None else "samples"

    # -- set-up ----------------------------------------------------------------------------

    def prepare(
        self, model: nn.Module, train_data: Any, **options: Any
    ) -> tuple[nn.Module, torch.optim.Optimizer]:
        """The model spread over the ranks as ``strategy.name`` says, and its optimizer
        (``optim.*``, or ``build_optimizer(named_parameters)``); ``train_data`` is the dataset
        :meth:`batches` streams. ``options``: the :class:`~dtrain.Task` fields an own loop
        uses (``collate_fn``, ``items_per_sample``, ``count_items``, ...). Returns the model
        to train through and the optimizer :meth:`step` steps."""
        if self._trainer is not None:
            raise UserError(
                "run.prepare() was called before: it sets up the main model and the data; "
                "give each further model to run.wrap(name, model, optimizer=...)"
            )
        self._trainer = wire_task(self.config, own_task(model, train_data, options), self.runtime)
        self._trainer.recovery = self._recovery
        contract = self._trainer.forward_backward.contract
        if contract is not None:  # its messages name what the own loop gave the losses to
            contract.source = "run.backward() got"
        strategy = self._trainer.strategy
        assert strategy.model is not None
        return strategy.model, self._trainer.optimizer

    def wrap(
        self, name: str, model: nn.Module, optimizer: BuildOptimizer | None = None
    ) -> tuple[nn.Module, torch.optim.Optimizer | None]:
        """A further model (a GAN's critic, a distillation's teacher), after :meth:`prepare`
        and before the loop starts. With ``optimizer`` (called once with the named parameters
        the strategy holds, as ``build_optimizer``): spread as ``strategy.name`` spreads the
        main model, its gradients synchronized, its model and optimizer state checkpointed and
        resumed with the run under ``name``; :meth:`update` steps it. Without: frozen, on the
        device and equal on every rank (rank 0's values), never saved. Returns the model to
        call and its optimizer (None when frozen)."""
        self._before_loop(f"run.wrap({name!r}, ...)")
        trainer = self.trainer
        known = {*self._modules(), *trainer.strategy.unwrapped.modules()}
        check_further(name, model, {*self._wrapped, *self._frozen}, known)
        if optimizer is None:
            frozen = place_frozen(model, self.device, trainer.strategy)
            self._frozen[name] = frozen
            return frozen, None
        wrapped = wrap_trained(
            self.config, self.runtime, name, model, optimizer, output_sum, trainer.strategy
        )
        self._wrapped[name] = wrapped
        self._further = [self._wrapped[name].strategy for name in sorted(self._wrapped)]
        assert wrapped.strategy.model is not None
        return wrapped.strategy.model, wrapped.optimizer

    def register(self, **state: Any) -> None:
        """More state to checkpoint and resume (a second model, an EMA, a scheduler of one's
        own: anything with ``state_dict`` and ``load_state_dict``), saved by rank 0: the same
        on every rank. Before the loop starts (its first batch resumes it)."""
        self._before_loop(f"run.register({', '.join(state)})")
        for name, obj in state.items():
            if not (hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict")):
                raise UserError(
                    f"run.register({name}=...): a {type(obj).__name__} has no state_dict() and "
                    "load_state_dict(): register what has (a module, an optimizer, a "
                    "scheduler, an object of your own with both)"
                )
            self._registered[name] = obj

    def _before_loop(self, call: str) -> None:
        if self._loop is not None or self.summary is not None:
            raise UserError(
                f"{call} after the loop started: register and wrap everything before the "
                "first run.batches() (its resume, and every save, holds what was given then)"
            )

    def _modules(self) -> list[nn.Module]:
        """Every module of the further models, wrapped or frozen."""
        models = [w.strategy.unwrapped for w in self._wrapped.values()]
        return [m for model in [*models, *self._frozen.values()] for m in model.modules()]

    # -- the loop --------------------------------------------------------------------------

    def batches(self) -> Iterator[Batch]:
        """Each step's batch of dtrain's global stream (exactly once, resumable), from where
        the run's checkpoint left it, until ``train.steps`` or a stop the ranks agreed on."""
        if self._loop is None and self.summary is None:
            self._start()
        trainer, steps = self.trainer, self.config.train.steps
        self._left = None  # consuming again (a loop may leave and come back on every rank)
        try:
            while self._loop is not None and not self._stopped and trainer.step < steps:
                step_batch, micro, count, self._planned = trainer.next_batch()
                failpoint("train.step", step=trainer.step + 1)
                self._batch = Batch(trainer, self._begin, self._further, step_batch, micro, count)
                yield self._batch
                if self._batch is not None:
                    raise UserError(
                        f"step {trainer.step + 1}: the loop took the next batch without "
                        "run.step(): call it once after each batch's backward"
                    )
        except GeneratorExit:  # the loop left (break, return) before the run's end
            if self._loop is not None and not self._stopped and trainer.step < steps:
                self._left = trainer.step  # checked where it next talks to the ranks
            raise

    def _start(self) -> None:
        """Resume (the registered state with the rest), then open the loop: in ``fit``'s
        order (:meth:`Trainer._fit`)."""
        trainer = self.trainer
        extra = {f"user/{name}": obj for name, obj in self._registered.items()}
        parts = {**trainer.state.parts, **extra}
        models = trainer.state.strategy
        if self._wrapped:  # their parts beside the main model's (dtrain.loop.models)
            models = WithModels(trainer.strategy, self._wrapped)
        trainer.state = dataclasses.replace(trainer.state, strategy=models, parts=parts)
        if self._before_resume is not None:
            self._before_resume(trainer)
        self._preempt = self._running.enter_context(trainer.running())
        started = time.perf_counter()
        with trainer.phase("resume"):
            point = trainer.resume()
        summary = Summary(start_step=trainer.step, start_items=trainer.counters.items_seen)
        if trainer.step >= self.config.train.steps:
            self.summary = trainer.already_finished(summary, started)
            self._running.close()
            return
        self._in_train.enter_context(trainer.phase("train"))
        self._loop = trainer.open_loop(point, summary, started)
        self._started_at = trainer.step

    def _begin(self, batch: Batch) -> None:
        """Before the step's first forward: its agreement opened, its loss scale known."""
        trainer = self.trainer
        assert self._preempt is not None
        stop = self._preempt.requested or bool(self._wish)  # a wish rides in the stop flag
        self._scale = trainer.forward_backward.begin(
            batch.items, stop, self._planned, trainer.regroup(), batch.micro[0], output_sum
        )
        self._loss_sum = None
        if trainer.step == self._started_at:  # the process's first step only: it costs a call
            # per module called
            known = [*trainer.strategy.unwrapped.modules(), *self._modules()]
            self._watch = UnwrappedWatch(known)

    def backward(self, losses: torch.Tensor) -> None:
        """Backward of this micro-batch's per-item losses (``reduction="none"``, checked as
        dtrain's loop checks ``Task.loss_fn``), scaled so that the step's gradient is that of
        the mean over every item of the global batch, whatever each rank holds."""
        batch = Batch.training(self._batch)
        contract = self.trainer.forward_backward.contract
        if contract is not None:
            contract.check(losses, batch.micro[batch.current][1])
        loss_sum = losses.sum()  # in the precision's autocast, as dtrain's loop sums it
        with contextlib.ExitStack() as outside:
            if torch.is_autocast_enabled(self.device.type):  # backward runs outside autocast
                outside.enter_context(torch.autocast(self.device.type, enabled=False))
            backward_scaled(loss_sum, self._scale)
        batch.done.add(batch.current)
        detached = loss_sum.detach()
        self._loss_sum = detached if self._loss_sum is None else self._loss_sum + detached

    def step(self) -> bool:
        """After the batch's backward: gradients synchronized, clipped (``train.grad_clip``),
        the optimizer and the schedule stepped, then what follows every step in dtrain's loop
        (NaN guard, metrics, evaluation, checkpoints). Returns whether every rank stops now."""
        (batch, loss_sum), loop = Batch.stepping(self._batch, self._loss_sum), self._loop
        assert loop is not None  # a batch is only taken while the loop is open
        trainer = self.trainer
        self._check_watch()
        if self._watch is not None:
            self._watch.close()
            self._watch = None
        with trainer.phase("forward_backward"):
            for strategy in self._further:  # what their backward started (discarded)
                strategy.sync_gradients()
            agreement = trainer.forward_backward.finish()
        for strategy in self._further:  # the step ends: a further model starts afresh
            zero_gradients(strategy)
        assert self._preempt is not None
        wished: list[str] = []
        if agreement.stop and trainer.step + 1 < self.config.train.steps:
            causes = stop_causes(self._preempt.signal_name, self._wish)
            if not causes.preempted:  # wishes only: the step ends as any step, then the run
                agreement.stop, wished = False, causes.reasons
        stopped = trainer.end_step(
            loop, batch.step_batch, loss_sum, agreement, trainer.logs_now(), self._preempt
        )
        self._batch, self._loss_sum = None, None
        if wished:
            loop.summary.stopped = "; ".join(wished)
            trainer.run_log.event("early_stop", trainer.step, reason=loop.summary.stopped)
            stopped = True
        self._stopped = stopped
        return stopped

    def stop(self, reason: str = "run.stop()") -> None:
        """This rank wishes every rank to stop (early stopping): they all stop after the same
        step -- this one if its first forward has not begun, else the next -- and the run ends
        completed, its final checkpoint saved, ``reason`` in its summary. No collective of its
        own: the wish rides in the step's agreement (:mod:`dtrain.loop.early_stop`)."""
        self._wish = self._wish or reason or "run.stop()"

    def evaluate(
        self,
        data: Any,
        fn: EvalFn,
        *,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        batch_size: int | None = None,
        max_samples: int = 0,
    ) -> dict[str, float]:
        """The mean of ``fn(inputs, targets)``'s per-item values (per-item losses, or a dict
        of them with a ``'loss'`` entry) over every item of ``data`` (its first
        ``max_samples``), each counted once across the ranks; without gradients, in eval mode,
        under the strategy's precision; logged as ``val_loss``, ``val_<name>``. Before the
        first step (it resumes the run) or between two, every rank (:mod:`dtrain.loop.evaluate`)."""
        if self._loop is None and self.summary is None:
            self._start()
        if self._loop is None or self._batch is not None:
            raise UserError(
                "run.evaluate() between two steps of the loop (after run.step()), or before "
                "the first, while the run has not ended"
            )
        self._talks()
        size = self.config.eval.batch_size if batch_size is None else batch_size
        return evaluate_in_loop(self.trainer, data, fn, collate_fn, size, max_samples)

    def reduce(self, value: Any, op: ReduceOp = "mean") -> Any:
        """``value`` (a number or a tensor) reduced over the data-parallel ranks: ``"sum"``,
        ``"mean"``, ``"max"`` or ``"min"`` (every rank calls it). The ranks of a
        tensor-parallel group share their batch, so hold the same numbers of it: they are one
        data-parallel rank, counted once."""
        self._talks()
        return reduce_over_ranks(self.trainer.strategy, value, op)

    def update(self, optimizer: torch.optim.Optimizer) -> float:
        """Within the step, after the backward of every micro-batch of a phase: the optimizer
        of a model given to :meth:`wrap` steps -- its gradients synchronized and rescaled for
        the global mean (the step's agreement completed now where it has not been), clipped
        (``train.grad_clip``), stepped when their norm is finite (a skip is an event; fp16's
        overflow halves the loss scale at the step's end) -- then every model's gradients are
        dropped; the next phase iterates the batch again. Returns the global gradient norm."""
        wrapped = next((w for w in self._wrapped.values() if w.optimizer is optimizer), None)
        if wrapped is None:
            raise UserError(
                "run.update() of an optimizer run.wrap() did not return: the main optimizer "
                "steps with run.step(), a further model's is the one run.wrap() returned"
            )
        batch, loss_sum = Batch.updating(self._batch, self._loss_sum)
        self._check_watch()
        norm = update_wrapped(self.trainer, wrapped, self._further, loss_sum)
        batch.done.clear()
        self._loss_sum = None  # the step's logged loss: that of the main optimizer's phase
        return norm

    def _check_watch(self) -> None:
        """On the process's first step: a module with trainable parameters that ran outside
        every model the run holds is named (its gradients were never synchronized)."""
        if self._watch is not None:
            self._watch.check(self.trainer.step + 1)

    def _talks(self) -> None:
        """Before talking to the ranks off the stream: left early, all left (``stream_exit``)."""
        left, self._left = self._left, None
        if left is not None:
            check_left(self.trainer.watchdog, left, self._batch is not None)

    def save(self) -> None:
        """A checkpoint of the run now, between two steps, beside those of
        ``checkpoint.every`` (collective: every rank calls it at the same step)."""
        if self._loop is None or self._batch is not None:
            raise UserError("run.save() between two steps of the loop: after run.step()")
        self._talks()
        if self.trainer.checkpointer.last_saved_step != self.trainer.step:
            self.trainer.save_checkpoint(blocking=not self.config.checkpoint.async_save)

    def log(self, **values: Any) -> None:
        """A record of the user's own in ``metrics.jsonl`` at this step (rank 0 writes it;
        reduce over the ranks first where a value differs among them)."""
        self.trainer.run_log.event("log", self.trainer.step, **values)

    # -- the end ---------------------------------------------------------------------------

    def train(self, main: Callable[[Run], object]) -> Summary:
        """``main(self)``, then the run's end (:meth:`finish`)."""
        try:
            main(self)
            return self.finish()
        except BaseException as exc:
            self.fail(exc)
            raise

    def finish(self) -> Summary:
        """The end of the run, as dtrain's loop ends: the final checkpoint, the summary, every
        rank together. Called when ``main`` returns."""
        if self.summary is not None:
            return self.summary
        if self._loop is None:
            self._start()
            if self.summary is not None:
                return self.summary
        loop = self._loop
        assert loop is not None
        trainer = self.trainer
        if not self._stopped and trainer.step < self.config.train.steps:
            self._left = trainer.step  # main returned before the run's end
        self._talks()
        trainer.finish(loop.summary, loop.last_loss, loop.started)
        self._in_train.close()
        trainer.watchdog.set_phase("done")  # the last word, left by no phase
        self._running.close()
        self.summary = loop.summary
        return loop.summary

    def fail(self, error: BaseException) -> None:
        """``error`` ended the loop: the watchdog's diagnosis of it raised in its place where
        it has one (a failed peer), as in dtrain's loop."""
        if self._watch is not None:
            self._watch.close()
        # Left by the error: the phase stays where it was raised, for the diagnosis to name.
        self._in_train.__exit__(type(error), error, error.__traceback__)
        self._running.__exit__(type(error), error, error.__traceback__)
