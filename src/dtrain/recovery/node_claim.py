"""One launcher per ``--node-rank`` in a job of ``fault.recovery = 'inplace'`` across machines.

Members are numbered machine by machine (``--nproc`` each from ``node_rank x nproc``): two
machines given the same ``--node-rank`` would start workers under the same member ids, each
overwriting the other's registration, while the machine nobody was given is waited for. So the
launcher of every machine but node 0 (which hosts the store: a second one cannot hold its
endpoint) claims its rank in the store before any worker starts.

A claim is held while its launcher lives: the launcher's :class:`~dtrain.recovery.coordinator.
NodeWatcher` adds to the rank's counter (``node/<k>/alive``) every ``BUMP_S``. A launcher that
finds the rank claimed watches the counter for ``QUIET_S``: if it moved, another launcher runs
that rank (one line, exit 2); if not, the holder has ended -- a machine whose launcher is
started again, its workers rejoining -- and the claim is taken over.

The claim is sealed with the job's secret (:mod:`dtrain.dist.sealed_store`): one that fails
its seal (a stranger's, who reached the store's port) is no claim, and is replaced at once.
The counter cannot be sealed: a stranger who adds to it keeps a claim looking held."""

from __future__ import annotations

import functools
import os
import socket
import time
import uuid
from collections.abc import Callable
from typing import Any

from dtrain.dist import sealed_store
from dtrain.dist.store_link import StoreLink
from dtrain.errors import UserError
from dtrain.recovery.membership import PREFIX

BUMP_S = 0.5  # how often a live launcher adds to its rank's counter
QUIET_S = 4 * BUMP_S  # a counter still this long: its launcher has ended


def claim_key(node: int) -> str:
    return f"{PREFIX}node/{node}/launcher"


def alive_key(node: int) -> str:
    return f"{PREFIX}node/{node}/alive"


def claim_node(
    link: StoreLink,
    node: int,
    nnodes: int,
    *,
    sleep: Callable[[float], None] = time.sleep,
) -> str:
    """Claim ``--node-rank node`` for this launcher; its token. A one-line :class:`UserError`
    where a live launcher holds it."""
    token = f"{socket.gethostname()} (pid {os.getpid()}, launcher {uuid.uuid4().hex[:8]})"
    key = claim_key(node)
    mine = sealed_store.seal(key, token.encode())
    expected = b""  # no claim: take it; a claim that fails its seal: replace it, as if none
    for _ in range(_FORGED_TRIES):
        swap = functools.partial(_compare_set, key=key, expected=expected, desired=mine)
        raw = link.call(swap, f"claiming --node-rank {node}")
        if raw == mine:
            return token
        held = sealed_store.text(key, raw)
        if held is not None:
            break  # a launcher of this job holds it
        expected = raw
    else:  # a stranger keeps writing it: ours, as if there were none
        link.call(lambda s: s.set(key, mine), f"claiming --node-rank {node}")
        return token
    counter = alive_key(node)
    before = link.call(lambda s: int(s.add(counter, 0)), "reading a launcher's liveness")
    sleep(QUIET_S)
    after = link.call(lambda s: int(s.add(counter, 0)), "reading a launcher's liveness")
    if after != before:
        raise UserError(
            f"--node-rank {node}: the launcher on {held} runs that rank in this job already; "
            f"give each machine its own --node-rank (0 .. {nnodes - 1})"
        )
    link.call(lambda s: s.set(key, mine), f"taking over --node-rank {node}")
    return token


def _compare_set(store: Any, key: str, expected: bytes, desired: bytes) -> bytes:
    return bytes(store.compare_set(key, expected, desired))


_FORGED_TRIES = 3  # replacing a claim that fails its seal, before it is simply overwritten
