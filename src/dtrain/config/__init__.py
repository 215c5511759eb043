"""Typed configuration: nested dataclasses with their ranges and help
(:mod:`dtrain.config.sections`), and every rule across keys and packages: the checks
(:mod:`dtrain.config.checks`), read from one capability record per strategy
(:mod:`dtrain.config.capabilities`) and the mesh it lays out (:mod:`dtrain.config.layout`),
and those that need the job's shape (:mod:`dtrain.config.job`).
Reading TOML files and ``--section.key=value`` overrides into a checked :class:`Config` is
:mod:`dtrain.config.load`'s job.

The whole config is loaded and validated in the parent process, before any worker starts, so a
mistake costs the user a one-line error instead of a crashed job. Each section is a dataclass;
range limits and choices live next to the field in its metadata, so that validation, the error
messages and the documentation all come from one place.

The common names are imported from here (``from dtrain.config import Config``); the modules are
where each part lives. This package imports no strategy (nor torch): the parent process checks a
config before it starts any worker, in a fraction of a second.
"""

from dtrain.config.checks import (
    parse_activation_checkpointing,
    validate_cross_fields,
    validate_own_loop,
    validate_strategy,
)
from dtrain.config.sections import (
    BalanceConfig,
    CommConfig,
    Config,
    DataConfig,
    DistConfig,
    OptimConfig,
    StrategyConfig,
    describe_options,
)

__all__ = [
    "BalanceConfig",
    "CommConfig",
    "Config",
    "DataConfig",
    "DistConfig",
    "OptimConfig",
    "StrategyConfig",
    "describe_options",
    "parse_activation_checkpointing",
    "validate_cross_fields",
    "validate_own_loop",
    "validate_strategy",
]
