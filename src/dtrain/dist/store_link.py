"""The one client of a job's key-value store that neither hangs nor gives up too early: the
watchdog's (the job's store, read when a collective fails) and in-place recovery's (the
membership store, across machines) alike.

torch's ``TCPStore`` client does neither well alone: a call to a store whose host is stopped
(SIGSTOP) or cut off can block past the client's own timeout, and a call that timed out leaves
its request on the connection, so the next call could read the answer meant for it. So every
call here is bounded in time (:func:`bounded`), and after any failed or abandoned call the
client is dropped and a fresh connection made -- but only once a plain TCP connection to the
store's address succeeds (quietly: torch's client prints a C++ stack trace for each failed
attempt, which a store cut off for minutes would repeat every few seconds).

``patience_s`` says how long :meth:`StoreLink.call` retries: the membership's calls wait out
an outage of the network (minutes); the watchdog's have none (0: one try, its own error
raised, the next call reconnects), since it reports what it cannot read instead.
"""

from __future__ import annotations

import datetime
import functools
import os
import queue
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

from dtrain.dist import sealed_store
from dtrain.dist.reachability import OPEN, REFUSED, probe
from dtrain.dist.stores import client_store
from dtrain.errors import UserError

T = TypeVar("T")

RETRY_S = 0.2  # between attempts while the store cannot be reached

# How long the store's address may refuse connections before the store counts as gone: the
# machine answers and nothing listens there, so the launcher that hosted it has ended (its
# membership state with it: nothing to wait for).
REFUSED_S = 5.0


class StoreTimeout(TimeoutError):
    """The store did not answer in time (its host is stopped, hung or cut off)."""


class StoreUnreachable(UserError):
    """The store did not answer for the whole patience, or is gone; one line (a lost machine,
    not a bug: restart mode's lost rendezvous host is one line too)."""


# The threads inside a store call now: each call's own thread, and the thread waiting for it
# in :func:`bounded` (a worker's exit does not wait for them: :func:`in_store_calls`).
_in_calls: set[threading.Thread] = set()
_in_calls_lock = threading.Lock()


# The links' threads that make their calls (:class:`_Caller`): idle, or in a call.
_callers: set[threading.Thread] = set()


def in_store_calls() -> set[threading.Thread]:
    """The threads in a store call now, or waiting for one, and the links' callers: each ends
    at the call's bound at the latest, or is left to end with its process (a call given up
    on; an idle caller needs nothing at exit)."""
    with _in_calls_lock:
        return _in_calls | _callers


