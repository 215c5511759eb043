"""How a config key is declared: its default, its help and its allowed range, side by side
(:mod:`dtrain.config.sections` declares every section with it; a task's own section too)."""

from __future__ import annotations

from dataclasses import field
from typing import Any


def option(
    default: Any,
    help: str,
    *,
    min: float | None = None,
    max: float | None = None,
    min_exclusive: bool = False,
) -> Any:
    """A config field with its help text and its allowed range (checked by
    :mod:`dtrain.config.load`)."""
    meta = {"help": help, "min": min, "max": max, "min_exclusive": min_exclusive}
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata=meta)
    return field(default=default, metadata=meta)
