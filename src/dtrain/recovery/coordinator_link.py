"""A member's or a launcher's connection to the membership store (``fault.recovery =
'inplace'``), made to ride through an outage of the network between machines.

Across machines the store lives in the launcher of ``--node-rank 0``; a host whose link goes
down for a while must neither hang nor give up on it. torch's ``TCPStore`` client does
neither well alone: a call to a store that is cut off can block past the client's own
timeout, and a call that timed out leaves its request on the connection, so the next call
could read the answer meant for it. So every call here is bounded in time
(:func:`dtrain.fault.store_client.bounded`), and after any failed or abandoned call the
client is dropped and a fresh connection made -- but only once a plain TCP connection to the
store's address succeeds (quietly: torch's client prints a C++ stack trace for each failed
attempt). :meth:`StoreLink.call` retries so until the store answers or ``patience_s`` has
passed since the first failure.
"""

from __future__ import annotations

import datetime
import functools
import time
from collections.abc import Callable
from typing import Any, TypeVar

import torch.distributed as dist

from dtrain.dist.reachability import OPEN, REFUSED, probe
from dtrain.errors import UserError
from dtrain.fault.store_client import bounded

T = TypeVar("T")

RETRY_S = 0.2  # between attempts while the store cannot be reached


# How long the store's address may refuse connections before the store counts as gone: the
# machine answers and nothing listens there, so the launcher that hosted it has ended (its
# membership state with it: nothing to wait for).
REFUSED_S = 5.0


class StoreUnreachable(UserError):
    """The membership store did not answer for the whole patience, or is gone; one line (a
    lost machine, not a bug: restart mode's lost rendezvous host is one line too)."""


def open_store(host: str, port: int, timeout_s: float) -> Any:
    """A client of the membership store at ``host:port``."""
    return dist.TCPStore(  # type: ignore[attr-defined]
        host,
        port,
        is_master=False,
        timeout=datetime.timedelta(seconds=timeout_s),
        wait_for_workers=False,
    )


class StoreLink:
    """A client of the store at ``host:port`` that reconnects after a failure.

    ``call_s``: the bound of one call (its client's own timeout too); ``patience_s``: how long
    :meth:`call` retries before it raises :class:`StoreUnreachable`."""

    def __init__(self, host: str, port: int, call_s: float, patience_s: float) -> None:
        self.host, self.port = host, port
        self.call_s = call_s
        self.patience_s = patience_s
        self._client: Any = None
        self.outages = 0  # how many times a call found the store unreachable (for the tests)
        self._client = self._connect(patience_s)

    @property
    def client(self) -> Any:
        """The connected client now (for what needs a store object: a process group's
        rendezvous); a failed call replaces it."""
        if self._client is None:
            self._client = self._connect(self.patience_s)
        return self._client

    def _connect(self, patience_s: float) -> Any:
        deadline = time.monotonic() + patience_s
        said, refused_since = "", None
        while True:
            state, said = probe(self.host, self.port, min(2.0, self.call_s))
            refused_since = (refused_since or time.monotonic()) if state == REFUSED else None
            if refused_since is not None and time.monotonic() - refused_since >= REFUSED_S:
                raise StoreUnreachable(
                    f"lost the membership coordinator at {self.host}:{self.port}: it refuses "
                    f"connections ({said}): the `dtrain train` with --node-rank 0 that hosted "
                    "it has ended or was killed; start `dtrain train` again on every machine "
                    "(the job resumes from its newest checkpoint)"
                )
            if state == OPEN:
                try:
                    return bounded(
                        lambda: open_store(self.host, self.port, self.call_s),
                        self.call_s + 1.0,
                        "a new connection",
                    )
                except Exception as exc:
                    said = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            if time.monotonic() >= deadline:
                raise StoreUnreachable(
                    f"the membership store at {self.host}:{self.port} did not answer for "
                    f"{patience_s:g}s: {said}"
                )
            time.sleep(RETRY_S)

    def call(self, op: Callable[[Any], T], what: str) -> T:
        """``op(client)``, retried on fresh connections until it succeeds; raises
        :class:`StoreUnreachable` after ``patience_s`` without an answer."""
        deadline = time.monotonic() + self.patience_s
        while True:
            client = self.client
            try:
                return bounded(functools.partial(op, client), self.call_s, what)
            except Exception:
                self.outages += 1
                self._client = None  # a call given up on may still hold the connection
                left = deadline - time.monotonic()
                if left <= 0:
                    raise StoreUnreachable(
                        f"the membership store at {self.host}:{self.port} did not answer "
                        f"{what} for {self.patience_s:g}s"
                    ) from None
                time.sleep(RETRY_S)
                self._client = self._connect(left)
