"""A second Ctrl-C on node 0 of an in-place job across machines stops every machine at once.

The first Ctrl-C is a preemption: node 0's workers carry the stop to every member in a step's
agreement and all of them save. A second one means "now": node 0's launcher kills its workers
unsaved. Its workers host the job's store, so the other machines' workers, mid-save, would then
fail on their own ("checkpoint ... was not committed", a failure report) while their
operators had nothing to fix. So node 0's launcher tells the others first, through the
membership store it hosts (not a worker's: it outlives the workers)::

    node 0's launcher (second signal)        another machine's launcher
      SIGSTOP its workers (frozen: no
        collective or store call of theirs
        fails, so no peer prints an error)
      post inplace/halt  ─────────────────►  its watcher reads it (twice a second)
                                             SIGKILL its workers, then post
      wait for every inplace/halt/ack/<k> ◄──  inplace/halt/ack/<node>
        (at most ACK_S: a machine that is gone does not answer)
      SIGKILL its workers

Each machine then says in one line that it stopped at once and why, and exits 128 + SIGINT, as
node 0 does.
"""

from __future__ import annotations

import time
from typing import Any

from dtrain.recovery.membership import read_text, write_value

HALT_KEY = "halt"  # under the membership's prefix: why node 0 stopped the job at once
ACK_S = 5.0  # how long node 0 waits for the others' launchers before it kills its workers
REASON = "node 0's operator stopped the job (a second Ctrl-C there)"


def ack_key(node: int) -> str:
    return f"{HALT_KEY}/ack/{node}"


def halt_other_machines(store: Any, nnodes: int) -> None:
    """On node 0, its own workers frozen: tell the other machines' launchers to kill their
    workers, and wait (at most ``ACK_S``) until each says it did."""
    write_value(store, HALT_KEY, REASON)
    waiting = list(range(1, nnodes))
    deadline = time.monotonic() + ACK_S
    while waiting and time.monotonic() < deadline:
        waiting = [node for node in waiting if read_text(store, ack_key(node)) != "killed"]
        if waiting:
            time.sleep(0.05)


class Halt:
    """The halt as one machine's supervision of its workers sees it (``supervise_members``):
    on node 0 of several machines, :meth:`tell_others` before its workers are killed by a
    second signal; elsewhere, :meth:`heard` (node 0's reason, once posted) and
    :meth:`acknowledge` once its workers are killed. On one machine: nothing."""

    def __init__(self, membership: Any, node: int, nnodes: int) -> None:
        """``membership``: node 0's coordinator (its ``store``) or another machine's node
        watcher (its ``halted`` and ``link``)."""
        self.membership, self.node, self.nnodes = membership, node, nnodes

    def tell_others(self) -> None:
        if self.node == 0 and self.nnodes > 1:
            halt_other_machines(self.membership.store, self.nnodes)

    def heard(self) -> str:
        return str(getattr(self.membership, "halted", "")) if self.node else ""

    def acknowledge(self) -> None:
        """On another machine, its workers killed: say so to node 0's launcher."""
        self.membership.stop()  # its thread calls the same link: no two callers at once
        key = ack_key(self.node)
        self.membership.link.call(lambda s: write_value(s, key, "killed"), "acknowledging the halt")
