"""Closing a failed membership generation's connections at once (``fault.recovery = 'inplace'``).

On gloo, a rank killed outright makes the collectives of the ranks that exchange data with it
fail within milliseconds (its machine closes its sockets). A rank that was waiting on one of
those survivors instead -- in gloo's ring, any rank not next to the dead one -- would wait out
the whole collective timeout: the survivor has left the generation, but its sockets stay open,
because its process groups cannot be freed yet (:class:`dtrain.recovery.inplace.Retired`).

So a rank that leaves a generation after a failed collective shuts down (``shutdown(2)``, not
``close``: the descriptors stay gloo's, freed with their group) every TCP connection that the
generation opened between this process and another of its workers. A peer blocked on this rank
then reads end-of-file at once and its collective fails as if this rank had died; it leaves in
turn and does the same, so every rank of the generation is out within milliseconds.

Which sockets, exactly: those this process holds that were not open when the generation
started, are established, and whose other end is held by one of the generation's other worker
processes (read from ``/proc/<pid>/fd`` and ``/proc/net/tcp``: every worker is on this
machine). The connections to the membership store (held by the launcher) and anything else
this process opened stay as they are. Listening sockets are never touched: gloo's listener
thread aborts the process when its socket is shut down.

Across machines a peer's sockets are not in this machine's tables: once the coordinator names a
machine cut off, each other worker shuts down the generation's connections to its address
(:meth:`GenerationLinks.sever_addresses`), never those to the membership store.
"""

from __future__ import annotations

import os
import socket
import sys
from collections.abc import Callable, Iterable
from typing import NamedTuple

_TABLES = ("/proc/net/tcp", "/proc/net/tcp6")
_ESTABLISHED = "01"  # the st column of /proc/net/tcp


class _Row(NamedTuple):
    table: str
    local: str  # "ADDR:PORT" in the kernel's hex
    remote: str
    state: str


def _tcp_rows() -> dict[int, _Row]:
    """Every TCP socket of this machine's network namespace, by inode."""
    rows: dict[int, _Row] = {}
    for table in _TABLES:
        try:
            with open(table) as fh:
                lines = fh.read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if inode := int(fields[9]):  # 0: a connection no process holds any more (TIME_WAIT)
                rows[inode] = _Row(table, fields[1], fields[2], fields[3])
    return rows


def socket_inodes(pid: int | str = "self") -> dict[int, int]:
    """The sockets a process holds: inode -> one of its descriptors (empty when the process
    is gone or its descriptors cannot be read)."""
    base = f"/proc/{pid}/fd"
    found: dict[int, int] = {}
    try:
        names = os.listdir(base)
    except OSError:
        return found
    for name in names:
        try:
            target = os.readlink(f"{base}/{name}")
        except OSError:
            continue
        if target.startswith("socket:["):
            found[int(target[8:-1])] = int(name)
    return found


def _shut_down(fd: int, inode: int) -> bool:
    """``shutdown(SHUT_RDWR)`` of the socket at ``fd`` if it is still ``inode`` (the descriptor
    may have been closed and its number reused since it was listed)."""
    try:
        dup = os.dup(fd)
    except OSError:
        return False
    try:
        if os.fstat(dup).st_ino != inode:
            return False
        sock = socket.socket(fileno=dup)
        try:
            sock.shutdown(socket.SHUT_RDWR)
            return True
        except OSError:
            return False
        finally:
            sock.detach()  # the duplicate is closed below, the socket itself stays open
    finally:
        os.close(dup)


def _hex_addresses(address: str) -> set[str]:
    """How /proc/net/tcp{,6} write an IPv4 address (each 32-bit word in this machine's byte
    order), plain and IPv4-mapped; a name is resolved first. Empty for what has no IPv4
    address (such a machine's connections are left to the collective timeout)."""
    try:
        packed = socket.inet_aton(socket.gethostbyname(address))
    except OSError:
        return set()
    word = packed[:: -1 if sys.byteorder == "little" else 1].hex().upper()
    mapped = "0000FFFF" if sys.byteorder == "big" else "FFFF0000"
    return {word, "0" * 16 + mapped + word}


class GenerationLinks:
    """The TCP connections a membership generation opens between this process and its other
    workers; made as the generation starts, before its process group is initialized."""

    def __init__(self) -> None:
        self._before = frozenset(socket_inodes())

    def sever(self, peers: Iterable[int]) -> int:
        """Shut down every established connection opened since this object was made between
        this process and one of the processes ``peers`` (pids); how many were shut down."""
        rows = _tcp_rows()
        theirs: set[tuple[str, str, str]] = set()
        for pid in peers:
            for inode in socket_inodes(pid):
                row = rows.get(inode)
                if row is not None:
                    theirs.add((row.table, row.local, row.remote))
        return self._shut_down_new(rows, lambda row: (row.table, row.remote, row.local) in theirs)

    def sever_addresses(self, addresses: Iterable[str], spare_port: int) -> int:
        """Shut down every established connection opened since this object was made between
        this process and a process at one of ``addresses`` (IPv4, another machine's), except
        those to its port ``spare_port`` (the membership store); how many were shut down."""
        wanted: set[str] = set().union(*(_hex_addresses(a) for a in addresses))
        if not wanted:
            return 0
        spare = f"{spare_port:04X}"

        def to_wanted(row: _Row) -> bool:
            address, port = row.remote.rsplit(":", 1)
            return address in wanted and port != spare

        return self._shut_down_new(_tcp_rows(), to_wanted)

    def _shut_down_new(self, rows: dict[int, _Row], chosen: Callable[[_Row], bool]) -> int:
        """Shut down this process's established connections opened since this object was
        made whose row is ``chosen``; how many were shut down."""
        count = 0
        for inode, fd in socket_inodes().items():
            row = rows.get(inode)
            if inode in self._before or row is None or row.state != _ESTABLISHED:
                continue
            if chosen(row) and _shut_down(fd, inode):
                count += 1
        return count
