"""The 2-D layout of a hybrid job: ``data parallel x pipeline`` ranks on a ``DeviceMesh``.

Ranks are laid out with the pipeline dimension innermost, so that the stages of one pipeline
sit on consecutive ranks (on one machine, as far as the world allows: stage-to-stage sends are
the chattiest traffic) and the copies of one stage are ``pipeline_stages`` ranks apart::

    world 4 = dp 2 x pp 2        rank:  0    1    2    3
                                 dp:    0    0    1    1
                                 pp:    0    1    0    1
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from dtrain.config import Config
from dtrain.errors import ConfigError


@dataclass(frozen=True)
class MeshShape:
    dp: int  # copies of the pipeline (data parallel)
    pp: int  # ranks per pipeline

    def coords(self, rank: int) -> tuple[int, int]:
        """``(dp_rank, pp_rank)`` of a global rank."""
        return divmod(rank, self.pp)

    def rank_of(self, dp_rank: int, pp_rank: int) -> int:
        return dp_rank * self.pp + pp_rank


def mesh_shape(cfg: Config, world_size: int) -> MeshShape:
    """The ``dp x pp`` shape for this world size; raises :class:`ConfigError` naming the
    dimensions when the world size does not divide."""
    pp = cfg.strategy.pipeline_stages or world_size
    if world_size % pp:
        raise ConfigError(
            f"strategy.pipeline_stages = {pp} does not divide the world size {world_size}: the "
            f"mesh is data parallel x pipeline = {world_size} / {pp} x {pp}; use a divisor of "
            f"{world_size}"
        )
    return MeshShape(dp=world_size // pp, pp=pp)


@dataclass
class Mesh:
    """The mesh and the process groups of this rank."""

    shape: MeshShape
    dp_rank: int
    pp_rank: int
    device_mesh: DeviceMesh | None  # None in a single process
    dp_group: dist.ProcessGroup | None
    pp_group: dist.ProcessGroup | None

    @property
    def dp_mesh(self) -> DeviceMesh | None:
        return None if self.device_mesh is None else self.device_mesh["dp"]


def build_mesh(shape: MeshShape, rank: int, device: torch.device) -> Mesh:
    """Collective: every rank builds the same mesh (new process groups are made in order)."""
    dp_rank, pp_rank = shape.coords(rank)
    if not dist.is_initialized():
        return Mesh(shape, dp_rank, pp_rank, None, None, None)
    device_mesh = init_device_mesh(device.type, (shape.dp, shape.pp), mesh_dim_names=("dp", "pp"))
    return Mesh(
        shape,
        dp_rank,
        pp_rank,
        device_mesh,
        device_mesh.get_group("dp"),
        device_mesh.get_group("pp"),
    )
