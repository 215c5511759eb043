"""dtrain's own values in the job's stores, sealed with the job's secret.

torch's stores let anyone who reaches their port write any key. The values dtrain itself
writes and another process acts on -- the in-place membership (who is in a generation, who
asked for one, who is down, why the job stopped), restart mode's failure and heartbeat
records, the ranks' start-up addresses -- are therefore sealed with the job's secret
(:class:`dtrain.dist.secret.JobSecret`) under the FULL key the reader reads them at, so a
value cannot be moved to another key. A value that fails its seal, or that opens but is not
what dtrain writes there (no JSON, another shape), is treated as absent: one warning naming
its key, once per key and process, and never an exception -- a stranger's value must
neither end a rank, a launcher or the coordinator, nor steer them.

A process without a secret (a worker started by plain ``torchrun`` without
``DTRAIN_JOB_SECRET``) keeps the plain values of before: it writes them as they are and
reads them unchecked (but for their shape). Counters (``store.add``: heartbeats, a
launcher's liveness) cannot be sealed and stay plain (docs/security.md says what a stranger
can still do with them).
"""

from __future__ import annotations

import functools
import json
import os
import threading
from typing import Any

from dtrain.console import say_line
from dtrain.dist.secret import SECRET_ENV, SECRET_FILE_ENV, JobSecret, process_secret

# A record's shape, for :func:`fits`: a type, a tuple of types (any of them), a one-element
# list (a list of that), or a dict (at least those fields, each of its shape).
Shape = type | tuple[type, ...] | list[Any] | dict[str, Any]

_warned: set[str] = set()
_warned_lock = threading.Lock()


@functools.lru_cache(maxsize=4)
def _secret_of(text: str, file: str) -> JobSecret | None:
    return process_secret()


def job_secret() -> JobSecret | None:
    """This process's secret, or None without one. Read once per value of the environment
    (the coordinator opens values every 10 ms; a test may set another secret). The file's
    variable is looked up only without the secret's, which wins over it: looking up a variable
    that is not set raises inside ``os.environ``, and cost more than the HMAC."""
    text = os.environ.get(SECRET_ENV, "")
    return _secret_of(text, "" if text else os.environ.get(SECRET_FILE_ENV, ""))


def warn_once(key: str, why: str) -> None:
    """``dtrain: warning: ignored the value of store key KEY: WHY``, once per key."""
    with _warned_lock:
        if key in _warned:
            return
        _warned.add(key)
    say_line(f"dtrain: warning: ignored the value of store key {key!r}: {why}")


FAILS_SEAL = "it fails its seal (written by a process without the job's secret)"


def seal(key: str, value: bytes) -> bytes:
    """``value`` as it is written at ``key`` (sealed under ``key``; as it is without a secret)."""
    secret = job_secret()
    return value if secret is None else secret.seal(key, value)


def opened(key: str, raw: bytes | None) -> bytes | None:
    """The value sealed in ``raw``, read at ``key``; None for none, and for one that fails
    its seal (warned once)."""
    if raw is None:
        return None
    raw = bytes(raw)
    secret = job_secret()
    if secret is None:
        return raw
    value = secret.unseal(key, raw)
    if value is None:
        warn_once(key, FAILS_SEAL)
    return value


def text(key: str, raw: bytes | None) -> str | None:
    """:func:`opened`, as text (None for bytes that are none)."""
    value = opened(key, raw)
    if value is None:
        return None
    try:
        return value.decode()
    except UnicodeDecodeError:
        warn_once(key, "it is malformed (not text)")
        return None


def fits(value: Any, shape: Shape) -> bool:
    """Whether a JSON value has ``shape`` (a bool is no int; an int passes for a float)."""
    if isinstance(shape, dict):
        return isinstance(value, dict) and all(
            name in value and fits(value[name], part) for name, part in shape.items()
        )
    if isinstance(shape, list):
        return isinstance(value, list) and all(fits(item, shape[0]) for item in value)
    kinds = shape if isinstance(shape, tuple) else (shape,)
    if isinstance(value, bool):
        return bool in kinds
    if float in kinds and isinstance(value, int):
        return True
    return isinstance(value, kinds)


def parse(key: str, raw: bytes | None, shape: Shape) -> Any:
    """The JSON value sealed in ``raw`` at ``key`` if it has ``shape``; else None (a value
    that fails its seal, is no JSON or has another shape: warned once)."""
    value = text(key, raw)
    if value is None:
        return None
    try:
        record = json.loads(value)
    except ValueError:
        warn_once(key, "it is malformed (not JSON)")
        return None
    if not fits(record, shape):
        warn_once(key, "it is malformed (not the record dtrain writes there)")
        return None
    return record


def put(store: Any, key: str, value: str | bytes) -> None:
    """``store[key] = value``, sealed."""
    store.set(key, seal(key, value.encode() if isinstance(value, str) else value))


def put_many(store: Any, values: dict[str, str]) -> None:
    """``store[key] = value`` for each, sealed, in one call (``multi_set``)."""
    keys = list(values)
    store.multi_set(keys, [seal(key, values[key].encode()) for key in keys])


def get(store: Any, key: str) -> bytes | None:
    """The raw value at ``key``, or None while it is not set."""
    return bytes(store.get(key)) if store.check([key]) else None


def get_many(store: Any, keys: list[str], *, present: bool = False) -> list[bytes | None]:
    """The raw values at ``keys`` (None where one is not set): one call to the store when all
    are set (``multi_get``), else one per key. ``present``: the caller knows every key is set
    (a job's keys are never removed), so the ``multi_get`` alone, without the ``check`` that
    keeps a missing key from blocking it until the call's bound."""
    if not keys:
        return []
    if present or store.check(keys):
        return list(store.multi_get(keys))
    return [get(store, key) for key in keys]


def read_text(store: Any, key: str) -> str | None:
    """The text sealed at ``key``; None while unset, or when it fails (warned once)."""
    return text(key, get(store, key))


def read_json(store: Any, key: str, shape: Shape) -> Any:
    """The JSON value sealed at ``key`` if it has ``shape``; None otherwise (:func:`parse`)."""
    return parse(key, get(store, key), shape)


class Opener:
    """Reads keys read over and over (a poll, a wait): a raw value seen before at a key gives
    what it gave then, without checking its seal again (the coordinator reads every member's
    keys every 10 ms); and a value that fails gives the last one that opened at that key --
    a stranger's write over a member's record is ignored, not taken for the record's loss
    (a key that is gone is gone: None). Safe to share between threads."""

    def __init__(self) -> None:
        self._last: dict[str, tuple[bytes, Any]] = {}  # key -> its last raw value, and what it gave
        self._good: dict[str, Any] = {}  # key -> the last value that opened there
        self._lock = threading.Lock()

    def parse(self, key: str, raw: bytes | None, shape: Shape | None) -> Any:
        """:func:`parse` (``shape`` None: :func:`text`), with the above."""
        if raw is None:
            return None
        raw = bytes(raw)
        with self._lock:
            last = self._last.get(key)
            if last is None or last[0] != raw:
                value = text(key, raw) if shape is None else parse(key, raw, shape)
                self._last[key] = last = (raw, value)
                if value is not None:
                    self._good[key] = value
            return last[1] if last[1] is not None else self._good.get(key)

    def read_text(self, store: Any, key: str) -> str | None:
        return self.parse(key, get(store, key), None)

    def read_json(self, store: Any, key: str, shape: Shape) -> Any:
        return self.parse(key, get(store, key), shape)
