"""Each rank's live progress (step, phase), readable by the other ranks of its machine even
after the rank is killed outright.

The heartbeat in the job's store is written once a second or so: a rank killed with ``kill -9``
mid-run leaves a beat that may be many steps behind. So every rank also keeps its current step
and phase in a small memory-mapped file (under ``/dev/shm`` when there is one). Updating it is a
few stores into shared memory -- no system call -- cheap enough for every phase change, and the
pages outlive the process (they belong to the file, not to the process), so a rank of the same
machine that finds the process gone reads exactly where it was.

Layout: a header (magic, pid, rank; then how long the file must be kept after the process
died, and when the process was last seen alive), then two record slots used in turn. A record
is written as sequence number ``2n - 1`` (odd: being written), the body, then ``2n`` (even:
complete). A process killed in the middle of a write leaves an odd number in one slot and the
previous record, complete, in the other: a torn write is recognised and never read as a record.

A rank removes its file when it stops. A file left by a killed rank is removed by the last rank
of its machine to read it, or, if none did, by the next job that starts on the machine once the
time recorded in it has passed (no rank of the dead one's job can need it any more).
"""

from __future__ import annotations

import mmap
import os
import re
import socket
import struct
import tempfile
import time
from dataclasses import dataclass

_MAGIC = b"dtrprog1"
# Native layout ("@"): the file is only ever read on the machine that wrote it, and a native
# 8-byte field is stored with one instruction, so a sequence number itself is never torn.
_HEADER = struct.Struct("@8sqq")  # magic, pid, rank
_LIFE = struct.Struct("@dd")  # seconds to keep the file after death; last seen alive (time.time)
_LIFE_AT = 24
_ALIVE_AT = _LIFE_AT + 8
_STAMP = struct.Struct("@d")
_SEQ = struct.Struct("@Q")
_BODY = struct.Struct("@qd48p")  # step, time of the phase change (monotonic), phase
_SLOTS = (64, 128)  # one slot each, 72 bytes: sequence number and body
_SIZE = 256
# How long to keep a file whose header cannot be read (cut short): an hour after it changed.
_ORPHAN_KEEP_S = 3600.0
_PREFIX = "dtrain-progress-"


@dataclass(frozen=True)
class Progress:
    """A rank's last recorded step and phase."""

    step: int
    phase: str
    since: float  # time.monotonic() when it entered the phase (one clock for the whole machine)
    interrupted: bool  # it died while recording the next phase, so it was just leaving this one

    def where(self) -> str:
        if self.interrupted:
            return f"at step {self.step}, as it left {self.phase}"
        return f"at step {self.step} in {self.phase}"


def progress_dir() -> str:
    """Shared memory when the machine has it (never written back to a disk), else the temp
    folder (its pages still outlive the process in the page cache)."""
    shm = "/dev/shm"
    if os.path.isdir(shm) and os.access(shm, os.W_OK | os.X_OK):
        return shm
    return tempfile.gettempdir()


def _host_tag() -> str:
    return re.sub(r"[^A-Za-z0-9_.]", "_", socket.gethostname())[:64]


def progress_path(rank: int, pid: int | None = None, folder: str | None = None) -> str:
    pid = os.getpid() if pid is None else pid
    name = f"{_PREFIX}{_host_tag()}-pid{pid}-rank{rank}"
    return os.path.join(folder or progress_dir(), name)


class ProgressFile:
    """This rank's progress file, for writing (see the module's docstring)."""

    def __init__(self, path: str, rank: int, keep_s: float) -> None:
        """``keep_s``: how long after this process dies its file may still be read (by ranks
        of its job that have not noticed yet); it is not swept away before."""
        self.path = path
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.ftruncate(fd, _SIZE)
            self._map: mmap.mmap | None = mmap.mmap(fd, _SIZE)
        except BaseException:
            remove_progress_file(path)  # never leave a file nobody will write or remove
            raise
        finally:
            os.close(fd)  # the mapping keeps the file open
        _HEADER.pack_into(self._map, 0, _MAGIC, os.getpid(), rank)
        _LIFE.pack_into(self._map, _LIFE_AT, keep_s, time.time())
        self._count = 0
        self._encoded: dict[str, bytes] = {}

    def write(self, step: int, phase: str, since: float) -> None:
        """Record a phase change: three copies into shared memory, no system call."""
        buf = self._map
        if buf is None:
            return
        encoded = self._encoded.get(phase)
        if encoded is None:  # phases are a handful of names: encode each once
            encoded = phase.encode()[:47]
            if len(self._encoded) < 256:  # (a caller that makes up names must not grow it)
                self._encoded[phase] = encoded
        self._count = n = self._count + 1
        slot = _SLOTS[n & 1]
        _SEQ.pack_into(buf, slot, 2 * n - 1)
        _BODY.pack_into(buf, slot + _SEQ.size, step, since, encoded)
        _SEQ.pack_into(buf, slot, 2 * n)

    def alive(self) -> None:
        """Stamp "still alive now" (from the heartbeat thread, not the main one): a sweep
        counts the time to keep the file from the last stamp."""
        try:
            if self._map is not None:
                _STAMP.pack_into(self._map, _ALIVE_AT, time.time())
        except ValueError:  # closed meanwhile by stop()
            pass

    def close(self, remove: bool = True) -> None:
        if self._map is not None:
            self._map.close()
            self._map = None
        if remove:
            remove_progress_file(self.path)


