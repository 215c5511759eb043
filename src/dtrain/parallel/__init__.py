"""Strategies: how a model is spread over ranks (the interface is :mod:`dtrain.parallel.base`).

The registry lives here, where the package starts: this file imports the leaf strategy modules
and maps each one's ``name`` (what ``strategy.name`` in the config says) to its class. The base
module imports none of them, so adding a strategy is one module plus one entry below, and never
touches the trainer.
"""

from __future__ import annotations

from dtrain.config import Config
from dtrain.errors import ConfigError
from dtrain.parallel.allreduce import AllReduceStrategy
from dtrain.parallel.base import Strategy
from dtrain.parallel.ddp import DDPStrategy
from dtrain.parallel.fsdp import FSDPStrategy
from dtrain.parallel.local_sgd import DiLoCoStrategy, LocalSGDStrategy
from dtrain.parallel.pipeline import PipelineStrategy
from dtrain.parallel.tensor import TensorParallelStrategy
from dtrain.runtime import Runtime

STRATEGIES: dict[str, type[Strategy]] = {
    cls.name: cls
    for cls in (
        DDPStrategy,
        AllReduceStrategy,
        FSDPStrategy,
        PipelineStrategy,
        TensorParallelStrategy,
        LocalSGDStrategy,
        DiLoCoStrategy,
    )
}


def strategy_names() -> list[str]:
    return sorted(STRATEGIES)


def strategy_class(name: str) -> type[Strategy]:
    if name not in STRATEGIES:
        raise ConfigError(
            f"strategy.name = {name!r} is not a strategy; valid: {', '.join(sorted(STRATEGIES))}"
        )
    return STRATEGIES[name]


def build_strategy(cfg: Config, runtime: Runtime) -> Strategy:
    return strategy_class(cfg.strategy.name)(cfg, runtime)
