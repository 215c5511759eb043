"""One training step's forward and backward, the same for every strategy, and what the ranks
agree on about it.

Each rank's loss sum is scaled by ``data_parallel_size / G`` (G the step's global item count),
so the averaging sync yields the gradient of the global mean for any split (docs/architecture.md,
"Exact math across ranks"). Asking for G before the forward would cost every step a collective
of its own, so the scale assumes the step before's count (or the plan's, with
``items_per_sample``) and the :class:`StepAgreement` rides in the last bucket's all-reduce where
the hook can carry it (ddp and allreduce with ``comm.compression = 'none'``), else in one small
all-reduce after backward. A process's first step, with no count to assume, agrees before the
forward instead.

::

    count this rank's items; agreement = (items, stop flag)
    scale = dp_size / expected                       # expected: last step's G, or the plan's
    for each micro-batch:                            # no gradient sync but on the last one
        loss = loss_fn(model(inputs), targets).sum(); loss.backward(scale)
    strategy.sync_gradients()                        # the agreement rides along, or:
    all-reduce(agreement) unless it rode             # one small collective of its own
    gradients *= expected / G  where G != expected   # the gradient of the global mean

Under ``train.precision`` the forward and the loss run in the strategy's autocast context
(:mod:`dtrain.compute.precision`); under fp16-mixed the scale is also multiplied by the loss
scaler's power of two, and the rescale divides it out again (exactly) before clipping.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

import torch

from dtrain.comm.agreement import StepAgreement
from dtrain.compute.model_call import call_model
from dtrain.compute.precision import LossScaler
from dtrain.parallel.base import (
    BackwardSyncControl,
    CommHookControl,
    LossFn,
    OwnStep,
    Strategy,
)
from dtrain.parallel.grad_norm import local_part
from dtrain.train.loss_contract import LossContract


class LossScale:
    """The loss scale (``data_parallel_size / items``) as a float32 tensor on the training
    device; the last one again while the value stays, as on every step of fixed-length data
    (a new tensor from a Python float is a host-to-device copy on a GPU)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._last: tuple[float, torch.Tensor] | None = None

    def __call__(self, value: float) -> torch.Tensor:
        if self._last is None or self._last[0] != value:
            self._last = (value, torch.tensor(value, dtype=torch.float32, device=self.device))
        return self._last[1]


def run_micro_batches(
    strategy: Strategy,
    micro_batches: Sequence[tuple[Any, Any]],
    loss_fn: LossFn,
    scale: torch.Tensor,
) -> torch.Tensor:
    """Forward and backward over the step's micro-batches, one after the other, through the
    strategy's model, the forward and the loss under the strategy's precision; returns the
    summed loss (detached). A strategy with :class:`BackwardSyncControl` syncs gradients on the
    last micro-batch only."""
    model = strategy.model
    assert model is not None
    precision = strategy.recipe.precision
    total: torch.Tensor | None = None
    last = len(micro_batches) - 1
    for index, (inputs, targets) in enumerate(micro_batches):
        ctx: contextlib.AbstractContextManager[None] = contextlib.nullcontext()
        if index < last and isinstance(strategy, BackwardSyncControl):
            ctx = strategy.no_backward_sync()
        with ctx:
            with precision.autocast():  # the forward and the loss; backward runs outside
                loss_sum = loss_fn(call_model(model, inputs), targets).sum()
            backward_scaled(loss_sum, scale)
        total = loss_sum.detach() if total is None else total + loss_sum.detach()
    assert total is not None, "a step has at least one micro-batch"
    return total


def backward_scaled(loss_sum: torch.Tensor, scale: torch.Tensor) -> None:
    """The gradient of ``loss_sum * scale``, bit for bit (the product's backward would pass on
    1.0 x scale), without the product and its backward node."""
    loss_sum.backward(scale if scale.dtype == loss_sum.dtype else scale.to(loss_sum.dtype))


