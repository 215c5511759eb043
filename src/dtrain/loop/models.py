"""The further models of a loop of the user's own (``run.wrap``): each wrapped by a strategy of
its own, of the run's kind, and checkpointed through the run's one model state.

A GAN's discriminator or a distillation's frozen teacher is a model the run's strategy does not
hold, so each further model gets a second instance of the same strategy, built by the same
registry from the same config, which spreads it, syncs its gradients and lays out its state as it
does the main model's (:class:`WithModels`). A frozen model is neither wrapped nor saved, and made
equal on every rank. Under tensor parallelism a further model without a plan is held whole on
every rank of the tensor-parallel group (its inputs are the same there, so are its gradients),
which suits the small ones this is for: a critic, a probe (docs/own-loop.md).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from dtrain.checkpoint.forms import Form, Origin, Part
from dtrain.config import Config
from dtrain.dist.runtime import Runtime
from dtrain.errors import CheckpointError, UserError
from dtrain.parallel import build_strategy
from dtrain.parallel.base import LossFn, Strategy
from dtrain.parallel.sharded import MeshStrategy
from dtrain.task import Task
from dtrain.train.optim_choice import checked_optimizer
from dtrain.train.step import rescale_gradients
from dtrain.train.trainer import Trainer

BuildOptimizer = Callable[[list[tuple[str, nn.Parameter]]], torch.optim.Optimizer]

# The strategies a further model is wrapped under: those that wrap any module by itself. (A
# pipeline's stages and localsgd's periodic averaging belong to one model.)
WRAPPING_STRATEGIES = ("ddp", "allreduce", "fsdp", "tensor")


@dataclass(frozen=True)
class Wrapped:
    """A further model with an optimizer: its own instance of the run's strategy."""

    name: str
    strategy: Strategy
    optimizer: torch.optim.Optimizer


def check_further(name: str, model: nn.Module, taken: set[str], known: set[nn.Module]) -> None:
    """``run.wrap(name, model)``'s mistakes, in one line: a name taken (by a further model, or
    by the run's own checkpoint parts) or not an identifier; a module the run holds already."""
    if not name.isidentifier() or name in {*taken, "model", "optimizer", "comm", "outer"}:
        raise UserError(
            f"run.wrap({name!r}, ...): name each further model once, with an identifier "
            "other than model, optimizer, comm and outer (its checkpoint parts' name)"
        )
    if any(module in known for module in model.modules()):
        raise UserError(
            f"run.wrap({name!r}, ...): the model shares modules with one the run holds "
            "already; give each model once"
        )


def wrap_trained(
    cfg: Config,
    runtime: Runtime,
    name: str,
    model: nn.Module,
    build_optimizer: BuildOptimizer,
    set_up: LossFn,
    main: Strategy,
) -> Wrapped:
    """``model`` spread by a new instance of the run's strategy, and its optimizer built over
    the parameters that strategy holds (``build_optimizer(named_parameters)``, as
    ``Task.build_optimizer``). ``set_up``: the loss of the strategy's set-up pass, which runs
    on the model's first inputs (:func:`set_up_on_first_call`)."""
    if cfg.strategy.name not in WRAPPING_STRATEGIES:
        raise UserError(
            f"run.wrap({name!r}, ...) under strategy.name = {cfg.strategy.name!r}: a further "
            f"model is wrapped under {', '.join(WRAPPING_STRATEGIES)} for now"
        )
    if cfg.fault.recovery == "inplace":
        raise UserError(
            f"run.wrap({name!r}, ..., optimizer=...) under fault.recovery = 'inplace': a "
            "further optimizer steps within the step (run.update), before the gradient sync a "
            "failed peer can drop, so the survivors could not take the step back; use "
            "fault.recovery = 'restart', or wrap it frozen (without an optimizer)"
        )
    strategy = build_strategy(cfg, runtime)
    if isinstance(strategy, MeshStrategy):  # no plan: whole on each tensor-parallel rank
        strategy.whole_without_plan = True
    strategy.comm = main.comm  # its bytes and waits are the run's: counted with the main's
    strategy.setup(Task(model=model, train_data=(), loss_fn=set_up))
    built = build_optimizer(list(strategy.named_parameters()))
    optimizer = checked_optimizer(built, strategy, f"run.wrap({name!r}, ...)'s optimizer builder")
    set_up_on_first_call(strategy, set_up)
    return Wrapped(name, strategy, optimizer)


