"""The launcher's words while its rendezvous waits for the other machines of a job.

torch's c10d rendezvous waits in silence: a machine started alone (the others not started yet,
or refused: another ``--run-id``, ``--nnodes``, a config file they lack) printed nothing until
its join timeout, and then a bare ``RendezvousTimeoutError``. Here a rendezvous that has not
completed after :data:`NOTICE_AFTER_S` says once what it waits for and until when; one that
times out is one line naming what every machine must share (:func:`timed_out_words`).
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable
from typing import Any

NOTICE_AFTER_S = 5.0  # a rendezvous of machines started together completes well within this


def waiting_words(endpoint: str, run_id: str, nnodes: str, timeout_s: int) -> str:
    return (
        f"dtrain: waiting for the other machines of job {run_id!r} at {endpoint} (--nnodes "
        f"{nnodes}); giving up after {timeout_s}s. Start `dtrain train` on each with the same "
        "--nnodes, --run-id and --rdzv-endpoint"
    )


def timed_out_words(endpoint: str, run_id: str, nnodes: str, timeout_s: int) -> str:
    return (
        f"--rdzv-endpoint {endpoint}: the machines of job {run_id!r} (--nnodes {nnodes}) did "
        f"not all join within {timeout_s}s (--rdzv-timeout): start `dtrain train` on every "
        "machine with the same --nnodes, --run-id and --rdzv-endpoint (a machine that refused "
        "to start says why on its own console)"
    )


def announce_waits(
    handler: Any,
    words: str,
    after_s: float = NOTICE_AFTER_S,
    say: Callable[[str], None] | None = None,
) -> None:
    """Wrap ``handler.next_rendezvous`` (a torch ``RendezvousHandler``) so that each call still
    waiting after ``after_s`` prints ``words`` once (to stderr by default)."""
    inner = handler.next_rendezvous
    speak = say if say is not None else _to_stderr

    def next_rendezvous() -> Any:
        timer = threading.Timer(after_s, speak, args=(words,))
        timer.daemon = True
        timer.start()
        try:
            return inner()
        finally:
            timer.cancel()

    handler.next_rendezvous = next_rendezvous


def _to_stderr(text: str) -> None:
    print(text, file=sys.stderr, flush=True)
