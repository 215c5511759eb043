"""Parameters that stages share (tied: the GPT's token embedding on the first stage is its
output head on the last): a process group over the ranks that hold each, their gradients
summed over it, and each counted once in the gradient norm."""

from __future__ import annotations

import itertools
from collections.abc import Collection
from dataclasses import dataclass

import torch.distributed as dist
from torch import nn

from dtrain.config.layout import ParallelDims
from dtrain.parallel.grad_norm import local_part
from dtrain.parallel.pipeline.split import TiedParameter


@dataclass(frozen=True)
class Tie:
    """A parameter this rank shares with other stages: its name here, the group of its
    holders (None when they are all on this rank) and whether this rank counts its norm."""

    fqn: str
    group: dist.ProcessGroup | None
    counted: bool


def make_ties(
    tied: list[TiedParameter], dims: ParallelDims, my_stages: Collection[int], rank: int
) -> list[Tie]:
    """One process group per tied parameter and copy of the pipeline (each data-parallel and
    tensor-parallel coordinate), over the ranks whose stages hold it (every rank takes part in
    making every group, in the same order); the ties of the stages in ``my_stages``."""
    ties = []
    for info in tied:
        ranks = sorted({s % dims.pp for s in info.stages})
        group = None
        if len(ranks) > 1 and dist.is_initialized():
            for rep, shard, tp in itertools.product(
                range(dims.dp_replicate), range(dims.dp_shard), range(dims.tp)
            ):
                members = [
                    dims.rank_of(dp_replicate=rep, dp_shard=shard, pp=r, tp=tp) for r in ranks
                ]
                made = dist.new_group(members)
                if rank in members:
                    group = made
        held = [i for i, s in enumerate(info.stages) if s in my_stages]
        if held:
            # Counted once in the gradient norm: by the first stage that holds it.
            ties.append(Tie(info.fqns[held[0]], group, info.stages[0] in my_stages))
    return ties


def sum_tied_gradients(ties: list[Tie], model: nn.Module) -> None:
    """Each tied parameter's gradient, summed over the stages that hold it."""
    for tie in ties:
        if tie.group is not None:
            grad = model.get_parameter(tie.fqn).grad
            assert grad is not None
            dist.all_reduce(local_part(grad), group=tie.group)


def uncounted(ties: list[Tie], model: nn.Module) -> set[int]:
    """The ids of the tied parameters whose norm another stage counts."""
    return {id(model.get_parameter(t.fqn)) for t in ties if not t.counted}
