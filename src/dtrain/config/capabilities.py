"""What each strategy can do, one frozen record per strategy name, as plain data: the config's
rules (:mod:`dtrain.config.checks`) read these records, so the parent process checks a config
without importing any strategy (the model-parallel ones bring in DTensor, torch's pipelining
and TorchDynamo).

What a strategy does is its class in :mod:`dtrain.parallel`; a capability that carries
behaviour stays a class there too (``BackwardSyncControl``, ``CommHookControl``, ``OwnStep``).
``tests/test_strategy_capabilities.py`` keeps each record and its class in agreement.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from dtrain.config.sections import StrategyConfig
from dtrain.errors import ConfigError

# "option": as the config says -- FSDP shards when strategy.data_parallel = 'fsdp', tensor
# parallelism cuts when strategy.tensor_parallel > 1.
Sometimes = Literal["never", "always", "option"]


@dataclass(frozen=True)
class Capabilities:
    """One strategy's abilities, as the config's rules need them."""

    # Gradients averaged through comm hooks (comm.compression, comm.transport = 'shm').
    comm_hooks: bool = False
    # Ranks may hold different shares of a batch and run different numbers of micro-steps
    # (balance.mode): gradients meet once per step, nothing else in a step is collective.
    uneven_shares: bool = False
    # BatchNorm's statistics can be summed over the data-parallel ranks: every one runs the
    # same micro-batches, each a forward of the whole model (strategy.sync_batchnorm).
    syncs_batchnorm: bool = False
    # Every rank keeps a whole replica that a survivor goes on with and a replacement copies
    # (fault.recovery = 'inplace').
    heals_in_place: bool = False
    # Ranks hold different parts of the model and optimizer state: checkpoints through DCP,
    # whose collectives run inside torch (the comm totals would be understated: left out).
    sharded_state: bool = False
    # Collectives in forward: every rank runs the same number of forward passes (evaluation
    # pads with batches computed and not counted).
    lockstep_forward: bool = False
    # Its schedule runs the step's micro-batches itself (across pipeline stages): a loop of the
    # user's own (run.script, dtrain.loop) cannot drive its step.
    owns_step: bool = False
    # The mesh its ranks lie on (dtrain.config.layout.strategy_dims); "": all data parallel.
    mesh: Literal["", "fsdp", "tensor", "pipeline"] = ""
    fsdp: Sometimes = "never"  # whether FSDP shards the model's blocks
    cuts: Sometimes = "never"  # whether tensor parallelism cuts its layers

    @property
    def on_mesh(self) -> bool:
        return self.mesh != ""

    def shards_model(self, options: StrategyConfig) -> bool:
        """Whether FSDP shards the model's blocks under these options (the keys that tune
        FSDP, e.g. ``strategy.backward_prefetch``, apply)."""
        return self.fsdp == "always" or (self.fsdp == "option" and options.data_parallel == "fsdp")

    def holds_dtensors(self, options: StrategyConfig) -> bool:
        """Whether the parameters it trains are cut or sharded over ranks (DTensors)."""
        cut = self.cuts == "always" or (
            self.cuts == "option" and (options.tensor_parallel or 1) > 1
        )
        return cut or self.shards_model(options)


_DATA_PARALLEL = Capabilities(
    comm_hooks=True, uneven_shares=True, syncs_batchnorm=True, heals_in_place=True
)

# strategy.name -> what it can do; the registry of classes (dtrain.parallel) has the same names.
CAPABILITIES: dict[str, Capabilities] = {
    "ddp": _DATA_PARALLEL,
    "allreduce": _DATA_PARALLEL,
    "fsdp": Capabilities(
        syncs_batchnorm=True, sharded_state=True, lockstep_forward=True, mesh="fsdp", fsdp="always"
    ),
    "pipeline": Capabilities(
        owns_step=True,
        sharded_state=True,
        lockstep_forward=True,
        mesh="pipeline",
        fsdp="option",
        cuts="option",
    ),
    "tensor": Capabilities(
        sharded_state=True, lockstep_forward=True, mesh="tensor", fsdp="option", cuts="always"
    ),
    "localsgd": Capabilities(),
    "diloco": Capabilities(),
}


def strategy_names() -> list[str]:
    return sorted(CAPABILITIES)


def capabilities(name: str) -> Capabilities:
    """The record of ``strategy.name = name``; a config error naming the valid ones."""
    if name not in CAPABILITIES:
        raise ConfigError(
            f"strategy.name = {name!r} is not a strategy; valid: {', '.join(strategy_names())}"
        )
    return CAPABILITIES[name]