def remove_progress_file(path: str) -> None:
    """Remove a progress file; only ever one of ours (the path may come from the store)."""
    if not os.path.basename(path).startswith(_PREFIX):
        return
    try:
        os.unlink(path)
    except OSError:
        pass


def read_progress(path: str, pid: int) -> Progress | None:
    """The last complete record in ``path`` if it is the progress file of process ``pid``;
    None when it is missing, unreadable, someone else's or empty. Safe while the writer runs:
    the file is read twice and only a slot that reads the same both times counts."""
    for _attempt in range(5):
        try:
            with open(path, "rb") as fh:
                first = fh.read(_SIZE)
                fh.seek(0)
                second = fh.read(_SIZE)
        except OSError:
            return None
        if len(first) < _SIZE or first[: _HEADER.size] != second[: _HEADER.size]:
            return None
        magic, owner, _rank = _HEADER.unpack_from(first)
        if magic != _MAGIC or owner != pid:
            return None
        settled, progress = _latest(first, second)
        if settled:
            return progress
        time.sleep(0.001)  # a live writer rewrote both slots between the two reads
    return None


def _latest(first: bytes, second: bytes) -> tuple[bool, Progress | None]:
    """The newest complete record of two reads of a file, and whether any slot read the same
    both times (if none did, a live writer was busy and the reads must be repeated)."""
    best_seq, best = 0, None
    newest_seq = 0
    settled = False
    for slot in _SLOTS:
        end = slot + _SEQ.size + _BODY.size
        if first[slot:end] != second[slot:end]:
            continue  # being rewritten while read
        settled = True
        (seq,) = _SEQ.unpack_from(first, slot)
        newest_seq = max(newest_seq, seq)
        if seq == 0 or seq % 2 or seq < best_seq:  # never written, torn, or older
            continue
        step, since, raw = _BODY.unpack_from(first, slot + _SEQ.size)
        best_seq, best = seq, Progress(step, raw.decode(errors="replace"), since, False)
    if best is not None and newest_seq > best_seq:
        # The next record was begun and never finished: it died changing phase.
        best = Progress(best.step, best.phase, best.since, interrupted=True)
    return settled, best


def process_alive(pid: int) -> bool:
    """Whether a process of this machine is alive (a zombie, dead but not yet reaped, is not)."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False
    except OSError:  # no /proc: ask the kernel
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True


def sweep_progress_files(folder: str | None = None) -> int:
    """Remove the progress files that processes of this machine left when they were killed
    and no rank removed (the whole group was killed, say), once no rank of their job can still
    need them. Returns how many were removed."""
    folder = folder or progress_dir()
    pattern = re.compile(re.escape(_PREFIX + _host_tag()) + r"-pid(\d+)-rank\d+$")
    try:
        names = os.listdir(folder)
    except OSError:
        return 0
    removed = 0
    for name in names:
        match = pattern.match(name)
        if match is None or int(match.group(1)) == os.getpid():
            continue
        path = os.path.join(folder, name)
        if not process_alive(int(match.group(1))) and _expired(path):
            remove_progress_file(path)
            removed += 1
    return removed


def _expired(path: str) -> bool:
    """Whether a dead process's file is past the time its job's ranks may still read it (a
    rank of another job starting on this machine must not take it from under them)."""
    try:
        with open(path, "rb") as fh:
            head = fh.read(_LIFE_AT + _LIFE.size)
        seen = os.stat(path).st_mtime
    except OSError:
        return False
    keep_s = _ORPHAN_KEEP_S
    if len(head) == _LIFE_AT + _LIFE.size and head[:8] == _MAGIC:
        keep_s, seen = _LIFE.unpack_from(head, _LIFE_AT)
    return time.time() - seen > keep_s
