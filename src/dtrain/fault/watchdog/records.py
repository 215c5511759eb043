"""What the watchdog posts to the job's store and reads back: a rank's failure, a dead rank of
this machine, the attempt a liveness record belongs to, and the keys' prefix."""

from __future__ import annotations

import os
from typing import Any

from dtrain.dist.sealed_store import Shape, warn_once
from dtrain.fault.liveness import Liveness

# fault.recovery = 'inplace': the membership generation this process trains in (set per
# generation by dtrain.recovery.inplace). Its ranks' liveness records are one attempt: each
# worker's own restart count is not.
GENERATION_ENV = "DTRAIN_INPLACE_GENERATION"


# What a rank posts when it fails, and what a rank posts for a dead rank of its machine.
FAILURE: Shape = {"host": str, "pid": int, "step": int, "phase": str, "error": str}
KILLED: Shape = {"host": str, "pid": int, "killed": str, "seen_by": int}
# What a rank posts for a rank it watches (diagnosis: ``watched``) whose beats stopped, or that
# never beat: the words it found, and whether the network lost it ("host" too, when known).
SILENT: Shape = {"silent": str, "network": bool, "seen_by": int}


def liveness_attempt() -> int:
    """The attempt a liveness record belongs to: the restart count of torch's agent, or the
    membership generation under fault.recovery = 'inplace'."""
    return int(os.environ.get(GENERATION_ENV) or os.environ.get("TORCHELASTIC_RESTART_COUNT") or 0)


def store_prefix() -> str:
    # Keys of an earlier attempt (before a restart) must not be read as this one's.
    from dtrain.dist.runtime import store_namespace

    return store_namespace() + "watchdog/"


def failed_ranks(link: Any, seconds: float | None = None) -> set[int]:
    """The ranks listed in the job's index of failed ranks, read through ``link`` (a
    :class:`~dtrain.dist.store_link.StoreLink`). The index is appended to, so unsealed: a
    stranger's entries name ranks whose sealed records then do not open."""
    key = f"{store_prefix()}failed"
    index = link.call(
        lambda store: store.get(key) if store.check([key]) else b"",
        "reading the failed ranks",
        seconds,
    )
    return {int(r) for r in bytes(index).decode(errors="replace").split(",") if r.isdigit()}


def beat_of(key: str, record: dict[str, Any] | None) -> Liveness | None:
    """The heartbeat in a record read at ``key`` (None: none, or not a heartbeat: warned)."""
    beat = Liveness.from_dict(record)
    if record is not None and beat is None:
        warn_once(key, "it is malformed (not the record dtrain writes there)")
    return beat


def failure_text(error: BaseException | str) -> str:
    """A rank's own failure as the other ranks name it. Ctrl-C on its machine reaches its
    workers as SIGINT, which was a bare ``KeyboardInterrupt:`` to the others."""
    if isinstance(error, KeyboardInterrupt):
        return "interrupted by SIGINT (Ctrl-C on its machine), without saving"
    return error if isinstance(error, str) else f"{type(error).__name__}: {error}"