class ForwardBackward:
    """The trainer's forward and backward of one step over any strategy, with the ranks'
    agreement on the step (see the module's docstring). ``expected`` (the item count the next
    step's scale assumes) is part of the trainer's state: a resumed run scales its first step
    as the uninterrupted run did."""

    def __init__(
        self,
        strategy: Strategy,
        device: torch.device,
        scaler: LossScaler | None = None,
        contract: LossContract | None = None,
    ) -> None:
        self.strategy = strategy
        self.device = device
        self.scaler = scaler  # fp16-mixed: the loss is scaled by scaler.scale, then unscaled
        self.contract = contract  # checks every call of the loss (dtrain.train.loss_contract)
        self.expected: int | None = None
        self.loss_scale = LossScale(device)
        self._first = True
        self._open: tuple[StepAgreement, int, float] | None = None  # between begin and finish

    def __call__(
        self,
        micro: Sequence[tuple[Any, Any]],
        loss_fn: LossFn,
        items: int,
        stop: bool,
        planned: int | None = None,
        regroup: bool = False,
    ) -> tuple[torch.Tensor, StepAgreement]:
        """Forward and backward over ``micro`` (this rank's ``items``); returns this rank's
        loss sum and the agreement (global items, stop). ``planned``: the step's global count
        known from its plan (``Task.items_per_sample``); ``regroup``: this rank asks every rank to
        leave its membership generation after the step (``fault.recovery = 'inplace'``).
        Gradients are synchronized and scaled for the global mean when this returns."""
        if self.contract is not None:
            loss_fn = self.contract.wrap(loss_fn)
        scale = self.begin(items, stop, planned, regroup, micro[0], loss_fn)
        if isinstance(self.strategy, OwnStep):
            loss_sum = self.strategy.forward_backward(micro, loss_fn, scale)
        else:
            loss_sum = run_micro_batches(self.strategy, micro, loss_fn, scale)
        return loss_sum, self.finish()

    def begin(
        self,
        items: int,
        stop: bool,
        planned: int | None,
        regroup: bool,
        first_micro: tuple[Any, Any],
        loss_fn: LossFn,
    ) -> torch.Tensor:
        """The step's first half, before its first forward: the agreement opened (agreed on
        now on a process's first step), the scale of every micro-batch's loss sum returned.
        A loop of the user's own (:mod:`dtrain.loop`) calls it and :meth:`finish` around its
        micro-batches, as :meth:`__call__` does."""
        strategy = self.strategy
        agreement = StepAgreement(items if strategy.counts_items else 0, stop, regroup)
        expected = planned if planned is not None else self.expected
        if expected is None:  # nothing to assume: agree before the forward, this once
            agreement.all_reduce(strategy.comm, self.device)
            expected = agreement.items
        if self._first:
            self._first = False
            strategy.before_first_step(first_micro, loss_fn)
        loss_scale = 1.0 if self.scaler is None else self.scaler.scale  # a power of two
        scale = self.loss_scale(strategy.data_parallel_size / max(1, expected) * loss_scale)
        if not agreement.agreed and isinstance(strategy, CommHookControl):
            hook = strategy.comm_hook_of_ours
            if hook is not None:
                hook.carry(agreement)  # summed with the last bucket, if it can be
        self._open = (agreement, expected, loss_scale)
        return scale

    def finish(self) -> StepAgreement:
        """The step's second half, after its last backward: gradients synchronized, the
        agreement completed, gradients rescaled for the global mean."""
        assert self._open is not None, "ForwardBackward.finish without begin"
        (agreement, expected, loss_scale), self._open = self._open, None
        strategy = self.strategy
        if not isinstance(strategy, OwnStep):
            strategy.sync_gradients()
        if not agreement.agreed:
            agreement.all_reduce(strategy.comm, self.device)
        factor = _count_factor(agreement, expected)
        if factor != 1.0 or loss_scale != 1.0:
            # Where only the loss scale is divided out, exactly: it is a power of two.
            rescale_gradients(strategy, factor / loss_scale)
        self.expected = agreement.items
        return agreement

    def agree_within(self) -> float:
        """Within the step, before :meth:`finish`: the agreement completed now (where no
        gradient sync has carried it yet), and the factor that turns gradients of this step's
        scale into those of the global mean. For a further optimizer that a loop of the
        user's own steps before the step ends (:meth:`dtrain.loop.run.Run.update`)."""
        assert self._open is not None, "ForwardBackward.agree_within without begin"
        agreement, expected, loss_scale = self._open
        if not agreement.agreed:
            # Summing the ranks' counts is idempotent: a hook that carries the agreement later
            # in the step sums the same values again.
            agreement.all_reduce(self.strategy.comm, self.device)
        return _count_factor(agreement, expected) / loss_scale


def _count_factor(agreement: StepAgreement, expected: int) -> float:
    """``expected / G`` where the step's agreed global count ``G`` is not the one its scale
    assumed, else 1."""
    if agreement.items != expected and agreement.items > 0:
        return expected / agreement.items
    return 1.0


@torch.no_grad()
def rescale_gradients(strategy: Strategy, factor: float) -> None:
    """Multiply this rank's gradients by ``factor`` (a DTensor's local part in place)."""
    grads = [local_part(p.grad) for p in strategy.parameters() if p.grad is not None]
    if grads:
        torch._foreach_mul_(grads, factor)
