"""Experiment trackers (``metrics.trackers``): Weights & Biases and MLflow as sinks of rank 0
beside ``metrics.jsonl``, each on its own thread (:mod:`~dtrain.metrics.trackers.sink`), each an
optional extra imported only when a run names it."""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Sequence
from pathlib import Path

from dtrain.config import Config
from dtrain.errors import UserError
from dtrain.fsutil import local_run_dir, scheme_of
from dtrain.metrics.trackers.sink import Setup, Tracker, TrackerSink
from dtrain.storage.objects import location

# Each tracker's importable package and the extra that installs it.
PACKAGES = {"wandb": "wandb", "mlflow": "mlflow"}

# The tracker sinks this process holds open, by tracker and run folder. A process may train
# several times (fault.recovery = "inplace": a fresh trainer per membership generation, the
# earlier one left without closing its sinks); it goes on with the sink it has, so the tracker
# run goes on, and W&B, which holds one run per process, is never asked for a second.
_OPEN: dict[tuple[str, Path], TrackerSink] = {}


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


def setup_of(cfg: Config) -> Setup:
    run_dir = local_run_dir(cfg.run.dir, cfg.run.local_dir).resolve()  # this machine's
    # The run folder itself: a store's (trackers.json there: a resume on any machine reads it).
    folder = location(cfg.run.dir) if scheme_of(cfg.run.dir) else run_dir
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
        folder=folder,
        name=folder.name,
        params=params,
        project=cfg.metrics.project,
        tags=tuple(cfg.metrics.tags),
        tracking_uri=cfg.metrics.tracking_uri,
    )


def open_trackers(cfg: Config, continuing: bool) -> list[TrackerSink]:
    """Rank 0's tracker sinks, one per name in ``metrics.trackers``; ``continuing`` (a resume,
    a restart) goes on with the tracker runs the run folder names."""
    if not cfg.metrics.trackers:
        return []
    setup = setup_of(cfg)
    sinks = []
    for name in cfg.metrics.trackers:
        held = _OPEN.get((name, setup.run_dir))
        if held is not None and not held.closed:
            sinks.append(held)
            continue
        tracker: Tracker
        if name == "wandb":
            from dtrain.metrics.trackers.wandb_run import WandbTracker

            tracker = WandbTracker(setup)
        else:
            from dtrain.metrics.trackers.mlflow_run import MlflowTracker

            tracker = MlflowTracker(setup)
        sink = TrackerSink(tracker, setup.folder, continuing)
        _OPEN[(name, setup.run_dir)] = sink
        sinks.append(sink)
    return sinks
