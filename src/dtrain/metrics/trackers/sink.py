"""One experiment tracker as a sink of rank 0 (:class:`TrackerSink`): the step's path only turns
a record into numbers and queues them; the tracker's calls (a network round trip, an SQL insert)
run on the sink's own thread, in batches, so no step ever waits for a tracker.

A tracker that fails -- no server, a store it cannot write, a full disk, a call that raises --
costs its own records, never the run: one warning, and the sink takes no more records.
``metrics.jsonl`` keeps every record whatever the trackers do.

What identifies each tracker's run is kept in ``RUN_DIR/trackers.json`` (:data:`RUN_IDS`), so a
resumed or restarted run goes on logging to the same tracker run; for a run folder in an object
store, in the store's folder (one object, replaced whole), so that a resume on another machine
goes on with it too.
"""

from __future__ import annotations

import json
import math
import os
import queue
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from dtrain.checkpoint import layout
from dtrain.checkpoint.store import write_whole
from dtrain.storage.objects import Location

RUN_IDS = "trackers.json"

# The thread sends what queued up at most this often: one batch per interval rather than one
# call per record keeps a tracker's CPU time (which shares the GIL with the step) small.
FLUSH_S = 1.0
# Records the queue holds while a tracker is slow (a server far away); past this, records are
# dropped from the tracker (said once) rather than held in memory without bound.
QUEUE_RECORDS = 20_000
# How long closing waits for a tracker to send its last records and finish its run; a tracker
# stuck on its network is then left behind (its thread is a daemon) with a warning.
CLOSE_TIMEOUT_S = 60.0

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
    """What every tracker is told about the run (from the config, on rank 0)."""

    run_dir: Path  # this machine's folder of the run (the trackers' own files go there)
    folder: Location  # the run folder itself (trackers.json, the checkpoints): maybe a store's
    name: str  # the run folder's name
    params: dict[str, Any]  # the config, flattened: "train.lr" -> 0.5
    project: str  # metrics.project; empty = the tracker's environment variable or default
    tags: tuple[str, ...]  # metrics.tags, each "name" or "key=value"
    tracking_uri: str  # metrics.tracking_uri (MLflow)


