"""The mesh a strategy lays its ranks out on, as plain numbers (no torch): a layout is a
point of the four named dimensions (:class:`ParallelDims`), and which point follows from the
config (:func:`strategy_dims`). The parent process checks a config with it before any worker
starts; each worker builds the same point into a device mesh (:mod:`dtrain.parallel.mesh`).

``dp_replicate``: data-parallel copies that each hold the whole model state; ``dp_shard``:
data-parallel ranks that hold 1/N of it each (FSDP); ``pp``: pipeline stages; ``tp``: ranks
that share each layer's matrices.
"""

from __future__ import annotations

from dataclasses import dataclass

from dtrain.config.capabilities import capabilities
from dtrain.config.sections import StrategyConfig
from dtrain.errors import ConfigError

INTERLEAVED = "interleaved-1f1b"  # strategy.pipeline_schedule that runs several stages a rank

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
    return ParallelDims(**sizes)


def strategy_dims(options: StrategyConfig, world_size: int) -> ParallelDims:
    """The mesh ``options`` ask for at ``world_size`` (a config error when it does not fit):
    the strategy's own layout, or every rank a data-parallel replica."""
    mesh = capabilities(options.name).mesh
    if mesh == "":
        return ParallelDims(dp_replicate=world_size)
    # Tensor parallelism takes every rank unless told (tensor), else none but its own.
    tp = options.tensor_parallel or (world_size if mesh == "tensor" else 1)
    given = {"tp": ("strategy.tensor_parallel", tp)}
    if mesh == "fsdp":
        copies = ("strategy.dp_replicate", options.dp_replicate)
        return fit_dims(world_size, "dp_shard", **given, dp_replicate=copies)
    if mesh == "pipeline":  # stages: all the ranks tensor parallelism leaves, unless told
        stages = options.pipeline_stages or max(1, world_size // tp)
        given["pp"] = ("strategy.pipeline_stages", stages)
    # Then the data-parallel ranks: replicas, or FSDP shards (with dp_replicate copies of them).
    replicas = replicas_of_shards(options.data_parallel, options.dp_replicate)
    if options.data_parallel == "replicate":
        return fit_dims(world_size, "dp_replicate", **given)
    return fit_dims(world_size, "dp_shard", **given, dp_replicate=replicas)


def stages_per_rank(options: StrategyConfig) -> int:
    """Pipeline stages each rank runs: several under interleaved 1F1B, else one."""
    interleaved = options.pipeline_schedule == INTERLEAVED
    return options.pipeline_virtual_stages if interleaved else 1
