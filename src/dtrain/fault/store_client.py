"""The watchdog's client of the job's store: connecting to the launcher's store, and every call
to it bounded in time, so that a store whose host is stopped or cut off never hangs a rank.
The records it reads are sealed with the job's secret (:mod:`dtrain.dist.sealed_store`)."""

from __future__ import annotations

import datetime
import os
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

import torch.distributed as dist

from dtrain.dist import sealed_store

T = TypeVar("T")


def connect_store(timeout_s: float, connect_s: float | None = None) -> Any:
    """A client of the launcher's store (MASTER_ADDR:MASTER_PORT), or None without one (or
    when it cannot be reached within ``connect_s``, default ``timeout_s``); its calls then
    wait up to ``timeout_s``."""
    host, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if not host or not port:
        return None
    try:
        store = dist.TCPStore(  # type: ignore[attr-defined]
            host,
            int(port),
            is_master=False,
            timeout=datetime.timedelta(seconds=connect_s or timeout_s),
            wait_for_workers=False,
        )
    except Exception:
        return None
    store.set_timeout(datetime.timedelta(seconds=timeout_s))
    return store


class StoreTimeout(TimeoutError):
    """The store did not answer in time (its host is stopped, hung or cut off)."""


def bounded(call: Callable[[], T], seconds: float, what: str) -> T:
    """``call()``, given up after ``seconds``. A store client whose server process is stopped
    (SIGSTOP) or whose machine is cut off can block a call forever despite its own timeout; the
    call is left to a daemon thread and this raises :class:`StoreTimeout` instead."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = call()
        except BaseException as exc:  # handed to the caller
            box["error"] = exc

    thread = threading.Thread(target=run, name="watchdog-store-call", daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        raise StoreTimeout(f"no answer to {what} in {seconds:.0f}s")
    if "error" in box:
        raise box["error"]
    return box["value"]


class StoreClient:
    """The job's store, every call bounded in time (:func:`bounded`). Once a call has failed,
    the next ones first try a plain TCP connection to the store's address (quiet): torch's
    client prints a C++ warning, with a stack trace, for every connection or call that fails,
    which a store cut off for minutes would otherwise repeat every few seconds."""

    def __init__(self, store: Any, timeout_s: float) -> None:
        """``store``: a connected client (:func:`connect_store`); ``timeout_s``: the bound
        of a call that names none."""
        self.timeout_s = timeout_s
        self._store = store
        # Set when a call failed or was given up on: a call given up on still holds the
        # client's connection, and a failed one may have broken it; the next call connects
        # afresh, once the address answers.
        self._stuck = False
        self.last_ok: float | None = time.time()  # wall-clock time of the last call answered

    def ask(self, op: Callable[[Any], T], what: str, seconds: float | None = None) -> T:
        """``op(store)``; raises when the store cannot be reached or does not answer."""
        limit = seconds if seconds is not None else self.timeout_s
        if self._stuck:
            host, port = os.environ.get("MASTER_ADDR", ""), os.environ.get("MASTER_PORT", "")
            if host and port.isdigit():
                from dtrain.dist.reachability import OPEN, probe

                state, said = probe(host, int(port), min(limit, 2.0))
                if state != OPEN:
                    raise ConnectionError(f"the job's key-value store at {host}:{port}: {said}")
            fresh = bounded(lambda: connect_store(self.timeout_s), limit, "a new connection")
            if fresh is None:
                raise ConnectionError("cannot connect to the job's key-value store")
            self._store, self._stuck = fresh, False
        store = self._store
        try:
            value = bounded(lambda: op(store), limit, what)
        except Exception:
            self._stuck = True
            raise
        self.last_ok = time.time()
        return value

    def read_many(self, keys: list[str], seconds: float | None = None) -> dict[str, Any]:
        """The JSON records (dicts) sealed at ``keys``, None where there is none (or one that
        fails its seal, or no record: warned once), in one call to the store when all exist
        (``multi_get``), else one per key; a store that cannot be reached raises. What a
        diagnosis reads of every rank costs each rank a few calls, not a few per rank: every
        rank diagnoses at once when a collective fails."""

        def read(store: Any) -> list[bytes | None]:
            if not keys:
                return []
            if store.check(keys):
                return list(store.multi_get(keys))
            return [store.get(key) if store.check([key]) else None for key in keys]

        raws = self.ask(read, f"reading {len(keys)} keys", seconds)
        return {
            key: sealed_store.parse(key, raw, dict) for key, raw in zip(keys, raws, strict=True)
        }

    def read(self, key: str, seconds: float | None = None) -> Any:
        """The JSON record (a dict) sealed at ``key``, or None when there is none (or it fails
        its seal, or is no record: warned once); a store that cannot be reached raises."""

        def read(store: Any) -> bytes | None:
            return store.get(key) if store.check([key]) else None

        return sealed_store.parse(key, self.ask(read, f"reading {key}", seconds), dict)
