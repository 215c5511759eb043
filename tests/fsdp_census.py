"""What torch's FSDP2 (``fully_shard``) holds unsharded while a step runs, counted from its own
state after every operation: each unit's gathered parameters, their unsharded gradients, the
flat all-gather buffers (a prefetched unit's, and in forward the last unit's, kept for the
next copy-out) and the reduce-scatter inputs it keeps until the next unit's reduce-scatter;
and what each unit prefetches in backward (``strategy.backward_prefetch``). The rank
functions here run inside :func:`tests.ranks.run_ranks`.

This reads torch's private FSDP2 state (``torch.distributed.fsdp._fully_shard``, torch 2.13):
it is a measuring aid for the memory estimate's tests, not product code. Where torch renames
what it reads, :func:`fsdp_groups` fails loudly rather than count nothing.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from tests.dist_helpers import make_trainer, params_of


def fsdp_groups(model: nn.Module) -> list[Any]:
    """The FSDP parameter groups of ``model``'s units, each once (root last)."""
    from torch.distributed.fsdp._fully_shard._fsdp_state import _get_module_fsdp_state

    groups: list[Any] = []
    for module in model.modules():
        state = _get_module_fsdp_state(module)
        if state is None:
            continue
        for group in state._fsdp_param_groups:
            if all(group is not seen for seen in groups):
                groups.append(group)
    if not groups:
        raise AssertionError("no FSDP parameter groups found: is the model fully_shard-ed?")
    return groups


def fsdp_states(roots: Iterable[nn.Module]) -> list[Any]:
    """The FSDP state of each unit under ``roots``, each unit once, in module order."""
    from torch.distributed.fsdp import FSDPModule

    units: dict[int, Any] = {}
    for root in roots:
        for module in root.modules():
            if isinstance(module, FSDPModule) and id(module) not in units:
                units[id(module)] = module._get_fsdp_state()
    return list(units.values())


def backward_prefetch_targets(roots: Iterable[nn.Module]) -> list[str]:
    """What each FSDP unit under ``roots`` (each once) prefetches in backward, as torch will
    run it: 'default' (torch's choice: the next unit), 'itself' (nothing: it is gathered by
    then) or 'others'."""
    targets = []
    for state in fsdp_states(roots):
        chosen = state._states_to_backward_prefetch
        targets.append("default" if not chosen else "itself" if chosen == [state] else "others")
    return targets


def reshards_after_forward(roots: Iterable[nn.Module]) -> list[bool]:
    """Whether each FSDP unit under ``roots`` (each once) with parameters frees them after
    its forward, as torch will run it (its root's is switched off by torch itself)."""
    groups = [state._fsdp_param_group for state in fsdp_states(roots)]
    return [group.post_forward_mesh_info is not None for group in groups if group is not None]


def _storage(tensor: torch.Tensor | None) -> Iterator[tuple[int, int]]:
    if tensor is not None:
        storage = tensor.untyped_storage()
        if storage.nbytes():
            yield storage.data_ptr(), storage.nbytes()


class UnshardedCensus(TorchDispatchMode):
    """After every operation, the bytes of what FSDP holds unsharded (each storage once), and
    their peak per phase (``phase``: set by the caller)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.groups = fsdp_groups(model)
        self.phase = "forward"
        self.peaks: dict[str, int] = {}

    def held(self) -> int:
        found: dict[int, int] = {}
        for group in self.groups:
            for param in group.fsdp_params:
                for output in getattr(param, "all_gather_outputs", []):
                    found.update(_storage(output))  # the gathered parameter's storage
                unsharded = getattr(param, "_unsharded_param", None)
                if unsharded is not None:
                    found.update(_storage(unsharded.grad))
                found.update(_storage(param.unsharded_accumulated_grad))
            if group._all_gather_result is not None:  # gathered, not yet copied out
                found.update(_storage(group._all_gather_result.all_gather_output))
        comm = self.groups[0].comm_ctx  # shared by all groups from the root's lazy init on
        kept = comm.all_gather_state  # forward: the last unit's, for the next copy-out
        if kept is not None:
            found.update(_storage(kept.all_gather_result.all_gather_output))
        for state in comm.reduce_scatter_states:
            found.update(_storage(state.reduce_scatter_input))
        return sum(found.values())

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        held = self.held()
        self.peaks[self.phase] = max(self.peaks.get(self.phase, 0), held)
        return out


def unsharded_peaks(raw: dict[str, Any]) -> dict[str, Any]:
    """Train ``raw`` (fsdp); the peak bytes FSDP held unsharded in the forward and in the
    backward of the steps after the first (the first also builds AdamW's state), one block's
    and the root's parameter bytes (whole), what each unit prefetched in backward and the
    trained parameters (whole, on rank 0)."""
    trainer = make_trainer(raw)
    model = trainer.strategy.model
    census = UnshardedCensus(model)
    steps = {"started": 0, "active": False}

    def enter(*_: Any) -> None:
        if not model.training:  # an evaluation
            return
        steps["started"] += 1
        if steps["started"] > 1:
            census.phase = "forward"
            census.__enter__()
            steps["active"] = True

    def to_backward(*_: Any) -> None:
        census.phase = "backward"

    def leave(*_: Any) -> None:
        if steps["active"]:
            census.__exit__(None, None, None)
            steps["active"] = False

    model.register_forward_pre_hook(enter)
    model.register_forward_hook(to_backward)
    trainer.optimizer.register_step_pre_hook(leave)
    trainer.fit()
    blocks = trainer.strategy.unwrapped.blocks
    in_blocks = {id(p) for p in blocks.parameters()}

    def whole(params: Iterator[nn.Parameter]) -> int:
        return sum(p.numel() * p.element_size() for p in params)  # a DTensor's: the whole's

    return {
        "peaks": census.peaks,
        "block": whole(blocks[0].parameters()),
        "root": whole(p for p in model.parameters() if id(p) not in in_blocks),
        "prefetch": backward_prefetch_targets([model]),
        "params": params_of(trainer),
    }


def unsharded_peaks_of_each(raws: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """:func:`unsharded_peaks` of each config in turn, in one process."""
    return [unsharded_peaks(raw) for raw in raws]
