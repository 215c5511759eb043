"""The launcher's side of a rendezvous across machines: the job's shape compared, and the words
while it waits for the other machines.

torch's c10d rendezvous waits in silence until its join timeout. Here one that has not completed
after :data:`NOTICE_AFTER_S` says once what it waits for and until when, and one that times out
is one line naming what every machine must share (:func:`timed_out_words`). Before that, the
hosting launcher posts its ``--run-id`` and ``--nnodes`` and every other launcher compares its
own (:func:`share_shape`): a machine started with another is one line and exit 2, before its
workers (docs/multi-host.md has the table of what each machine says).
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from typing import Any

from dtrain.console import say_line
from dtrain.dist.network import split_endpoint
from dtrain.dist.secret import JobSecret
from dtrain.dist.stores import client_store
from dtrain.errors import UserError

NOTICE_AFTER_S = 5.0  # a rendezvous of machines started together completes well within this
SHAPE_KEY = "dtrain/launch/shape"  # in the rendezvous store: the hosting launcher's job shape


def share_shape(endpoint: str, shape: dict[str, str], hosting: bool, secret: JobSecret) -> None:
    """Once the rendezvous store is up (the hosting launcher's torch handler made it): post
    ``shape`` (``{"--run-id": ..., "--nnodes": ...}``) and the check of the job's secret there
    when ``hosting``, else compare this machine's with those posted: a :class:`UserError`
    naming what differs. Nothing posted -- a rendezvous served apart (``dtrain rendezvous``
    posts only the secret's check), or its host a moment behind -- is not checked (the wait
    then says what it waits for)."""
    from dtrain.dist.rendezvous import check_secret, post_secret_check

    store = client_store(*split_endpoint(endpoint), 30.0)
    if hosting:
        post_secret_check(store, secret)
        store.set(SHAPE_KEY, secret.seal(SHAPE_KEY, json.dumps(shape).encode()))
        return
    check_secret(store, secret, endpoint)
    if not store.check([SHAPE_KEY]):
        return
    posted = secret.unseal(SHAPE_KEY, bytes(store.get(SHAPE_KEY)))
    try:
        theirs = json.loads(posted.decode()) if posted is not None else None
    except ValueError:  # sealed by the job, so never; but a bad shape must not stop a machine
        theirs = None
    if not isinstance(theirs, dict):
        say_line(
            f"dtrain: warning: ignored the value of {SHAPE_KEY!r} in the rendezvous store: it "
            "fails its seal (written by a process without the job's secret)"
        )
        return
    if differ := [flag for flag in shape if theirs.get(flag) != shape[flag]]:
        here = " ".join(f"{flag} {shape[flag]}" for flag in differ)
        there = " ".join(f"{flag} {theirs.get(flag)}" for flag in differ)
        raise UserError(
            f"{here} here, but the machine that hosts the rendezvous at {endpoint} runs "
            f"{there}: start every machine of the job with the same --run-id and --nnodes"
        )


def waiting_words(endpoint: str, run_id: str, nnodes: str, timeout_s: int) -> str:
    return (
        f"dtrain: waiting for the other machines of job {run_id!r} at {endpoint} (--nnodes "
        f"{nnodes}; still starting, not started, or refused: their consoles say why; each "
        f"needs the same --nnodes, --run-id, --rdzv-endpoint and job secret); giving up after "
        f"{timeout_s}s"
    )


def timed_out_words(endpoint: str, run_id: str, nnodes: str, timeout_s: int) -> str:
    return (
        f"--rdzv-endpoint {endpoint}: the machines of job {run_id!r} (--nnodes {nnodes}) did "
        f"not all join within {timeout_s}s (--rdzv-timeout): start `dtrain train` on every "
        "machine with the same --nnodes, --run-id, --rdzv-endpoint and job secret (a machine "
        "that refused to start says why on its own console)"
    )


def announce_waits(
    handler: Any,
    words: str,
    after_s: float = NOTICE_AFTER_S,
    say: Callable[[str], None] = say_line,
) -> None:
    """Wrap ``handler.next_rendezvous`` (a torch ``RendezvousHandler``) so that each call still
    waiting after ``after_s`` prints ``words`` once (to stderr by default)."""
    inner = handler.next_rendezvous

    def next_rendezvous() -> Any:
        timer = threading.Timer(after_s, say, args=(words,))
        timer.daemon = True
        timer.start()
        try:
            return inner()
        finally:
            timer.cancel()

    handler.next_rendezvous = next_rendezvous
