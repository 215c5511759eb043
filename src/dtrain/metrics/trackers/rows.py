"""What a tracker is told, as plain data: the run (:class:`Setup`), each record's numbers
(:class:`Row`) and how the run ended (:class:`Final`), and the calls every tracker makes of
them (:class:`Tracker`). Light on purpose: a tracker's own process
(:mod:`~dtrain.metrics.trackers.sender`) imports this and its tracker, never torch."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

# Fields that are positions or clocks, not measurements (as for TensorBoard).
NOT_SCALARS = frozenset({"step", "time", "steps", "epoch"})


@dataclass
class Row:
    """The numbers of one record at its step, named as TensorBoard names them: ``train/<field>``,
    ``eval/<field>``, ``ranks/<field>/rank<R>``; an own loop's ``run.log`` values as
    ``log/<field>``."""

    step: int
    time: float
    values: dict[str, float]


@dataclass
class Final:
    """How the run ended, for the tracker's last calls: ``state`` of the summary record
    (completed, preempted; empty when the run closed without one), its numbers, and the path
    of the newest complete checkpoint."""

    state: str = ""
    summary: dict[str, float] = field(default_factory=dict)
    checkpoint: str | None = None


@dataclass(frozen=True)
class Setup:
    """What every tracker is told about the run (from the config, on rank 0); plain data, so
    that it crosses to a tracker's process as JSON."""

    run_dir: Path  # this machine's folder of the run (the trackers' own files go there)
    folder: str  # the run folder itself, as named: a path, or a store's URL
    name: str  # the run folder's name
    params: dict[str, Any]  # the config, flattened: "train.lr" -> 0.5
    project: str  # metrics.project; empty = the tracker's environment variable or default
    tags: tuple[str, ...]  # metrics.tags, each "name" or "key=value"
    tracking_uri: str  # metrics.tracking_uri (MLflow)

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "run_dir": str(self.run_dir), "tags": list(self.tags)}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Setup:
        return cls(**{**data, "run_dir": Path(data["run_dir"]), "tags": tuple(data["tags"])})


class Tracker(Protocol):
    """One tracker's calls, all made on one thread (a sink's thread, or a tracker's process)."""

    name: str
    where: str  # where the run's records go, for the user: a URL, a folder, a store

    def start(self, stored: dict[str, Any] | None) -> dict[str, Any]:
        """Open the tracker's run -- the one ``stored`` identifies when given (what an earlier
        ``start`` returned), else a new one -- and return what identifies it."""
        ...

    def log(self, rows: list[Row]) -> None: ...

    def finish(self, final: Final) -> None: ...


def to_row(record: dict[str, Any]) -> Row | None:
    """A record's numbers (None for records without any): done on the step's path, so that
    no other thread or process ever reads a record its writer might still hold."""
    kind, step = record.get("kind"), record.get("step")
    if kind == "event" and record.get("name") == "log":  # an own loop's run.log(...) values
        kind = "log"
    if not isinstance(step, int) or kind not in ("train", "eval", "ranks", "log"):
        return None
    values: dict[str, float] = {}
    for key, value in record.items():
        if key in NOT_SCALARS:
            continue
        if kind == "ranks" and isinstance(value, list):
            for rank, each in enumerate(value):
                if is_number(each):
                    values[f"ranks/{key}/rank{rank}"] = float(each)
        elif kind != "ranks" and key != "name" and is_number(value):
            values[f"{kind}/{key}"] = float(value)
    return Row(step, float(record.get("time") or 0.0), values) if values else None


def summary_of(record: dict[str, Any]) -> tuple[str, dict[str, float]]:
    """The summary record's state and numbers, for :class:`Final`."""
    numbers = {k: float(v) for k, v in record.items() if k != "step" and is_number(v)}
    return str(record.get("state") or ""), numbers


def is_number(value: Any) -> bool:
    return (
        isinstance(value, (int, float))
        and not isinstance(value, bool)
        and math.isfinite(float(value))
    )


def first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0][:300] if text else "no message"


def failure(name: str, where: str, exc: BaseException) -> str:
    """The one warning's text for a tracker whose own code raised."""
    return (
        f"{name} failed ({where}: {type(exc).__name__}: {first_line(exc)}); "
        "training goes on without it (metrics.jsonl has every record)"
    )
