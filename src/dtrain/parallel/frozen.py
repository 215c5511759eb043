"""What a checkpoint leaves out: the frozen base of a PEFT model (LoRA and PEFT's other
adapters). Its base never changes in training and the task builds it again on every start (with
``run.init_from``'s weights, when the run has them), so a checkpoint holds the adapters (and
PEFT's ``modules_to_save``) and their optimizer state only: a checkpoint the size of the
adapters, not of the model. Any other model is checkpointed whole, frozen parameters included
(one frozen after some steps of training is not what its task builds).

Duck-typed (a PEFT model has ``peft_config`` and ``get_base_model``): nothing here imports
``peft``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from torch import nn


def is_peft_model(model: nn.Module) -> bool:
    """Whether ``model`` is a PEFT model (``peft.PeftModel`` and its task classes)."""
    return isinstance(getattr(model, "peft_config", None), dict) and callable(
        getattr(model, "get_base_model", None)
    )


def frozen_names(model: nn.Module) -> frozenset[str]:
    """The state-dict names of the parameters a checkpoint of ``model`` leaves out: a PEFT
    model's frozen ones, else none."""
    if not is_peft_model(model):
        return frozenset()
    # Every name of a tied parameter (GPT-2's head is its frozen token embedding): torch's
    # ignore_frozen_params drops only the first.
    named = model.named_parameters(remove_duplicate=False)
    return frozenset(name for name, p in named if not p.requires_grad)


def without(state: Mapping[str, Any], names: frozenset[str]) -> dict[str, Any]:
    """``state`` less ``names``."""
    return {key: value for key, value in state.items() if key not in names}


def with_frozen(
    state: Mapping[str, Any], model: nn.Module, names: frozenset[str]
) -> dict[str, Any]:
    """A checkpoint's ``state`` (without ``names``) completed by ``model``'s own frozen tensors,
    for a strict load: a missing or unexpected adapter key is still named."""
    if not names:
        return dict(state)
    own = model.state_dict()
    return {**{key: own[key] for key in names if key in own}, **state}


def checkpoint_options(options: Any, names: frozenset[str]) -> Any:
    """torch's ``StateDictOptions`` for a checkpoint's ``get_state_dict`` and
    ``set_state_dict``: ``options`` (None: torch's default), leaving the frozen parameters out
    where there are ``names`` (the load then takes what the checkpoint holds, whose keys were
    checked against the model's before)."""
    if not names:
        return options
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return dataclasses.replace(
        options or StateDictOptions(), ignore_frozen_params=True, strict=False
    )
