"""The 2-D layout of a hybrid job: ``data parallel x inner`` ranks on a ``DeviceMesh``, where the
inner dimension is the pipeline (``pp``: the stages of one pipeline) or tensor parallelism
(``tp``: the ranks that share each layer's matrices).

Ranks are laid out with the inner dimension innermost, so that one pipeline's stages, or one
tensor-parallel group, sit on consecutive ranks (on one machine, as far as the world allows:
theirs is the chattiest traffic) and the data-parallel copies of one inner rank are ``inner``
ranks apart::

    world 4 = dp 2 x pp 2        rank:  0    1    2    3
                                 dp:    0    0    1    1
                                 pp:    0    1    0    1
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from dtrain.errors import ConfigError


@dataclass(frozen=True)
class InnerDim:
    """What the inner dimension is: its name on the mesh, the config key that sizes it, and
    what errors call it."""

    name: str  # the mesh dimension's name: "pp" | "tp"
    key: str  # the config key that sizes it
    title: str  # in errors: "data parallel x <title>"


PIPELINE = InnerDim("pp", "strategy.pipeline_stages", "pipeline")
TENSOR = InnerDim("tp", "strategy.tensor_parallel", "tensor parallel")


@dataclass(frozen=True)
class MeshShape:
    dp: int  # data-parallel copies
    inner: int  # ranks per copy (pipeline stages, or the tensor-parallel degree)
    dim: InnerDim

    def coords(self, rank: int) -> tuple[int, int]:
        """``(dp_rank, inner_rank)`` of a global rank."""
        return divmod(rank, self.inner)

    def rank_of(self, dp_rank: int, inner_rank: int) -> int:
        return dp_rank * self.inner + inner_rank


def mesh_shape(world_size: int, size: int, dim: InnerDim) -> MeshShape:
    """The ``dp x inner`` shape for this world size, ``size`` ranks per copy (0: the whole
    world); raises :class:`ConfigError` naming the config key when the world size does not
    divide."""
    inner = size or world_size
    if world_size % inner:
        raise ConfigError(
            f"{dim.key} = {inner} does not divide the world size {world_size}: the mesh is "
            f"data parallel x {dim.title} = {world_size} / {inner} x {inner}; use a divisor of "
            f"{world_size}"
        )
    return MeshShape(dp=world_size // inner, inner=inner, dim=dim)


@dataclass
class Mesh:
    """The mesh and the process groups of this rank."""

    shape: MeshShape
    dp_rank: int
    inner_rank: int
    device_mesh: DeviceMesh | None  # None in a single process
    dp_group: dist.ProcessGroup | None
    inner_group: dist.ProcessGroup | None

    @property
    def dp_mesh(self) -> DeviceMesh | None:
        return None if self.device_mesh is None else self.device_mesh["dp"]

    @property
    def inner_mesh(self) -> DeviceMesh | None:
        return None if self.device_mesh is None else self.device_mesh[self.shape.dim.name]


def build_mesh(shape: MeshShape, rank: int, device: torch.device) -> Mesh:
    """Collective: every rank builds the same mesh (new process groups are made in order)."""
    dp_rank, inner_rank = shape.coords(rank)
    if not dist.is_initialized():
        return Mesh(shape, dp_rank, inner_rank, None, None, None)
    names = ("dp", shape.dim.name)
    device_mesh = init_device_mesh(device.type, (shape.dp, shape.inner), mesh_dim_names=names)
    return Mesh(
        shape,
        dp_rank,
        inner_rank,
        device_mesh,
        device_mesh.get_group("dp"),
        device_mesh.get_group(shape.dim.name),
    )
