"""TensorBoard event files (``metrics.tensorboard = true``): the records of ``metrics.jsonl``
as scalars in ``RUN_DIR/tensorboard``, through ``torch.utils.tensorboard.SummaryWriter`` (what
goes where: docs/observability.md). The writer queues events and writes them from its own
thread, so a record costs the training loop a few microseconds.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

from dtrain.errors import UserError
from dtrain.metrics.trackers.rows import to_row

TENSORBOARD_DIR = "tensorboard"


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
        kind, step, walltime = record.get("kind"), record.get("step"), record.get("time")
        # The numbers named as the trackers name them; an own loop's run.log is an event here.
        row = to_row(record) if kind in ("train", "eval", "ranks") else None
        if row is not None:
            for tag, value in row.values.items():
                self.writer.add_scalar(tag, value, row.step, walltime=walltime)
        elif kind in ("event", "straggler") and isinstance(step, int):
            name = record.get("name", kind)
            details = ", ".join(
                f"{k} {v}" for k, v in record.items() if k not in ("kind", "name", "time")
            )
            self.writer.add_text("events", f"{name}: {details}", step, walltime=walltime)

    def close(self) -> None:
        self.writer.close()
