"""Strategies: how a model is spread over ranks (the interface is :mod:`dtrain.parallel.base`).

The registry lives here, where the package starts: it maps each strategy's ``name`` (what
``strategy.name`` in the config says) to the module and class that implement it. The base
module imports none of them, so adding a strategy is one module plus one entry below and its
capability record (:mod:`dtrain.config.capabilities`, what the config's rules read), and never
touches the trainer.

A strategy's module is imported when a run (or ``dtrain strategies``) asks for it, not before:
the model-parallel ones bring in torch's DTensor and pipelining, and with them TorchDynamo --
about 1.2 s of imports that the launcher never needs, nor a data-parallel worker torch's
pipelining.
"""

from __future__ import annotations

import importlib

from dtrain.config import Config
from dtrain.config.capabilities import capabilities, strategy_names
from dtrain.dist.runtime import Runtime
from dtrain.parallel.base import Strategy

# name -> (module, class)
_REGISTRY: dict[str, tuple[str, str]] = {
    "ddp": ("dtrain.parallel.ddp", "DDPStrategy"),
    "allreduce": ("dtrain.parallel.allreduce", "AllReduceStrategy"),
    "fsdp": ("dtrain.parallel.composed", "FSDPStrategy"),
    "pipeline": ("dtrain.parallel.pipeline.strategy", "PipelineStrategy"),
    "tensor": ("dtrain.parallel.composed", "TensorParallelStrategy"),
    "localsgd": ("dtrain.parallel.local_sgd", "LocalSGDStrategy"),
    "diloco": ("dtrain.parallel.local_sgd", "DiLoCoStrategy"),
}


__all__ = ["build_strategy", "strategy_class", "strategy_names"]


def strategy_class(name: str) -> type[Strategy]:
    capabilities(name)  # a name that is no strategy: the config error naming the valid ones
    module, attribute = _REGISTRY[name]
    cls: type[Strategy] = getattr(importlib.import_module(module), attribute)
    assert cls.name == name, f"{module}.{attribute}.name is {cls.name!r}, registered as {name!r}"
    return cls


def build_strategy(cfg: Config, runtime: Runtime) -> Strategy:
    return strategy_class(cfg.strategy.name).from_config(cfg, runtime)
