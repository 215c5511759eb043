"""Where ``train.profile``'s traces lie in a run folder, and reading that list back (for
``dtrain report``): ``RUN_DIR/traces/rank<R>-steps<A>-<B>.json``, one Chrome/Perfetto trace per
rank and profiled window (for a run folder in an object store, each rank writes its traces to its
``run.local_dir`` and uploads them at checkpoints and at the end: :mod:`dtrain.train.profile`).
Imports no torch: the report lists traces without it."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from dtrain.checkpoint.publish import origin_of
from dtrain.storage.objects import Location, ObjectPath, location

TRACES_DIR = "traces"
_NAME = re.compile(r"rank(\d+)-steps(\d+)-(\d+)\.json")


def trace_path(run_dir: Path, rank: int, first: int, last: int) -> Path:
    """The trace of ``rank`` for steps ``first`` to ``last``."""
    return run_dir / TRACES_DIR / f"rank{rank}-steps{first}-{last}.json"


@dataclass(frozen=True)
class Trace:
    """One rank's trace of a window of steps."""

    path: Location
    rank: int
    first: int
    last: int
    size: int  # bytes

    @property
    def steps(self) -> str:
        return f"{self.first}-{self.last}" if self.last != self.first else str(self.first)


def list_traces(run_dir: Path) -> list[Trace]:
    """The traces in ``run_dir`` (in a local copy of a store's records: those in the store),
    by window then rank; files of other names (a trace being written is ``.tmp-...``) are not
    traces."""
    found = []
    origin = origin_of(run_dir)
    folder = (location(origin) if origin else run_dir) / TRACES_DIR
    for path in folder.iterdir() if folder.is_dir() else ():
        match = _NAME.fullmatch(path.name)
        # In a store a trace's name is an object's (an upload is whole or absent).
        if match and (isinstance(path, ObjectPath) or path.is_file()):
            rank, first, last = map(int, match.groups())
            found.append(Trace(path, rank, first, last, path.stat().st_size))
    return sorted(found, key=lambda t: (t.first, t.last, t.rank))
