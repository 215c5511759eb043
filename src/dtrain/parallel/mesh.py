"""One mesh of named dimensions for every model-parallel layout: ``dp_replicate`` (data-parallel
copies that each hold the whole model state), ``dp_shard`` (data-parallel ranks that hold
1/N of it each: FSDP), ``pp`` (pipeline stages) and ``tp`` (ranks that share each layer's
matrices). A layout is a point of that space (:class:`ParallelDims`); the strategies are
names for points (``fsdp``: all ranks dp_shard; ``tensor``: tp x dp_replicate; ``pipeline``:
pp x dp_replicate or dp_shard), and any product of them is one mesh.

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

from dataclasses import dataclass, fields

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from dtrain.errors import ConfigError

DIMS = ("dp_replicate", "dp_shard", "pp", "tp")  # outermost first


@dataclass(frozen=True)
class ParallelDims:
    """How many ranks each named dimension of the mesh has (1: the dimension is not used)."""

    dp_replicate: int = 1
    dp_shard: int = 1
    pp: int = 1
    tp: int = 1

    def size(self, name: str) -> int:
        size: int = getattr(self, name)
        return size

    @property
    def world_size(self) -> int:
        return self.dp_replicate * self.dp_shard * self.pp * self.tp

    @property
    def dp(self) -> int:
        """Data-parallel ranks: the copies and the shards together (what splits a batch)."""
        return self.dp_replicate * self.dp_shard

    @property
    def used(self) -> tuple[str, ...]:
        """The dimensions with more than one rank, outermost first."""
        return tuple(name for name in DIMS if self.size(name) > 1)

    def coords(self, rank: int) -> dict[str, int]:
        """Each dimension's index of a global rank."""
        out: dict[str, int] = {}
        for name in reversed(DIMS):
            rank, out[name] = divmod(rank, self.size(name))
        return out

    def rank_of(self, **coords: int) -> int:
        """The global rank at ``coords`` (a dimension not given: index 0)."""
        rank = 0
        for name in DIMS:
            rank = rank * self.size(name) + coords.get(name, 0)
        return rank

    def dp_rank(self, rank: int) -> int:
        """The data-parallel index of a global rank: copies outside, shards inside."""
        coords = self.coords(rank)
        return coords["dp_replicate"] * self.dp_shard + coords["dp_shard"]

    def describe(self) -> str:
        """``dp_shard 2 x tp 2``; ``1 rank`` when no dimension is used."""
        parts = [f"{name} {self.size(name)}" for name in self.used]
        return " x ".join(parts) if parts else "1 rank"


def replicas_of_shards(data_parallel: str, dp_replicate: int) -> tuple[str, int]:
    """``strategy.dp_replicate`` for the layouts whose data-parallel ranks may be FSDP shards:
    the copies of the sharded model; a config error where they are whole replicas anyway."""
    if data_parallel == "replicate" and dp_replicate != 1:
        raise ConfigError(
            f"strategy.dp_replicate = {dp_replicate} needs strategy.data_parallel = 'fsdp': with "
            "'replicate' every data-parallel rank holds a whole copy already"
        )
    return ("strategy.dp_replicate", dp_replicate)


def fit_dims(world_size: int, rest: str, **given: tuple[str, int]) -> ParallelDims:
    """The dimensions of a strategy at ``world_size``: each of ``given`` is ``dimension=(config
    key, size)``, and the ``rest`` dimension takes what they leave. A config error names the
    key whose size does not divide the world."""
    sizes: dict[str, int] = {}
    left = world_size
    for name, (key, size) in given.items():
        if size < 1 or left % size:
            used = " x ".join(f"{n} {s}" for n, s in sizes.items() if s > 1)
            within = f"the {left} ranks left by {used}" if used else f"the world size {left}"
            raise ConfigError(
                f"{key} = {size} does not divide {within}: the mesh's dimensions must "
                f"multiply to the world size; use a divisor of {left}"
            )
        sizes[name] = size
        left //= size
    sizes[rest] = left
    names = {f.name for f in fields(ParallelDims)}
    assert set(sizes) <= names, sizes
    return ParallelDims(**sizes)


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
