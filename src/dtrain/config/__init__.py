"""Typed configuration: nested dataclasses with their ranges and help
(:mod:`dtrain.config.sections`), and the checks across keys (:mod:`dtrain.config.checks`).
Reading TOML files and ``--section.key=value`` overrides into a checked :class:`Config` is
:mod:`dtrain.config.load`'s job.

The whole config is loaded and validated in the parent process, before any worker starts, so a
mistake costs the user a one-line error instead of a crashed job. Each section is a dataclass;
range limits and choices live next to the field in its metadata, so that validation, the error
messages and the documentation all come from one place.

Everything is imported from here (``from dtrain.config import Config``); the two modules are
where each part lives.
"""

from dtrain.config.checks import (
    INPLACE_STRATEGIES,
    parse_activation_checkpointing,
    validate_cross_fields,
    validate_for_world,
    validate_schedule,
    wsd_decay_steps,
)
from dtrain.config.sections import (
    BalanceConfig,
    CheckpointConfig,
    CommConfig,
    Config,
    DataConfig,
    DistConfig,
    EvalConfig,
    FaultConfig,
    MetricsConfig,
    OptimConfig,
    RunConfig,
    StrategyConfig,
    TrainConfig,
    describe_options,
)

__all__ = [
    "INPLACE_STRATEGIES",
    "BalanceConfig",
    "CheckpointConfig",
    "CommConfig",
    "Config",
    "DataConfig",
    "DistConfig",
    "EvalConfig",
    "FaultConfig",
    "MetricsConfig",
    "OptimConfig",
    "RunConfig",
    "StrategyConfig",
    "TrainConfig",
    "describe_options",
    "parse_activation_checkpointing",
    "validate_cross_fields",
    "validate_for_world",
    "validate_schedule",
    "wsd_decay_steps",
]
