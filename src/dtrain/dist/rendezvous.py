"""torch's c10d rendezvous with its state sealed by the job's secret.

torch's dynamic rendezvous keeps its state in the store as a pickle, and every agent
unpickles it at each keep-alive: anyone who could write that key ran code in the launcher.
:class:`SealedRendezvousBackend` seals the state it writes (:class:`dtrain.dist.secret.JobSecret`,
with a sequence number, so an old state read off the wire cannot be replayed) under a key
whose name only the secret gives (:func:`state_key`), and hands torch only state that opens
under the job's secret: a forged, replayed or malformed value is ignored
with one warning naming its key, and the next write of the job replaces it. The handler is
torch's own (:func:`make_handler`); its store is the launcher's, bound to the job's address
(:func:`dtrain.launch.agent.rendezvous_store`).
"""

from __future__ import annotations

import pickle
import struct
from typing import Any

from torch.distributed.elastic.rendezvous.api import (
    RendezvousConnectionError,
    RendezvousParameters,
)
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
    RendezvousBackend,
    _RendezvousState,
    create_handler,
)

from dtrain.console import say_line
from dtrain.dist.secret import HOW_TO, SECRET_ENV, JobSecret
from dtrain.errors import UserError

_WARNINGS = 5  # forged values warned about, each once; a flood of them is not printed
_EMPTY = "-"  # the key's value before any state (torch's backend uses a sentinel too)
SECRET_CHECK_KEY = "dtrain/secret-check"
_SECRET_CHECK_TEXT = b"dtrain: the job's secret"


def state_key(secret: JobSecret, run_id: str) -> str:
    """Where the rendezvous state of ``run_id`` is kept: a name only the job's secret gives.
    torch keeps it at ``torch.rendezvous.<run id>``, and the run id is no secret (the run
    folder's hold names it): anyone who reached the store could overwrite the state at will, and
    one who keeps doing so stalls the rendezvous, even sealed (each overwrite is ignored, but the
    state is lost with it). Under a name derived from the secret a stranger finds no key to write
    unless they can read the job's traffic (docs/security.md)."""
    return "dtrain/rendezvous/" + secret.digest("rendezvous state", run_id.encode())[:32].decode()


class SealedRendezvousBackend(RendezvousBackend):
    """A :class:`RendezvousBackend` over ``store`` whose state is sealed with ``secret``.

    The token handed to torch is the raw value read, so a compare-and-set against a value
    that was ignored replaces it. State that does not open is never given to torch: it gets
    the last state that did (or an empty one) instead."""

    def __init__(self, store: Any, run_id: str, secret: JobSecret) -> None:
        if not run_id:
            raise ValueError("the run id must be a non-empty string")
        self._store = store
        self._secret = secret
        self.key = state_key(secret, run_id)
        self._seen = 0  # the highest sequence number of a state that opened here
        self._last: bytes | None = None  # that state
        self._ignored: set[bytes] = set()  # values warned about (each once)
        self._call("compare_set", self.key, "", _EMPTY)

    @property
    def name(self) -> str:
        return "dtrain-sealed-c10d"

    def _call(self, op: str, *args: Any) -> Any:
        try:
            return getattr(self._store, op)(*args)
        except (ValueError, RuntimeError, TimeoutError) as exc:
            raise RendezvousConnectionError(
                f"the rendezvous store failed ({type(exc).__name__}: {exc})"
            ) from exc

    def _open(self, raw: bytes) -> tuple[bytes, Any] | None:
        """(state, token) for torch, from the raw value of the key."""
        raw = bytes(raw)
        if raw == _EMPTY.encode():
            return None
        payload = self._secret.unseal(self.key, raw)
        sequence = struct.unpack(">Q", payload[:8])[0] if payload and len(payload) > 8 else -1
        if payload is None or sequence < self._seen:
            if raw not in self._ignored and len(self._ignored) < _WARNINGS:
                self._ignored.add(raw)
                why = "is an older state replayed" if payload is not None else "fails its seal"
                say_line(
                    f"dtrain: warning: ignored the value of rendezvous key {self.key!r}: it {why} "
                    "(written by a process without the job's secret); the job's next write "
                    "replaces it"
                )
            state = self._last if self._last is not None else pickle.dumps(_RendezvousState())
            return state, raw
        self._seen, self._last = sequence, payload[8:]
        return self._last, raw

    def get_state(self) -> tuple[bytes, Any] | None:
        return self._open(self._call("get", self.key))

    def set_state(self, state: bytes, token: Any = None) -> tuple[bytes, Any, bool] | None:
        expected = token if isinstance(token, bytes) else _EMPTY.encode()
        if token is not None and not isinstance(token, bytes):
            current = self.get_state()
            return (*current, False) if current is not None else None
        sealed = self._secret.seal(self.key, struct.pack(">Q", self._seen + 1) + state)
        raw = bytes(self._call("compare_set", self.key, expected, sealed))
        opened = self._open(raw)
        return None if opened is None else (*opened, raw == sealed)


def make_handler(params: RendezvousParameters, store: Any, secret: JobSecret) -> Any:
    """torch's dynamic rendezvous handler for ``params`` over ``store``, its state sealed."""
    return create_handler(store, SealedRendezvousBackend(store, params.run_id, secret), params)


def post_secret_check(store: Any, secret: JobSecret) -> None:
    """Leave a value in the rendezvous store that opens only under the job's secret: what a
    joining machine checks its own against (:func:`check_secret`)."""
    store.set(SECRET_CHECK_KEY, secret.seal(SECRET_CHECK_KEY, _SECRET_CHECK_TEXT))


def check_secret(store: Any, secret: JobSecret, endpoint: str) -> None:
    """A :class:`UserError` when the rendezvous at ``endpoint`` was started with another
    secret than this machine's (nothing posted yet: not checked)."""
    if not store.check([SECRET_CHECK_KEY]):
        return
    if secret.unseal(SECRET_CHECK_KEY, bytes(store.get(SECRET_CHECK_KEY))) is None:
        raise UserError(
            f"--rdzv-endpoint {endpoint}: the rendezvous there was started with another job "
            f"secret than this machine's {SECRET_ENV}: give every machine the same one ({HOW_TO})"
        )
