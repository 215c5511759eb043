"""TensorBoard event files (``metrics.tensorboard = true``): the records of ``metrics.jsonl``
as scalars in ``RUN_DIR/tensorboard``, through ``torch.utils.tensorboard.SummaryWriter`` (what
goes where: docs/observability.md). The writer queues events and writes them from its own
thread, so a record costs the training loop a few microseconds.
"""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path
from typing import Any

from dtrain.errors import UserError

TENSORBOARD_DIR = "tensorboard"

# Fields that are positions or clocks, not measurements.
_NOT_SCALARS = {"step", "time", "steps", "epoch"}


def check_available() -> None:
    """A one-line user error when the config asks for TensorBoard and it is not installed."""
    if importlib.util.find_spec("tensorboard") is None:
        raise UserError(
            "metrics.tensorboard = true needs the tensorboard package: "
            "pip install -e '.[tensorboard]' in dtrain's clone (or set metrics.tensorboard = false)"
        )


class TensorBoardSink:
    def __init__(self, run_dir: Path) -> None:
        check_available()
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(run_dir / TENSORBOARD_DIR))

    def write(self, record: dict[str, Any]) -> None:
        kind = record.get("kind")
        step = record.get("step")
        if not isinstance(step, int):
            return
        walltime = record.get("time")
        if kind in ("train", "eval"):
            for key, value in record.items():
                if key not in _NOT_SCALARS and _is_number(value):
                    self.writer.add_scalar(f"{kind}/{key}", value, step, walltime=walltime)
        elif kind == "ranks":
            for key, values in record.items():
                if key in _NOT_SCALARS or not isinstance(values, list):
                    continue
                for rank, value in enumerate(values):
                    if _is_number(value):
                        self.writer.add_scalar(
                            f"ranks/{key}/rank{rank}", value, step, walltime=walltime
                        )
        elif kind in ("event", "straggler"):
            name = record.get("name", kind)
            details = ", ".join(
                f"{k} {v}" for k, v in record.items() if k not in ("kind", "name", "time")
            )
            self.writer.add_text("events", f"{name}: {details}", step, walltime=walltime)

    def close(self) -> None:
        self.writer.close()


def _is_number(value: Any) -> bool:
    return (
        isinstance(value, (int, float))
        and not isinstance(value, bool)
        and math.isfinite(float(value))
    )
