"""A tracker's own process (``python -m dtrain.metrics.trackers.sender``), which rank 0's
:class:`~dtrain.metrics.trackers.process_sink.ProcessSink` starts: it owns the tracker's client
and makes every call of it, so the client's Python never holds the training process's
interpreter lock (why, and how it ends: docs/observability.md, "Experiment trackers").

Plain data both ways, one JSON object per line, nothing pickled. On its standard input: the
first line names the tracker, its :class:`~dtrain.metrics.trackers.rows.Setup` and the stored
run to go on with; then ``{"row": [step, time, values]}`` per record, and ``{"final": ...}``
when the run closes its sinks. On its standard output: ``{"started": ids, "where": text}``
once the tracker's run is open, ``{"failed": warning}`` if the tracker raised, ``{"done":
counts}`` at the end. Anything the tracker's own code prints goes to standard error.

End of input or a new parent process (the pipe held open by a process the trainer forked)
without the ``final`` line means the trainer died: the run is ended as failed within
:data:`ORPHAN_S` seconds. SIGINT and SIGTERM are ignored: the worker decides when the run ends.
"""

from __future__ import annotations

import json
import os
import select
import signal
import sys
import threading
import time
from typing import Any, TextIO

from dtrain.metrics.trackers.rows import Final, Row, Setup, Tracker, failure

# The process sends what it read at most this often: one batch (one SQL transaction, one HTTP
# request) per interval rather than one per record.
FLUSH_S = 1.0
# With its training process gone, the tracker's last calls get this long (a server that does
# not answer), then the process ends.
ORPHAN_S = 30.0
READ_BYTES = 1 << 16


def make_tracker(name: str, setup: Setup) -> Tracker:
    """The tracker called ``name`` (one of ``metrics.trackers``), its package imported now."""
    if name == "wandb":
        from dtrain.metrics.trackers.wandb_run import WandbTracker

        return WandbTracker(setup)
    from dtrain.metrics.trackers.mlflow_run import MlflowTracker

    return MlflowTracker(setup)


class Lines:
    """Complete lines from a file descriptor, as they arrive."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.ended = False
        self.backlog: list[dict[str, Any]] = []  # read, not yet handed out
        self._tail = b""

    def read(self, timeout: float) -> list[dict[str, Any]]:
        """What arrived within ``timeout`` seconds (nothing when nothing did); ``ended`` once
        the writer closed its end."""
        backlog, self.backlog = self.backlog, []
        if backlog:
            return backlog
        ready, _, _ = select.select([self.fd], [], [], max(0.0, timeout))
        if not ready:
            return []
        chunk = os.read(self.fd, READ_BYTES)
        if not chunk:
            self.ended = True
            return []
        *whole, self._tail = (self._tail + chunk).split(b"\n")
        return [json.loads(line) for line in whole if line]


def send(out: TextIO, message: dict[str, Any]) -> None:
    out.write(json.dumps(message) + "\n")
    out.flush()


def serve(
    tracker: Tracker, stored: dict[str, Any] | None, lines: Lines, out: TextIO, parent: int
) -> None:
    """Open the tracker's run, send it the rows as they come, in batches, and end it."""
    send(out, {"started": tracker.start(stored), "where": tracker.where})
    rows: list[Row] = []
    final: Final | None = None
    count, log_cpu = 0, 0.0
    due = time.monotonic() + FLUSH_S

    def take(messages: list[dict[str, Any]]) -> None:
        nonlocal final
        for message in messages:
            if "row" in message:
                step, when, values = message["row"]
                rows.append(Row(int(step), float(when), values))
            elif "final" in message:
                final = Final(**message["final"])

    while True:
        take(lines.read(due - time.monotonic()))
        if final is None and not lines.ended and os.getppid() != parent:
            # The trainer died with the pipe held open elsewhere: what it wrote before it
            # died is still in the pipe, to be read to its end.
            while more := lines.read(0.0):
                take(more)
            lines.ended = True
        # The final line ends the run, whoever else holds the pipe open (a process the trainer
        # forked after starting this one keeps its end of the pipe: no end of input then).
        ending = final is not None or lines.ended
        if ending and final is None:  # the training process died without closing its sinks
            final = Final(state="failed")
        if rows and (ending or time.monotonic() >= due):
            began = time.process_time()
            tracker.log(rows)
            log_cpu += time.process_time() - began
            count += len(rows)
            rows = []
        if time.monotonic() >= due:
            due = time.monotonic() + FLUSH_S
        if ending:
            assert final is not None
            tracker.finish(final)
            send(out, {"done": {"rows": count, "log_cpu_s": log_cpu, "cpu_s": time.process_time()}})
            return


def main() -> None:
    # The worker's group gets Ctrl-C and the launcher's SIGTERM; the worker closes the pipe.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    # The messages keep standard output's pipe; whatever else would print there goes to
    # standard error, so no tracker's line can cut into a message.
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    parent = os.getppid()
    threading.Thread(target=watch_parent, args=(parent,), daemon=True).start()
    lines = Lines(0)
    first: list[dict[str, Any]] = []
    while not first and not lines.ended:
        first = lines.read(FLUSH_S)
    if not first:
        return
    head, lines.backlog = first[0], first[1:]  # rows may come in the set-up's read
    name, where = str(head["tracker"]), "its process"
    try:
        tracker = make_tracker(name, Setup.from_json(head["setup"]))
        where = tracker.where
        serve(tracker, head.get("stored"), lines, out, parent)
    except Exception as exc:  # the tracker's own failure: the training process says it once
        send(out, {"failed": failure(name, where, exc)})


def watch_parent(parent: int) -> None:
    """End the process :data:`ORPHAN_S` seconds after its training process is gone, whatever
    the main thread is doing: no tracker process outlives its run for long."""
    while os.getppid() == parent:
        time.sleep(1.0)
    time.sleep(ORPHAN_S)
    os._exit(3)


if __name__ == "__main__":
    main()