class Tracker(Protocol):
    """One tracker's calls, all made on the sink's thread."""

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
    the thread never reads a record its writer might still hold."""
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


def is_number(value: Any) -> bool:
    return (
        isinstance(value, (int, float))
        and not isinstance(value, bool)
        and math.isfinite(float(value))
    )


class TrackerSink:
    """A :class:`~dtrain.metrics.sinks.Sink` in front of one tracker; see the module
    docstring."""

    def __init__(self, tracker: Tracker, run_dir: Location, continuing: bool) -> None:
        self.tracker = tracker
        self.run_dir = run_dir
        # A new run (step 0, first attempt) starts a new tracker run even where an old one's
        # id is in the folder: that one belongs to the training the new run replaces.
        self.stored = read_run_ids(run_dir).get(tracker.name) if continuing else None
        self.final = Final()
        self.dropped = 0
        self.warned = False
        self.failed = threading.Event()  # set once, with the one warning
        self._queue: queue.Queue[Row] = queue.Queue(maxsize=QUEUE_RECORDS)
        self._closing = threading.Event()
        self._thread = threading.Thread(
            target=self._run, name=f"dtrain-{tracker.name}", daemon=True
        )
        self._thread.start()

    # -- the step's side: never blocks ----------------------------------------------------

    def write(self, record: dict[str, Any]) -> None:
        if self.failed.is_set():
            return
        if record.get("kind") == "summary":
            self.final.state = str(record.get("state") or "")
            self.final.summary = {
                k: float(v) for k, v in record.items() if k != "step" and is_number(v)
            }
            return
        row = to_row(record)
        if row is None:
            return
        try:
            self._queue.put_nowait(row)
        except queue.Full:
            self.dropped += 1
            if self.dropped == 1:
                self._warn(
                    f"{self.tracker.name} falls behind the run ({QUEUE_RECORDS} records "
                    "queued); records are left out of it until it catches up (metrics.jsonl "
                    "has them all)"
                )

    @property
    def closed(self) -> bool:
        return self._closing.is_set()

    def close(self) -> None:
        self.final.checkpoint = newest_checkpoint(self.run_dir)
        self._closing.set()
        self._thread.join(CLOSE_TIMEOUT_S)
        if self._thread.is_alive():
            self.failed.set()
            self._warn(
                f"{self.tracker.name} did not finish its run within {CLOSE_TIMEOUT_S:.0f} s; "
                "its last records may be missing from it (metrics.jsonl has them all)"
            )

    # -- the sink's thread ----------------------------------------------------------------

    def _run(self) -> None:
        try:
            ids = self.tracker.start(self.stored)
            write_run_id(self.run_dir, self.tracker.name, ids)
            again = "goes on in" if self.stored else "logs to"
            print(f"dtrain: {self.tracker.name} {again} {self.tracker.where}", file=sys.stderr)
            while True:
                closing = self._closing.wait(FLUSH_S)
                rows = self._drain()
                if rows:
                    self.tracker.log(rows)
                if closing:
                    self.tracker.finish(self.final)
                    return
        except Exception as exc:  # any failure of the tracker's own code: its records only
            self.failed.set()
            self._warn(
                f"{self.tracker.name} failed ({self.tracker.where}: {type(exc).__name__}: "
                f"{first_line(exc)}); "
                "training goes on without it (metrics.jsonl has every record)"
            )
            self._drain()  # free what was queued

    def _warn(self, text: str) -> None:
        """One warning per tracker and process, whatever goes wrong after it: a tracker that
        fails on every call says so once."""
        with _WARN_LOCK:
            if self.warned:
                return
            self.warned = True
        print(f"dtrain: warning: tracker {text}", file=sys.stderr, flush=True)

    def _drain(self) -> list[Row]:
        rows: list[Row] = []
        while True:
            try:
                rows.append(self._queue.get_nowait())
            except queue.Empty:
                return rows


def first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0][:300] if text else "no message"


# -- RUN_DIR/trackers.json ---------------------------------------------------------------

_IDS_LOCK = threading.Lock()  # the sinks' threads each update their own entry
_WARN_LOCK = threading.Lock()


def read_run_ids(run_dir: Location) -> dict[str, dict[str, Any]]:
    """Each tracker's run as the folder's last run opened it; empty when there is none (or the
    file is unreadable: a new tracker run then, never a stopped training)."""
    try:
        ids = json.loads((run_dir / RUN_IDS).read_text())
    except (OSError, ValueError):
        return {}
    return {k: v for k, v in ids.items() if isinstance(v, dict)} if isinstance(ids, dict) else {}


def write_run_id(run_dir: Location, name: str, ids: dict[str, Any]) -> None:
    """``ids`` as ``name``'s entry, written whole to a temporary file and renamed over the old
    one (in a store: one request), so a crash leaves the old file or the new one."""
    with _IDS_LOCK:
        every = {**read_run_ids(run_dir), name: ids}
        path = run_dir / RUN_IDS
        if not isinstance(path, Path):
            write_whole(path, json.dumps(every, indent=1, sort_keys=True) + "\n")
            return
        tmp = path.with_name(f".{RUN_IDS}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(every, indent=1, sort_keys=True) + "\n")
        os.replace(tmp, path)


def newest_checkpoint(run_dir: Location) -> str | None:
    """The newest complete checkpoint's folder, absolute; None before the first, or where the
    folder cannot be listed (the trackers then go without the path: the run's end must not
    fail on it)."""
    root = run_dir / "checkpoints"
    try:
        steps = layout.committed_steps(root) if root.is_dir() else []
    except (OSError, ValueError):
        return None
    return str((root / layout.step_dir_name(max(steps))).resolve()) if steps else None