class _Caller:
    """One daemon thread that makes a link's calls, one at a time, each bounded as
    :func:`bounded` bounds one: a thread started for every call cost each call about 50 us of
    CPU and two more hand-offs of the interpreter's lock (thousands of calls a second when
    every rank diagnoses at once). A call that overran its bound leaves this thread stuck in
    it: the link then takes a new caller, and this one ends once its call returns."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self.busy = False  # in a call (one given up on may never return)
        self.thread = threading.Thread(target=self._run, name="dtrain-store-call", daemon=True)
        with _in_calls_lock:
            _callers.add(self.thread)
        self.thread.start()

    def _run(self) -> None:
        try:
            while (job := self._jobs.get()) is not None:
                self.busy = True
                job()
                self.busy = False
        finally:
            with _in_calls_lock:
                _callers.discard(self.thread)

    def close(self) -> None:
        """End the thread once the calls handed to it are made."""
        self._jobs.put(None)

    def call(self, fn: Callable[[], T], seconds: float, what: str) -> T:
        """``fn()`` on this thread, given up after ``seconds`` (:class:`StoreTimeout`)."""
        box: dict[str, Any] = {}
        done = threading.Event()

        def job() -> None:
            try:
                box["value"] = fn()
            except BaseException as exc:  # handed to the caller
                box["error"] = exc
            finally:
                done.set()

        waiter = threading.current_thread()
        with _in_calls_lock:
            _in_calls.add(waiter)
        try:
            self._jobs.put(job)
            answered = done.wait(seconds)
        finally:
            with _in_calls_lock:
                _in_calls.discard(waiter)
        if not answered:
            self.close()  # (after the call it is stuck in)
            raise StoreTimeout(f"no answer to {what} in {seconds:.0f}s")
        if "error" in box:
            raise box["error"]
        return box["value"]


def bounded(call: Callable[[], T], seconds: float, what: str) -> T:
    """``call()``, given up after ``seconds``: the call is left to a daemon thread (a blocked
    store call cannot be cancelled) and this raises :class:`StoreTimeout` instead."""
    caller = _Caller()
    try:
        return caller.call(call, seconds, what)
    finally:
        caller.close()


class StoreLink:
    """A client of the store at ``host:port`` that reconnects after a failure.

    ``call_s``: the bound of one call (its client's own timeout too); ``patience_s``: how long
    :meth:`call` retries before it raises :class:`StoreUnreachable` (0: no retry, the call's
    own error is raised); ``connect_s``: the patience of the first connection (default
    ``patience_s``); ``name``: the store, in messages. ``clock`` and ``sleep`` are the
    monotonic time the patience counts in and the wait between attempts (tests pass their
    own)."""

    def __init__(
        self,
        host: str,
        port: int,
        call_s: float,
        patience_s: float,
        *,
        connect_s: float | None = None,
        name: str = "the membership store",
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.host, self.port = host, port
        self.call_s = call_s
        self.patience_s = patience_s
        self.name = name
        self._clock, self._sleep = clock, sleep
        self.outages = 0  # how many times a call found the store unreachable (for the tests)
        self.last_ok: float | None = time.time()  # wall-clock time of the last call answered
        # Since when (``clock``) every call made has gone unanswered: the start of the first
        # call that failed after the last one answered, by any thread (None: the last call
        # was answered). A diagnosis on one thread counts the silence the beats of another
        # already met, instead of waiting it out again (:meth:`silent_s`).
        self._answered_at = clock()
        self._failing_since: float | None = None
        self._silence = threading.Lock()
        self._caller: _Caller | None = None  # the thread that makes the calls
        self._caller_lock = threading.Lock()  # threads sharing the link share one caller
        # The first connection may wait as long as a start-up does (a loaded machine with many
        # ranks answered it in more than the few seconds a call is given).
        first = (patience_s, None) if connect_s is None else (connect_s, connect_s)
        self._client: Any = self._connect(*first)

    @property
    def client(self) -> Any:
        """The connected client now (for what needs a store object: a process group's
        rendezvous); a failed call replaces it."""
        if self._client is None:
            self._client = self._connect(self.patience_s)
        return self._client

    def _connect(self, patience_s: float, wait_s: float | None = None) -> Any:
        """A fresh client, tried until ``patience_s`` has passed; ``wait_s``: how long torch's
        client itself may try (default ``call_s``), its calls then bounded by ``call_s``."""
        deadline = self._clock() + patience_s
        said, refused_since = "", None
        while True:
            state, said = probe(self.host, self.port, min(2.0, self.call_s))
            now = self._clock()
            refused_since = (refused_since or now) if state == REFUSED else None
            if refused_since is not None and now - refused_since >= REFUSED_S:
                raise StoreUnreachable(
                    f"lost the membership coordinator at {self.host}:{self.port}: it refuses "
                    f"connections ({said}): the `dtrain train` with --node-rank 0 that hosted "
                    "it has ended or was killed; start `dtrain train` again on every machine "
                    "(the job resumes from its newest checkpoint)"
                )
            if state == OPEN:
                connect_s = self.call_s if wait_s is None else wait_s
                try:
                    return self._open(connect_s, connect_s + 1.0)
                except Exception as exc:
                    said = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            if self._clock() >= deadline:
                raise StoreUnreachable(
                    f"{self.name} at {self.host}:{self.port} did not answer for "
                    f"{patience_s:g}s: {said}"
                )
            self._sleep(RETRY_S)

    def _open(self, wait_s: float, bound_s: float) -> Any:
        """A fresh client: torch's tries to connect for ``wait_s``, given up after ``bound_s``;
        its calls then wait up to ``call_s``."""
        opening = functools.partial(client_store, self.host, self.port, wait_s)
        client = bounded(opening, bound_s, "a new connection")
        client.set_timeout(datetime.timedelta(seconds=self.call_s))
        return client

    def call(self, op: Callable[[Any], T], what: str, seconds: float | None = None) -> T:
        """``op(client)`` within ``seconds`` (default ``call_s``), retried on fresh connections
        until it succeeds; raises :class:`StoreUnreachable` after ``patience_s`` without an
        answer. Without patience, one try: its own error raised (:class:`StoreTimeout` if none
        came), a lost connection made again within the same bound, once its address answers
        (a plain connection, else :class:`ConnectionError`)."""
        limit = self.call_s if seconds is None else seconds
        started = self._clock()
        if self.patience_s <= 0 and self._client is None:
            try:
                state, said = probe(self.host, self.port, min(limit, 2.0))
                if state != OPEN:
                    raise ConnectionError(f"{self.name} at {self.host}:{self.port}: {said}")
                self._client = self._open(self.call_s, limit)
            except Exception:
                self._unanswered(started)
                raise
        deadline = self._clock() + self.patience_s
        while True:
            client = self.client
            caller = self._take_caller()
            try:
                value = caller.call(functools.partial(op, client), limit, what)
            except Exception as exc:
                self._unanswered(started)
                self.outages += 1
                self._client = None  # a call given up on may still hold the connection
                if isinstance(exc, StoreTimeout):
                    self._drop_caller(caller)  # stuck in that call
                if self.patience_s <= 0:
                    raise
                left = deadline - self._clock()
                if left <= 0:
                    raise StoreUnreachable(
                        f"{self.name} at {self.host}:{self.port} did not answer "
                        f"{what} for {self.patience_s:g}s"
                    ) from None
                self._sleep(RETRY_S)
                self._client = self._connect(left)
                started = self._clock()
                continue
            with self._silence:
                self._answered_at, self._failing_since = self._clock(), None
            self.last_ok = time.time()
            return value

    def close(self) -> None:
        """End the link's caller thread (a finished rank leaves none of ours behind): at once
        when idle; one stuck in a call is left to end with it. A later call takes a new one."""
        with self._caller_lock:
            caller, self._caller = self._caller, None
        if caller is not None:
            caller.close()
            if not caller.busy:
                caller.thread.join(timeout=1.0)

    def _take_caller(self) -> _Caller:
        with self._caller_lock:
            if self._caller is None:
                self._caller = _Caller()
            return self._caller

    def _drop_caller(self, caller: _Caller) -> None:
        """A caller stuck in a call is not handed more (another thread may have dropped it
        and taken a new one already)."""
        with self._caller_lock:
            if self._caller is caller:
                self._caller = None

    def _unanswered(self, started: float) -> None:
        """A call begun at ``started`` got no answer. One begun before the store last
        answered another says nothing of the store since."""
        with self._silence:
            if started >= self._answered_at and (
                self._failing_since is None or started < self._failing_since
            ):
                self._failing_since = started

    def silent_s(self) -> float:
        """For how long every call to the store has gone unanswered (0: the last was
        answered)."""
        with self._silence:
            since = self._failing_since
        return 0.0 if since is None else max(0.0, self._clock() - since)

    def read(self, key: str, seconds: float | None = None, *, present: bool = False) -> Any:
        """The JSON record (a dict) sealed at ``key``, or None when there is none (or it fails
        its seal, or is no record: warned once); ``present``: as :meth:`read_many`."""
        return self.read_many([key], seconds, present=present)[key]

    def read_many(
        self, keys: list[str], seconds: float | None = None, *, present: bool = False
    ) -> dict[str, Any]:
        """The JSON records (dicts) sealed at ``keys``, as :meth:`read`, in one call to the
        store when all exist (``multi_get``), else one per key. What a diagnosis reads of every
        rank costs each rank a few calls, not a few per rank: every rank diagnoses at once when
        a collective fails. ``present``: the caller knows every key is set (it read them
        before, and the job's keys are never removed): the ``multi_get`` alone, one store
        operation, without the ``check`` that keeps a missing key from blocking it until the
        call's bound."""
        if not keys:  # (no call: under load its bound was all it could fail by)
            return {}
        what = f"reading {keys[0]}" if len(keys) == 1 else f"reading {len(keys)} keys"
        raws = self.call(
            lambda store: sealed_store.get_many(store, keys, present=present), what, seconds
        )
        return {
            key: sealed_store.parse(key, raw, dict) for key, raw in zip(keys, raws, strict=True)
        }


def job_store_link(call_s: float, connect_s: float) -> StoreLink | None:
    """A link without patience to the job's store (MASTER_ADDR:MASTER_PORT), or None without
    one, or when it cannot be reached within ``connect_s``."""
    host, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if not host or not port or not port.isdigit():
        return None
    try:
        return StoreLink(
            host, int(port), call_s, 0.0, connect_s=connect_s, name="the job's key-value store"
        )
    except StoreUnreachable:
        return None
