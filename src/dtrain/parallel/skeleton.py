"""The whole model on rank 0, for a strategy that splits it over ranks (``pipeline``,
``tensor``): at set-up, while rank 0 still holds the full model, it keeps a copy on the meta
device (no memory) and the names of its tied parameters; after training,
``model_for_inference`` loads the gathered full state into that copy and ties it again.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn


class ModelSkeleton:
    """The full model's structure without its tensors, filled once its state is gathered."""

    def __init__(self, model: nn.Module) -> None:
        self.model = meta_copy(model)
        self.ties = shared_names(model)

    def fill(self, state: dict[str, Any]) -> nn.Module:
        """The full model holding ``state`` (taken, not copied), tied parameters one again."""
        self.model.load_state_dict(state, assign=True)
        tie(self.model, self.ties)
        return self.model


def meta_copy(model: nn.Module) -> nn.Module:
    """A copy of ``model`` whose tensors are on the meta device (no memory): the skeleton a full
    state is loaded into later. Tied parameters stay tied. Buffers a state dict leaves out
    (non-persistent: position ids, masks) are copied whole to the CPU, where the filled
    model lives, as no state will fill them."""
    transient = {id(b) for b in non_persistent_buffers(model)}
    memo: dict[int, object] = {}
    for tensor in (*model.parameters(), *model.buffers()):
        if id(tensor) in transient:
            memo[id(tensor)] = tensor.detach().to("cpu", copy=True)
            continue
        empty = torch.empty_like(tensor, device="meta")
        if isinstance(tensor, nn.Parameter):
            empty = nn.Parameter(empty, requires_grad=tensor.requires_grad)
        memo[id(tensor)] = empty
    return copy.deepcopy(model, memo)


def non_persistent_buffers(model: nn.Module) -> list[torch.Tensor]:
    return [
        buffer
        for module in model.modules()
        for name, buffer in module._buffers.items()
        if buffer is not None and name in module._non_persistent_buffers_set
    ]


def shared_names(model: nn.Module) -> list[list[str]]:
    """Groups of parameter names that are one tensor (e.g. a tied embedding and head)."""
    groups: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(param), []).append(name)
    return [names for names in groups.values() if len(names) > 1]


def tie(model: nn.Module, groups: Sequence[Sequence[str]]) -> None:
    """Make each group of names one parameter again (the first one's)."""
    for names in groups:
        first = model.get_parameter(names[0])
        for name in names[1:]:
            owner, _, attr = name.rpartition(".")
            setattr(model.get_submodule(owner), attr, first)
