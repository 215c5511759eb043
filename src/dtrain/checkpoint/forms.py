"""The forms a strategy's state takes: what a strategy gives a checkpoint and takes back from
one, as named state dicts in memory. Plain data and pure functions, no file: the strategies
import this module only; :mod:`dtrain.checkpoint.model_state` writes each form to its files and
reads any saved form into the one a strategy asks for (:mod:`dtrain.checkpoint.cross_form`).

``REPLICATED``: every rank holds the same whole state, rank 0 writes it (ddp, allreduce).
``PER_RANK``: each data-parallel rank holds and writes a whole state of its own (localsgd's and
diloco's replicas, a comm hook's residuals). ``SHARDED``: each rank holds and writes its part of
each tensor through DCP (fsdp, tensor, pipeline). A strategy's ``model`` and ``optimizer`` are
in its form (``ModelState.state_form``); a part beside them carries its own (:class:`Part`).
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

# A whole optimizer state's key beside torch's "state" and "param_groups": the names of each
# group's parameters, in the group's order (torch's load ignores keys it does not know), so
# that a strategy which keys the state by name can read it.
NAMES_KEY = "param_names"


class Form(enum.Enum):
    REPLICATED = "replicated"
    PER_RANK = "per rank"
    SHARDED = "sharded"


@dataclass(frozen=True)
class Part:
    """One named state dict a strategy gives, with its form."""

    form: Form
    state: Any


@dataclass(frozen=True)
class Origin:
    """Where the state a strategy takes back came from."""

    folder: str  # the checkpoint's folder name (step-N), for messages
    step: int  # the step it was saved after
    data_parallel_size: int  # of the run that saved it
    per_rank: bool  # it holds one whole state per data-parallel rank (localsgd's replicas)
    own: bool  # each rank took the state it saved itself (per rank, at this size)


def with_param_names(
    state: dict[str, Any], optimizer: torch.optim.Optimizer, named: Iterable[tuple[str, Any]]
) -> dict[str, Any]:
    """``state`` (``optimizer``'s whole state dict) with its groups' parameter names."""
    name_of = {id(param): name for name, param in named}
    names = [[name_of[id(param)] for param in group["params"]] for group in optimizer.param_groups]
    return {**state, NAMES_KEY: names}


def renamed(optim_state: dict[str, Any], names: Mapping[str, str]) -> dict[str, Any]:
    """An optimizer state keyed by parameter name with its names mapped by ``names`` (the
    others kept)."""
    if not names:
        return optim_state
    return {
        **optim_state,
        "state": {names.get(k, k): v for k, v in optim_state["state"].items()},
        "param_groups": [
            {**group, "params": [names.get(n, n) for n in group["params"]]}
            for group in optim_state["param_groups"]
        ],
    }
