"""Experiment trackers (``metrics.trackers``): Weights & Biases and MLflow as sinks of rank 0
beside ``metrics.jsonl`` -- W&B on a thread of its own (:mod:`~dtrain.metrics.trackers.sink`),
MLflow from a process of its own (:mod:`~dtrain.metrics.trackers.process_sink`) -- each an
optional extra imported only when a run names it."""

from __future__ import annotations

import importlib.util
import os
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

from dtrain.config import Config
from dtrain.errors import UserError
from dtrain.fsutil import local_run_dir, scheme_of
from dtrain.metrics.trackers.rows import Setup
from dtrain.storage.objects import Location, location

# Each tracker's importable package and the extra that installs it.
PACKAGES = {"wandb": "wandb", "mlflow": "mlflow"}
# The trackers whose client is Python doing real work per call (MLflow: SQLAlchemy or an HTTP
# client, about a millisecond of CPU per record) log from a process of their own, where that
# work never holds the training process's interpreter lock. W&B's client already hands each
# row to W&B's own service process: a thread costs less than a pipe's JSON there.
OWN_PROCESS = frozenset({"mlflow"})


class OpenSink(Protocol):
    """A tracker's sink as the run holds it (:class:`~dtrain.metrics.trackers.sink.TrackerSink`
    or :class:`~dtrain.metrics.trackers.process_sink.ProcessSink`)."""

    name: str
    failed: threading.Event

    @property
    def closed(self) -> bool: ...

    def write(self, record: dict[str, Any]) -> None: ...

    def close(self) -> None: ...


# The tracker sinks this process holds open, by tracker and run folder. A process may train
# several times (fault.recovery = "inplace": a fresh trainer per membership generation, the
# earlier one left without closing its sinks); it goes on with the sink it has, so the tracker
# run goes on, and W&B, which holds one run per process, is never asked for a second.
_OPEN: dict[tuple[str, Path], OpenSink] = {}


def check_available(names: Sequence[str]) -> None:
    """A one-line user error naming the extra to install when a tracker's package is missing
    (before any worker starts, and on every rank before its first collective)."""
    for name in names:
        if importlib.util.find_spec(PACKAGES[name]) is None:
            raise UserError(
                f"metrics.trackers names {name!r}, but the {PACKAGES[name]} package is not "
                f"installed: pip install -e '.[{name}]' in dtrain's clone, or remove {name!r} "
                "from metrics.trackers"
            )


def folder_of(cfg: Config) -> Location:
    """The run folder itself: a store's (trackers.json there: a resume on any machine reads
    it), else this machine's."""
    run_dir = local_run_dir(cfg.run.dir, cfg.run.local_dir).resolve()
    return location(cfg.run.dir) if scheme_of(cfg.run.dir) else run_dir


def setup_of(cfg: Config) -> Setup:
    run_dir = local_run_dir(cfg.run.dir, cfg.run.local_dir).resolve()  # this machine's
    folder = folder_of(cfg)
    params = {
        f"{section}.{key}": value
        for section, keys in cfg.to_dict().items()
        for key, value in keys.items()
    }
    run_id = os.environ.get("TORCHELASTIC_RUN_ID")
    if run_id:  # the launch's id, which ties the tracker run to the job's logs
        params["dtrain.run_id"] = run_id
    return Setup(
        run_dir=run_dir,
        folder=str(folder),
        name=folder.name,
        params=params,
        project=cfg.metrics.project,
        tags=tuple(cfg.metrics.tags),
        tracking_uri=cfg.metrics.tracking_uri,
    )


def open_trackers(cfg: Config, continuing: bool) -> list[OpenSink]:
    """Rank 0's tracker sinks, one per name in ``metrics.trackers``; ``continuing`` (a resume,
    a restart) goes on with the tracker runs the run folder names."""
    if not cfg.metrics.trackers:
        return []
    # Imported here: they import the checkpoint layout (torch), which a tracker's own process,
    # importing this package, has no use for.
    from dtrain.metrics.trackers.process_sink import ProcessSink
    from dtrain.metrics.trackers.sender import make_tracker
    from dtrain.metrics.trackers.sink import TrackerSink

    setup, folder = setup_of(cfg), folder_of(cfg)
    sinks: list[OpenSink] = []
    for name in cfg.metrics.trackers:
        held = _OPEN.get((name, setup.run_dir))
        if held is not None and not held.closed:
            sinks.append(held)
            continue
        sink: OpenSink
        if name in OWN_PROCESS:
            sink = ProcessSink(name, setup, folder, continuing)
        else:
            sink = TrackerSink(make_tracker(name, setup), folder, continuing)
        _OPEN[(name, setup.run_dir)] = sink
        sinks.append(sink)
    return sinks
