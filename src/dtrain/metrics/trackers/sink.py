"""One experiment tracker as a sink of rank 0 on a thread (:class:`TrackerSink`, W&B's): the
step's path only turns a record into numbers and queues them; the tracker's calls run on the
sink's own thread, in batches, so no step ever waits for a tracker. A tracker whose client is
heavy Python logs from a process of its own instead
(:mod:`~dtrain.metrics.trackers.process_sink`), which shares the helpers at the end of this
module.

A tracker that fails costs its own records, never the run: one warning, and the sink takes no
more records. Each tracker's run id is kept in ``trackers.json`` (:data:`RUN_IDS`) so a resume
goes on in the same tracker run (docs/observability.md, "Experiment trackers").
"""

from __future__ import annotations

import json
import queue
import threading
from typing import Any

from dtrain.checkpoint import layout
from dtrain.checkpoint.store import write_whole
from dtrain.console import say_line
from dtrain.metrics.trackers.rows import Final, Row, Tracker, failure, summary_of, to_row
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


class TrackerSink:
    """A :class:`~dtrain.metrics.sinks.Sink` in front of one tracker; see the module
    docstring."""

    def __init__(self, tracker: Tracker, run_dir: Location, continuing: bool) -> None:
        self.tracker = tracker
        self.name = tracker.name
        self.run_dir = run_dir
        # A new run (step 0, first attempt) starts a new tracker run even where an old one's
        # id is in the folder: that one belongs to the training the new run replaces.
        self.stored = read_run_ids(run_dir).get(tracker.name) if continuing else None
        self.final = Final()
        self.dropped = 0
        self._warn = OnceWarning()
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
            self.final.state, self.final.summary = summary_of(record)
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
            write_run_id(self.run_dir, self.tracker.name, self.tracker.start(self.stored))
            again = "goes on in" if self.stored else "logs to"
            say_line(f"dtrain: {self.tracker.name} {again} {self.tracker.where}")
            while True:
                closing = self._closing.wait(FLUSH_S)
                if rows := self._drain():
                    self.tracker.log(rows)
                if closing:
                    self.tracker.finish(self.final)
                    return
        except Exception as exc:  # any failure of the tracker's own code: its records only
            self.failed.set()
            self._warn(failure(self.tracker.name, self.tracker.where, exc))
            self._drain()  # free what was queued

    def _drain(self) -> list[Row]:
        rows: list[Row] = []
        while True:
            try:
                rows.append(self._queue.get_nowait())
            except queue.Empty:
                return rows


class OnceWarning:
    """One warning per tracker and process, whatever goes wrong after it (from the step's
    path, the sink's thread or its reader): a tracker that fails on every call says so once."""

    def __init__(self) -> None:
        self.given = False
        self._lock = threading.Lock()

    def __call__(self, text: str) -> None:
        with self._lock:
            if self.given:
                return
            self.given = True
        say_line(f"dtrain: warning: tracker {text}")


# -- RUN_DIR/trackers.json ---------------------------------------------------------------

_IDS_LOCK = threading.Lock()  # the sinks' threads each update their own entry


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
        write_whole(run_dir / RUN_IDS, json.dumps(every, indent=1, sort_keys=True) + "\n")


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
