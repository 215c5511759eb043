"""One mesh of named dimensions for every model-parallel layout (``dp_replicate``, ``dp_shard``,
``pp``, ``tp``): a layout is a point of it (:class:`ParallelDims`), the strategies names for
points, any product of them one mesh (docs/strategies.md, "One mesh").

Ranks are laid out with the dimensions in that order, ``tp`` innermost, so that the chattiest
traffic -- a tensor-parallel group's, then one pipeline's stages -- runs between neighbouring
ranks (on one machine, as far as the world allows), and the data-parallel copies of one
model-parallel rank are furthest apart::

    world 8 = dp_shard 2 x pp 2 x tp 2    rank:      0  1  2  3  4  5  6  7
                                          dp_shard:  0  0  0  0  1  1  1  1
                                          pp:        0  0  1  1  0  0  1  1
                                          tp:        0  1  0  1  0  1  0  1
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from dtrain.config.layout import DIMS, ParallelDims


@dataclass
class Mesh:
    """The device mesh of :class:`ParallelDims` and its process groups (``None`` everywhere
    in a single process)."""

    dims: ParallelDims
    device_mesh: DeviceMesh | None
    # The data-parallel ranks, copies and shards together (None: one rank).
    dp_group: dist.ProcessGroup | None = None

    def group(self, name: str) -> dist.ProcessGroup | None:
        """The process group along one dimension (None when it has one rank)."""
        if self.device_mesh is None or self.dims.size(name) == 1:
            return None
        return self.device_mesh.get_group(name)

    def submesh(self, *names: str) -> DeviceMesh | None:
        """The mesh over ``names``' used dimensions (None if none is used)."""
        used = tuple(n for n in names if self.dims.size(n) > 1)
        if self.device_mesh is None or not used:
            return None
        return self.device_mesh[used if len(used) > 1 else used[0]]


def build_mesh(dims: ParallelDims, device: torch.device) -> Mesh:
    """Collective: every rank builds the same mesh (new process groups are made in order)."""
    if not dist.is_initialized() or dims.world_size == 1:
        return Mesh(dims, None)
    shape = tuple(dims.size(name) for name in DIMS)
    device_mesh = init_device_mesh(device.type, shape, mesh_dim_names=DIMS)
    mesh = Mesh(dims, device_mesh)
    if dims.dp_replicate > 1 and dims.dp_shard > 1:
        flat = device_mesh["dp_replicate", "dp_shard"]._flatten("dp")
        mesh.dp_group = flat.get_group()
    elif dims.dp > 1:
        mesh.dp_group = mesh.group("dp_replicate" if dims.dp_replicate > 1 else "dp_shard")
    return mesh