def set_up_on_first_call(strategy: Strategy, loss_fn: LossFn) -> None:
    """The strategy's set-up pass (:meth:`Strategy.before_first_step`: DDP registers its comm
    hook and settles its buckets) run on the first inputs the wrapped model is called with,
    just before that call: the run knows a further model's inputs only then."""
    model = strategy.model
    assert model is not None

    def first_call(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        handle.remove()
        inputs: Any = kwargs if kwargs and not args else args[0] if len(args) == 1 else None
        if inputs is None or (args and kwargs):
            raise UserError(
                f"a model given to run.wrap() was called with {len(args)} positional and "
                f"{len(kwargs)} keyword arguments: call it with one input (or keywords only)"
            )
        with torch.enable_grad():  # the set-up pass runs a backward (of zero)
            strategy.before_first_step((inputs, None), loss_fn)

    handle = model.register_forward_pre_hook(first_call, with_kwargs=True)


@torch.no_grad()
def place_frozen(model: nn.Module, device: torch.device, main: Strategy) -> nn.Module:
    """A model that is not trained: on the device, without gradients, and equal on every
    rank (rank 0's values, broadcast by the main strategy over its data-parallel group, and
    over every rank where model-parallel ranks share a data-parallel rank: tensor's)."""
    model = model.to(device)
    model.requires_grad_(False)
    tensors = [*model.parameters(), *model.buffers()]
    if not dist.is_initialized():
        return model
    if dist.get_world_size() > main.data_parallel_size:
        for tensor in tensors:  # once, at set-up
            dist.broadcast(tensor, src=0)
    elif main.data_parallel_size > 1:
        main.broadcast_from_first(tensors)
    return model


def zero_gradients(strategy: Strategy) -> None:
    """Drop the strategy's gradients (``zero_grad(set_to_none=True)``, as the trainer's)."""
    for param in strategy.parameters():
        param.grad = None


def update_wrapped(
    trainer: Trainer, wrapped: Wrapped, strategies: list[Strategy], loss_sum: torch.Tensor
) -> float:
    """What :meth:`dtrain.loop.run.Run.update` does for ``wrapped`` (``loss_sum``: the phase's,
    finite on every rank where an fp16 overflow is the scale's); the global gradient norm."""
    with trainer.phase("forward_backward"):
        wrapped.strategy.sync_gradients()
        factor = trainer.forward_backward.agree_within()
    if factor != 1.0:
        rescale_gradients(wrapped.strategy, factor)
    with trainer.phase("clip_grad_norm"):
        norm = float(wrapped.strategy.clip_grad_norm(trainer.cfg.train.grad_clip))
    with trainer.phase("optimizer"):
        if math.isfinite(norm):  # global: every rank takes the same branch
            wrapped.optimizer.step()
        elif trainer.scale_overflowed(norm, loss_sum):
            assert trainer.scaler is not None
            trainer.scaler.note_overflow()
            scale = trainer.scaler.scale
            trainer.run_log.event(
                "skipped_update", trainer.step + 1, model=wrapped.name, loss_scale=scale
            )
        else:
            trainer.run_log.event("skipped_update", trainer.step + 1, model=wrapped.name)
        for strategy in (trainer.strategy, *strategies):
            zero_gradients(strategy)
    return norm


class WithModels:
    """The run's model state (:class:`~dtrain.checkpoint.model_state.ModelState`): the main
    strategy's, with each further model's parts beside its own, named ``<name>.<part>``, in
    the strategy's form. The main model and optimizer are saved and read exactly as without
    further models (every form conversion included); a further model's parts are read back
    in the form they were saved in, so a run with further models resumes under a strategy of
    the same form (ddp and allreduce: replicated; fsdp and tensor: sharded)."""

    def __init__(self, main: Strategy, wrapped: Mapping[str, Wrapped]) -> None:
        self.main = main
        self.wrapped = dict(wrapped)

    # -- what the main strategy says -------------------------------------------------------

    @property
    def state_form(self) -> Form:
        return self.main.state_form

    @property
    def settings_per_name(self) -> bool:
        return self.main.settings_per_name

    @property
    def data_parallel_rank(self) -> int:
        return self.main.data_parallel_rank

    @property
    def data_parallel_size(self) -> int:
        return self.main.data_parallel_size

    def state_dicts_by_name(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        return self.main.state_dicts_by_name(optimizer)

    def load_state_dicts_by_name(
        self, optimizer: torch.optim.Optimizer, states: dict[str, Any]
    ) -> None:
        self.main.load_state_dicts_by_name(optimizer, states)

    def load_state_dicts(self, optimizer: torch.optim.Optimizer, states: dict[str, Any]) -> None:
        self.main.load_state_dicts(optimizer, states)

    # -- the parts of every model ----------------------------------------------------------

    def state_dicts(self, optimizer: torch.optim.Optimizer) -> dict[str, Part]:
        parts = dict(self.main.state_dicts(optimizer))
        for name, model in sorted(self.wrapped.items()):
            for key, part in model.strategy.state_dicts(model.optimizer).items():
                parts[f"{name}.{key}"] = part
        return parts

    def load_beside(self, parts: dict[str, Any], origin: Origin) -> None:
        """The main strategy's parts beside its model, then each further model's: its model
        and optimizer (which the checkpoint must hold), then the rest it gave."""
        ours = {key for key in parts if key.split(".", 1)[0] in self.wrapped}
        self.main.load_beside({k: v for k, v in parts.items() if k not in ours}, origin)
        for name, model in sorted(self.wrapped.items()):
            prefix = f"{name}."
            held = {k.removeprefix(prefix): v for k, v in parts.items() if k.startswith(prefix)}
            missing = [part for part in ("model", "optimizer") if part not in held]
            if missing:
                raise CheckpointError(
                    f"{origin.folder} holds no {' or '.join(missing)} of the model "
                    f"run.wrap({name!r}) wrapped: it was saved without that model, or under a "
                    "strategy of another form (replicated: ddp, allreduce; sharded: fsdp); "
                    "resume it with the loop and strategy that saved it"
                )
            model.strategy.load_state_dicts(model.optimizer, held)
            beside = {k: v for k, v in held.items() if k not in ("model", "optimizer")}
            model.strategy.load_beside(beside, origin)
