"""The console as something that may go away: ``dtrain train ... 2>&1 | head`` closes the pipe
that the launcher's and the workers' output goes to, and a write to it then raises
``BrokenPipeError`` -- in the middle of a step, on rank 0, at every restart attempt (and a
console redirected to a file on a full disk raises ``OSError`` the same way).

Losing the console loses the console, never the run: :func:`guard_console` wraps
``sys.stdout`` and ``sys.stderr`` so that the first write that finds its pipe closed points
that stream at ``/dev/null`` (what is still buffered, and every later write, goes there; so
does anything torch writes to the same file descriptor) and says so once on the other stream,
when that one still works. The run's record is its folder (``metrics.jsonl``, ``status.json``,
the checkpoints), which this does not touch.
"""

from __future__ import annotations

import contextlib
import io
import os
import sys
from typing import Any, TextIO


class GuardedStream(io.TextIOBase):
    """A text stream whose writes never raise for a closed pipe (see the module's doc)."""

    def __init__(self, inner: TextIO, name: str, who: str) -> None:
        self.inner = inner
        self.name = name
        self.who = who
        self.gone = False
        self.partner: GuardedStream | None = None  # the other stream, for the one warning

    def write(self, text: str) -> int:
        if not self.gone:
            try:
                self.inner.write(text)
            except OSError as exc:
                self._lost(exc)
        return len(text)

    def flush(self) -> None:
        if not self.gone:
            try:
                self.inner.flush()
            except OSError as exc:
                self._lost(exc)

    def _lost(self, error: OSError) -> None:
        # A closed pipe, a terminal that went away, a log file's full disk: none of them is
        # worth a step of training.
        self.gone = True
        point_at_devnull(self.inner)
        partner = self.partner
        if partner is not None and not partner.gone:
            partner.write(
                f"dtrain: warning: {self.who}: its {self.name} is closed ({error.strerror}); "
                "training goes on, its record is in the run folder (metrics.jsonl)\n"
            )
            partner.flush()

    def isatty(self) -> bool:
        return not self.gone and self.inner.isatty()

    def fileno(self) -> int:
        return self.inner.fileno()

    def writable(self) -> bool:
        return True

    @property
    def encoding(self) -> str:  # type: ignore[override]
        return self.inner.encoding

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def guard_console(who: str) -> None:
    """Wrap this process's ``sys.stdout`` and ``sys.stderr`` (once); ``who`` names the process
    in the warning (``rank 3``, ``the launcher``)."""
    if isinstance(sys.stdout, GuardedStream) or sys.stdout is None or sys.stderr is None:
        return
    out = GuardedStream(sys.stdout, "output", who)
    err = GuardedStream(sys.stderr, "error output", who)
    out.partner, err.partner = err, out
    sys.stdout, sys.stderr = out, err


def say_line(text: str) -> None:
    """``TEXT`` and its newline on standard error as one write: the ranks of a machine share
    their launcher's pipe, and ``print`` writes the text and its newline apart, so two ranks'
    lines could run together (a progress line and another rank's error did, in a test)."""
    sys.stderr.write(f"{text}\n")
    sys.stderr.flush()


def say_error(message: str) -> None:
    """``dtrain: error: MESSAGE`` on standard error, as one write (:func:`say_line`)."""
    say_line(f"dtrain: error: {message}")


def drop_stdout() -> None:
    """After a write found ``sys.stdout``'s reader gone (``dtrain status RUN | head -3``):
    point it at ``/dev/null``, so that the interpreter's last flush of what is still buffered
    raises nothing either."""
    point_at_devnull(sys.stdout)


def point_at_devnull(stream: TextIO) -> None:
    """Make ``stream``'s file descriptor write to ``/dev/null`` (where it has one)."""
    with contextlib.suppress(OSError, ValueError, io.UnsupportedOperation):
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, stream.fileno())
        os.close(devnull)
