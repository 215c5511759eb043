"""Cutting a model into pipeline stages, keeping the full model's parameter names.

A model offers itself as a chain of layers -- ``model.pipeline_layers()`` (the built-in GPT:
embeddings, each block, norm + head) or, for an ``nn.Sequential``, its children. A stage is a
contiguous run of that chain (:class:`StageChain`). The layers share the model's modules, so a
rank keeps the model object itself, *pruned* to the parameters and buffers its stages use
(:func:`prune_to_stages`): its ``state_dict()`` then names every tensor as the full model does
(``blocks.3.mlp.0.weight``), which is what checkpoints and the full-state gather key on.

A parameter can be used by several stages: the GPT's output head shares the token embedding's
weight, one at each end of the pipeline. Each of those stages holds its own copy, and
:func:`tied_parameters` finds them so the strategy can sum their gradients (the copies then
stay equal, as the one tensor of a single process does).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from dtrain.compute.precision import Precision
from dtrain.errors import ConfigError


def model_layers(
    model: nn.Module, layers_of_task: Callable[[nn.Module], list[nn.Module]] | None = None
) -> list[nn.Module]:
    """The model as a chain of layers, each taking the previous one's output: the task's
    ``pipeline_layers(model)`` when it gives one, else the model's own."""
    layers_of = getattr(model, "pipeline_layers", None)
    if layers_of_task is not None:
        layers = list(layers_of_task(model))
    elif callable(layers_of):
        layers = list(layers_of())
    elif isinstance(model, nn.Sequential):
        layers = list(model)
    else:
        raise ConfigError(
            f"strategy.name = 'pipeline' cannot split {type(model).__name__} into stages: "
            "expected an nn.Sequential, or a model with a pipeline_layers() method returning "
            "its layers in order (each one's output the next one's input)"
        )
    if not layers or not all(isinstance(layer, nn.Module) for layer in layers):
        raise ConfigError(
            f"{type(model).__name__}.pipeline_layers() must return a non-empty list of "
            "nn.Module layers"
        )
    return layers


class StageChain(nn.Module):
    """What one pipeline stage computes: its layers, in order, under the run's precision (the
    schedule calls each stage's forward on its own)."""

    def __init__(self, layers: Sequence[nn.Module], precision: Precision | None = None) -> None:
        super().__init__()
        self.layers = nn.ModuleList(layers)
        self.precision = precision

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with contextlib.nullcontext() if self.precision is None else self.precision.autocast():
            for layer in self.layers:
                x = layer(x)
        return x


@dataclass(frozen=True)
class Entry:
    """One registered tensor of the full model: ``module.<name>`` at ``fqn``."""

    fqn: str
    module: nn.Module
    name: str
    tensor: torch.Tensor
    is_parameter: bool


def _entries(model: nn.Module) -> list[Entry]:
    """Every module's own parameters, then its buffers, in the order of the modules."""
    return [
        Entry(f"{prefix}.{name}" if prefix else name, module, name, tensor, is_parameter)
        for prefix, module in model.named_modules(remove_duplicate=False)
        for is_parameter, held in ((True, module._parameters), (False, module._buffers))
        for name, tensor in held.items()
        if tensor is not None
    ]


def stage_entries(model: nn.Module, chains: Sequence[StageChain]) -> list[Entry]:
    """The model's entries that the stages ``chains`` keep.

    An entry is kept when its tensor is used by the chains and its module is one of theirs; a
    tensor the chains use that no module of theirs registers (a wrapper layer re-registering a
    parent's parameter) is kept wherever the model registers it."""
    used = {id(t) for chain in chains for t in (*chain.parameters(), *chain.buffers())}
    mine = {id(m) for chain in chains for m in chain.modules()}
    entries = [e for e in _entries(model) if id(e.tensor) in used]
    in_my_modules = {id(e.tensor) for e in entries if id(e.module) in mine}
    return [e for e in entries if id(e.module) in mine or id(e.tensor) not in in_my_modules]


def check_coverage(model: nn.Module, kept: Sequence[Sequence[Entry]]) -> None:
    """Every parameter of the model must belong to some stage (else nothing would train it)."""
    covered = {id(e.tensor) for stage in kept for e in stage}
    for entry in _entries(model):
        if entry.is_parameter and id(entry.tensor) not in covered:
            raise ConfigError(
                f"parameter {entry.fqn} of {type(model).__name__} is used by none of the "
                "layers pipeline_layers() returns: every parameter must belong to a layer"
            )


def prune_to_stages(model: nn.Module, keep: Sequence[Entry]) -> None:
    """Drop, in place, every parameter and buffer of ``model`` that is not in ``keep`` (they
    belong to other ranks' stages); the rest keep their full-model names."""
    kept = {(id(e.module), e.name) for e in keep}
    for module in model.modules():
        for store in (module._parameters, module._buffers):
            for name in [n for n, t in store.items() if t is not None]:
                if (id(module), name) not in kept:
                    del store[name]


def first_names(model: nn.Module) -> dict[int, str]:
    """Each parameter's first name in ``model``, by the tensor's id: the name a whole model's
    state gives a parameter it registers under several (tied: the GPT's embedding first)."""
    first: dict[int, str] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        first.setdefault(id(param), name)
    return first


def names_in_whole(model: nn.Module, first: dict[int, str]) -> dict[str, str]:
    """The names of ``model`` (pruned to a rank's stages) that the whole model gives otherwise,
    ``first`` taken before pruning: a later stage's copy of a tied parameter (the GPT's head)
    -> its first name (the embedding's). The names are torch's for this rank's state (one per
    tensor), so no two map to the same whole name."""
    return {
        name: first[id(param)]
        for name, param in model.named_parameters()
        if first.get(id(param), name) != name
    }


@dataclass(frozen=True)
class TiedParameter:
    """A parameter that several stages use: ``fqns[i]`` on stage ``stages[i]``."""

    stages: tuple[int, ...]
    fqns: tuple[str, ...]


def tied_parameters(per_stage: Sequence[Sequence[Entry]]) -> list[TiedParameter]:
    """Parameters kept by more than one stage, in a deterministic order (by first name)."""
    seen: dict[int, list[tuple[int, str]]] = {}
    for stage, entries in enumerate(per_stage):
        for entry in entries:
            if entry.is_parameter:
                owners = seen.setdefault(id(entry.tensor), [])
                if all(s != stage for s, _ in owners):
                    owners.append((stage, entry.fqn))
    tied = [
        TiedParameter(tuple(s for s, _ in owners), tuple(f for _, f in owners))
        for owners in seen.values()
        if len(owners) > 1
    ]
    return sorted(tied, key=lambda t: t.fqns[0])


def local_parameters(chains: Iterable[nn.Module]) -> Iterator[nn.Parameter]:
    """The distinct parameters of this rank's stages."""
    seen: set[int] = set()
    for chain in chains:
        for param in chain.parameters():
            if id(param) not in seen:
                seen.add(id(param))
                yield param
