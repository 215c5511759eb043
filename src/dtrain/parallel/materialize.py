"""Meta-device initialization: a model built on the ``meta`` device (no memory) gets its values
on each rank for the part that rank holds only -- an FSDP shard, a pipeline stage, a
tensor-parallel slice, or the whole model for the replicated strategies.

Every rank walks the whole model in ``model.apply``'s order on a meta copy, so it draws the same
random numbers in the same order as one process: the initial parameters are the same at every
world size and for every strategy, while no rank holds more than its part plus one module's
tensors (docs/recipes.md, "Models bigger than a rank").

::

    skeleton = meta copy of the whole model        (before the strategy cuts it)
    live     = the strategy's model, cut, still on meta -> to_empty(device)
    seed; for module in post-order(skeleton):
        its own tensors made whole on the device (NaN-filled, to catch what init leaves)
        init_weights(module)
        every name of each tensor this rank holds in ``live`` <- its part (shard, slice, all)
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from dtrain.errors import UserError
from dtrain.parallel.grad_norm import is_dtensor
from dtrain.parallel.skeleton import shared_names, tie

InitFn = Callable[[nn.Module], None]


def is_meta_model(model: nn.Module) -> bool:
    """Whether any parameter or buffer of ``model`` is on the meta device."""
    return any(t.is_meta for t in (*model.parameters(), *model.buffers()))


def require_init(model: nn.Module, init_weights: InitFn | None) -> InitFn:
    """The init function of a meta-built model; a one-line error where the task gives none."""
    if init_weights is None:
        raise UserError(
            f"the task's model ({type(model).__name__}) is on the meta device but the task "
            "gives no Task.init_weights: give a function that initializes one module's own "
            "parameters and buffers (as model.apply(fn) calls it), or build the model on a "
            "real device"
        )
    return init_weights


def materialize(
    skeleton: nn.Module,
    live: nn.Module,
    init_weights: InitFn | None,
    device: torch.device,
    seed: int,
) -> None:
    """Give ``live`` (the strategy's model, its tensors on meta: whole, sharded, sliced or
    pruned to a stage) its values from ``init_weights`` (the task's: :func:`require_init`) run
    over ``skeleton`` (a meta copy of the whole model with the same names), seeded with
    ``seed``. Collective only in that every rank must call it (it sends nothing)."""
    init_weights = require_init(live, init_weights)
    live.to_empty(device=device)
    _tie_again(live, skeleton)
    targets = _named_tensors(live)
    names = _names_by_tensor(skeleton)
    uses = _module_uses(skeleton)
    made: dict[int, torch.Tensor] = {}  # skeleton tensor id -> its whole value, while in use
    # The process's RNG is left as it was (the CPU's, and this rank's GPU's).
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        for _, module in _post_order(skeleton):
            swapped = _swap_in(module, made, device)
            init_weights(module)
            for store, name, meta in swapped:
                value = store[name]
                assert value is not None
                key = id(meta)
                made[key] = value
                uses[key] -= 1
                if uses[key] == 0:  # its last module: write it out and free it
                    _check_initialized(value, names[key][0])
                    for fqn in names[key]:
                        if fqn in targets:
                            _write(targets[fqn], value)
                    del made[key]
            for store, name, meta in swapped:
                store[name] = meta  # the skeleton stays on meta


def _tie_again(live: nn.Module, skeleton: nn.Module) -> None:
    """``to_empty`` gives each module its own new tensor, so a parameter two modules share
    (a tied embedding and head) would become two: make every such group one again, among the
    names this rank holds."""
    present = set(_named_tensors(live))
    groups = [[n for n in names if n in present] for names in shared_names(skeleton)]
    tie(live, [names for names in groups if len(names) > 1])


def _post_order(module: nn.Module, prefix: str = "") -> Iterator[tuple[str, nn.Module]]:
    """``module.apply``'s order: each child's subtree, then the module itself."""
    for name, child in module.named_children():
        yield from _post_order(child, f"{prefix}{name}.")
    yield prefix, module


def _swap_in(
    module: nn.Module, made: dict[int, torch.Tensor], device: torch.device
) -> list[tuple[dict[str, Any], str, torch.Tensor]]:
    """Put a whole, real tensor in place of each meta tensor ``module`` holds itself (the one
    already made for a tensor shared with an earlier module); returns what was swapped."""
    swapped = []
    stores: tuple[dict[str, Any], ...] = (module._parameters, module._buffers)
    for store in stores:
        for name, meta in list(store.items()):
            if meta is None:
                continue
            value = made.get(id(meta))
            if value is None:
                value = torch.empty(meta.shape, dtype=meta.dtype, device=device)
                if value.is_floating_point():
                    value.fill_(float("nan"))  # what init leaves unset is caught
                if isinstance(meta, nn.Parameter):
                    value = nn.Parameter(value, requires_grad=meta.requires_grad)
            store[name] = value
            swapped.append((store, name, meta))
    return swapped


@torch.no_grad()
def _write(target: torch.Tensor, value: torch.Tensor) -> None:
    """``target`` (this rank's tensor) <- its part of the whole ``value``."""
    if is_dtensor(target):
        from torch.distributed.tensor import distribute_tensor

        # src_data_rank=None: every rank holds the whole value and cuts its own part locally.
        part = distribute_tensor(
            value.detach(), target.device_mesh, target.placements, src_data_rank=None
        )
        target.to_local().copy_(part.to_local())
    else:
        target.copy_(value.detach())


def _check_initialized(value: torch.Tensor, name: str) -> None:
    if value.is_floating_point() and bool(torch.isnan(value).any()):
        raise UserError(
            f"Task.init_weights left {name} without values: on the meta device a module's "
            "tensors hold nothing until its init_weights call sets every parameter and buffer "
            "the module holds itself"
        )


def _named_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = dict(model.named_parameters(remove_duplicate=False))
    tensors.update(model.named_buffers(remove_duplicate=False))
    return tensors


def _names_by_tensor(model: nn.Module) -> dict[int, list[str]]:
    names: dict[int, list[str]] = {}
    for fqn, tensor in _named_tensors(model).items():
        names.setdefault(id(tensor), []).append(fqn)
    return names


def _module_uses(model: nn.Module) -> dict[int, int]:
    """How many modules of the post-order walk hold each tensor (a tied one: more than one)."""
    uses: dict[int, int] = {}
    for _, module in _post_order(model):
        for store in (module._parameters, module._buffers):
            for tensor in store.values():
                if tensor is not None:
                    uses[id(tensor)] = uses.get(id(tensor), 0) + 1
    return uses
