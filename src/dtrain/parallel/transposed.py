"""Tensor-parallel styles for transposed linear maps: Hugging Face's ``Conv1D`` (GPT-2's
layers), whose weight is stored ``(in, out)`` and computes ``x @ W + b`` -- the transpose of
``nn.Linear``'s, which torch's ``ColwiseParallel`` and ``RowwiseParallel`` take only.

- column-wise (:class:`TransposedParallel` ``"colwise"``): the weight's dim 1 and the bias cut,
  the input replicated, the output this rank's columns;
- row-wise (``"rowwise"``): the weight's dim 0 cut, the bias whole (added once: torch's
  sharding rules add it to the partial sums as a partial of its own), the input this rank's
  columns, the output all-reduced;
- a fused projection whose outputs are ``blocks`` equal blocks side by side (GPT-2's
  ``c_attn``: queries | keys | values, each by head) is cut column-wise inside each block
  (``blocks = 3``): a rank holds the columns of its heads in q, k and v alike. Its
  ``DTensor`` is torch's ``_StridedShard(dim, split_factor=blocks)`` of the unchanged global
  parameter, so a checkpoint and an export keep the model's own layout; DCP cannot write a
  piece that is not one box of the global tensor, so such pieces are gathered for a
  checkpoint and cut again when read (:func:`dcp_ready`, :func:`back_to_layout`).

:class:`FusedHeadsAttention` cuts GPT-2's attention: ``c_attn`` fused column-wise, ``c_proj``
row-wise, and the module told its local width (it splits ``c_attn``'s output by
``split_size`` and views the heads with ``-1``), as torchtitan sets a rank's local head count.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import (
    DTensor,
    Placement,
    Replicate,
    Shard,
    distribute_module,
    distribute_tensor,
)
from torch.distributed.tensor.parallel import ParallelStyle
from torch.distributed.tensor.placement_types import _StridedShard

CUTS = ("colwise", "rowwise")


def _cut(dim: int, blocks: int) -> Placement:
    """Dim ``dim`` cut into equal parts, inside each of ``blocks`` side-by-side blocks."""
    return Shard(dim) if blocks == 1 else _StridedShard(dim, split_factor=blocks)


class TransposedParallel(ParallelStyle):
    """A module with ``weight (in, out)`` and ``bias (out,)``, computing ``x @ weight + bias``
    (``transformers``' ``Conv1D``), cut ``"colwise"`` or ``"rowwise"``; ``blocks``: a fused
    column-wise projection's side-by-side blocks, each cut alike."""

    def __init__(self, cut: str, blocks: int = 1) -> None:
        super().__init__()
        if cut not in CUTS or (cut == "rowwise" and blocks != 1):
            raise ValueError(f"TransposedParallel({cut!r}, blocks={blocks})")
        self.cut = cut
        self.blocks = blocks

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        colwise = self.cut == "colwise"
        weight = _cut(1, self.blocks) if colwise else Shard(0)
        bias = _cut(0, self.blocks) if colwise else Replicate()

        def partition(_name: str, mod: nn.Module, mesh: DeviceMesh) -> None:
            for name, placement in (("weight", weight), ("bias", bias)):
                param = getattr(mod, name, None)
                if param is None:
                    continue
                cut = nn.Parameter(
                    distribute_tensor(param, mesh, [placement]), requires_grad=param.requires_grad
                )
                mod.register_parameter(name, cut)

        # The input: replicated (column-wise) or this rank's columns (row-wise, the output of
        # a column-wise map before it).
        arriving: Placement = Replicate() if colwise else Shard(-1)

        def prepare_input(_mod: nn.Module, inputs: Any, mesh: DeviceMesh) -> Any:
            x = inputs[0]
            if not isinstance(x, DTensor):
                x = DTensor.from_local(x, mesh, [arriving], run_check=False)
            return (x, *inputs[1:])

        def prepare_output(_mod: nn.Module, out: Any, _mesh: DeviceMesh) -> Any:
            if not colwise:  # partial sums: all-reduced into the whole output
                out = out.redistribute(placements=[Replicate()])
            # Column-wise: this rank's columns (of each block) as they are.
            return out.to_local()

        return distribute_module(module, device_mesh, partition, prepare_input, prepare_output)


class FusedHeadsAttention(ParallelStyle):
    """GPT-2's self-attention (``GPT2Attention``) over a tensor-parallel group: each rank
    computes its ``num_heads / degree`` heads; one all-reduce forward (``c_proj``'s) and one
    backward (``c_attn``'s input)."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        attn: Any = module
        degree = device_mesh.size()
        TransposedParallel("colwise", blocks=3)._apply(attn.c_attn, device_mesh)
        TransposedParallel("rowwise")._apply(attn.c_proj, device_mesh)
        # This rank's width of each of q, k, v (c_attn's output is split by it).
        attn.split_size = attn.split_size // degree
        attn.num_heads = attn.num_heads // degree
        return module


# -- checkpoints -------------------------------------------------------------------------------


def _is_fused_cut(value: object) -> bool:
    return isinstance(value, DTensor) and any(
        isinstance(p, _StridedShard) and not _cut_again_later(value.placements, i)
        for i, p in enumerate(value.placements)
    )


def _cut_again_later(placements: tuple[Placement, ...], index: int) -> bool:
    """Whether a later mesh dimension cuts the same tensor dimension: FSDP's strided shard
    over a tensor-parallel shard, one box of the global tensor that DCP writes as it is."""
    dim = placements[index].dim  # type: ignore[attr-defined]
    return any(isinstance(p, Shard) and p.dim == dim for p in placements[index + 1 :])


def _unfused(value: DTensor) -> list[Placement]:
    return [
        Replicate()
        if isinstance(p, _StridedShard) and not _cut_again_later(value.placements, i)
        else p
        for i, p in enumerate(value.placements)
    ]


def has_fused_cuts(model: nn.Module) -> bool:
    """Whether any of the model's parameters is cut inside blocks (:class:`FusedHeadsAttention`)."""
    return any(_is_fused_cut(p) for p in model.parameters())


def dcp_ready(state: Any) -> Any:
    """``state`` (nested dicts and lists) with each tensor cut inside blocks gathered whole over
    that dimension (collective: every rank holds the same tensors), so that DCP writes it as
    boxes of the global tensor; everything else as it is."""
    if isinstance(state, Mapping):
        return {key: dcp_ready(value) for key, value in state.items()}
    if isinstance(state, list):
        return [dcp_ready(value) for value in state]
    if _is_fused_cut(state):
        return state.redistribute(placements=_unfused(state))
    return state


def back_to_layout(state: Any, layout: Any) -> Any:
    """``state`` read by DCP into :func:`dcp_ready`'s layout, each tensor cut again as the
    matching tensor of ``layout`` (the same structure, as the model lays it out)."""
    if isinstance(state, Mapping) and isinstance(layout, Mapping):
        return {key: back_to_layout(value, layout.get(key)) for key, value in state.items()}
    if isinstance(state, list) and isinstance(layout, list) and len(state) == len(layout):
        return [back_to_layout(value, like) for value, like in zip(state, layout, strict=True)]
    if (
        isinstance(state, DTensor)
        and _is_fused_cut(layout)
        and state.placements != layout.placements
    ):
        return state.redistribute(placements=layout.placements)
    return state
