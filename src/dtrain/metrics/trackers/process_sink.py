"""A tracker that logs from a process of its own (:class:`ProcessSink`, MLflow's,
:mod:`~dtrain.metrics.trackers.sender`): the step's path only turns a record into one JSON line
written to the process's pipe -- never pickled, never waited for (why: docs/observability.md,
"How a tracker's sink runs").

Falling behind is bounded: what the pipe cannot take at once (its kernel buffer, raised to
:data:`PIPE_BYTES`) waits in this process, up to :data:`PENDING_BYTES`; past that a record is
left out of the tracker (one warning; ``metrics.jsonl`` has them all), so a stuck tracker never
blocks a step nor grows the trainer's memory. The sink's one thread reads the process's replies
(its run's ids, for ``trackers.json``; a failure) and sleeps in a read otherwise.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import subprocess
import sys
import threading
import time
from dataclasses import asdict
from pathlib import Path
from typing import IO, Any

from dtrain.console import say_line
from dtrain.metrics.trackers.rows import Final, Setup, failure, summary_of, to_row
from dtrain.metrics.trackers.sink import (
    CLOSE_TIMEOUT_S,
    OnceWarning,
    newest_checkpoint,
    read_run_ids,
    write_run_id,
)
from dtrain.storage.objects import Location

SENDER = "dtrain.metrics.trackers.sender"
# The pipe's kernel buffer, where Linux lets it be raised (F_SETPIPE_SZ; 1 MiB is an
# unprivileged process's limit by default): a few thousand records.
PIPE_BYTES = 1 << 20
# Lines the pipe could not take yet, held here until it can; past this, records are dropped.
PENDING_BYTES = 8 << 20
# src/, so that the process imports this dtrain whatever the worker's sys.path was made of.
SOURCE_ROOT = str(Path(__file__).resolve().parents[3])


class ProcessSink:
    """A :class:`~dtrain.metrics.sinks.Sink` in front of one tracker's own process; see the
    module docstring."""

    def __init__(self, name: str, setup: Setup, run_dir: Location, continuing: bool) -> None:
        self.name = name
        self.run_dir = run_dir
        self.stored = read_run_ids(run_dir).get(name) if continuing else None
        self.final = Final()
        self.failed = threading.Event()  # set once, with the one warning
        self.started = threading.Event()  # the process opened the tracker's run
        self.where = f"{name}'s process"
        self.dropped = 0  # records left out: the process fell behind
        self.done: dict[str, float] = {}  # the process's counts at its end: rows, CPU seconds
        self.pid = 0
        self._warn = OnceWarning()
        self._pending = bytearray()
        self._broken = False  # the pipe's reader is gone (the reply thread says why)
        self._closed = False
        self._proc: subprocess.Popen[bytes] | None = None
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (SOURCE_ROOT, env.get("PYTHONPATH", "")) if p
        )
        try:
            self._proc = subprocess.Popen(
                [sys.executable, "-m", SENDER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                env=env,
            )  # fmt: skip
        except OSError as exc:
            self.failed.set()
            self._warn(failure(name, self.where, exc))
            return
        assert self._proc.stdin is not None and self._proc.stdout is not None
        self.pid = self._proc.pid
        self.where = f"{name}'s process {self.pid}"
        self._fd = self._proc.stdin.fileno()
        with contextlib.suppress(OSError, AttributeError):  # Linux only; the default else
            import fcntl

            fcntl.fcntl(self._fd, fcntl.F_SETPIPE_SZ, PIPE_BYTES)
        os.set_blocking(self._fd, False)  # a full pipe: the line waits here, not the step
        self._send({"tracker": name, "setup": setup.to_json(), "stored": self.stored})
        self._replies = threading.Thread(
            target=self._read_replies, args=(self._proc.stdout,), name=f"dtrain-{name}",
            daemon=True,
        )  # fmt: skip
        self._replies.start()

    # -- the step's side: never blocks ----------------------------------------------------

    def write(self, record: dict[str, Any]) -> None:
        if self.failed.is_set() or self._broken or self._proc is None:
            return
        if record.get("kind") == "summary":
            self.final.state, self.final.summary = summary_of(record)
            return
        if (row := to_row(record)) is not None:
            self._send({"row": [row.step, row.time, row.values]})

    def _send(self, message: dict[str, Any], *, keep: bool = False) -> None:
        """``message`` as one line to the process, or left out when too much waits already
        (``keep``: the set-up and the final line, which are never left out)."""
        line = (json.dumps(message, separators=(",", ":")) + "\n").encode()
        if not keep and len(self._pending) + len(line) > PENDING_BYTES:
            self.dropped += 1
            if self.dropped == 1:
                self._warn(
                    f"{self.name} falls behind the run ({PENDING_BYTES >> 20} MiB of records "
                    "waiting for its process); records are left out of it until it catches "
                    "up (metrics.jsonl has them all)"
                )
            return
        self._pending += line
        self._push()

    def _push(self) -> None:
        """As much of what waits as the pipe takes now (a line may go in parts: the bytes
        stay in order)."""
        if not self._pending:
            return
        try:
            sent = os.write(self._fd, self._pending)
        except BlockingIOError:
            return
        except OSError:  # the process is gone: the reply thread gives the warning
            self._broken = True
            self._pending.clear()
            return
        del self._pending[:sent]

    # -- the end ---------------------------------------------------------------------------

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """The last lines and the run's end to the process, then end of input; wait up to
        :data:`CLOSE_TIMEOUT_S` for it to finish the tracker's run, else end it."""
        if self._closed or self._proc is None:
            self._closed = True
            return
        self._closed = True
        deadline = time.monotonic() + CLOSE_TIMEOUT_S
        if not self.failed.is_set() and not self._broken:
            self.final.checkpoint = newest_checkpoint(self.run_dir)
            self._send({"final": asdict(self.final)}, keep=True)
            while self._pending and not self._broken and time.monotonic() < deadline:
                select.select([], [self._fd], [], max(0.0, deadline - time.monotonic()))
                self._push()
        with contextlib.suppress(OSError):
            assert self._proc.stdin is not None
            self._proc.stdin.close()  # end of input: the process finishes and exits
        self._replies.join(max(0.0, deadline - time.monotonic()))
        try:
            self._proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            self.failed.set()  # before the kill: the reply thread then says nothing of it
            self._proc.kill()
            self._proc.wait()
            self._warn(
                f"{self.name} did not finish its run within {CLOSE_TIMEOUT_S:.0f} s; its "
                "last records may be missing from it (metrics.jsonl has them all)"
            )

    # -- the reply thread ------------------------------------------------------------------

    def _read_replies(self, replies: IO[bytes]) -> None:
        """The process's messages until it exits: its run's ids into ``trackers.json``, a
        failure as the one warning; its end without a word as a failure too."""
        for line in replies:
            try:
                message = json.loads(line)
            except ValueError:
                continue  # not a message (the process's own output goes to stderr)
            if "started" in message:
                self.where = str(message["where"])
                try:
                    write_run_id(self.run_dir, self.name, message["started"])
                except Exception as exc:  # the run folder's store: the tracker's records only
                    self._fail(failure(self.name, str(self.run_dir), exc))
                    assert self._proc is not None
                    self._proc.kill()
                    break
                again = "goes on in" if self.stored else "logs to"
                say_line(f"dtrain: {self.name} {again} {self.where}")
                self.started.set()
            elif "failed" in message:
                self._fail(str(message["failed"]))
            elif "done" in message:
                self.done = {k: float(v) for k, v in message["done"].items()}
        replies.close()
        assert self._proc is not None
        try:
            code = self._proc.wait(CLOSE_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            return  # close() ends it
        if not self.done and not self.failed.is_set():
            self._fail(
                f"{self.name}'s process {self.pid} ended (exit code {code}) before the run "
                "did; training goes on without it (metrics.jsonl has every record)"
            )

    def _fail(self, text: str) -> None:
        self.failed.set()
        self._warn(text)
