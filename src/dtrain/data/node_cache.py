"""The pieces of a dataset in a store that the ranks of one machine share: one folder per dataset
under ``data.cache_dir``, bounded by ``data.cache_bytes`` for the machine, each piece fetched
once between them.

The folder holds a sparse local file per shard file (the pieces fetched, at their offsets),
``pieces.state`` (one byte per piece, memory-mapped by every rank: absent, being written,
present) and two lock files whose byte ``p`` stands for piece ``p``. The locks are Linux's
open-file-description byte-range locks (``F_OFD_SETLK``): they belong to one open file, so two
caches opened in one process exclude each other as two processes do, a lock dies with its
holder (``kill -9`` included), and the kernel does no deadlock detection across a process's
threads. The invariants:

- A rank holds a shared lock on ``holds`` byte ``p`` while it may read piece ``p``; eviction
  takes that byte exclusively without waiting, so a piece someone holds is never evicted.
- A rank fetches ``p`` holding ``claims`` byte ``p`` exclusively; the others wait on it (the
  kernel wakes them: no polling), then find the piece present. The state turns *present* only
  after the fetched bytes were checked against their SHA-256 and written: a fetch cut off
  (an error, ``kill -9``) leaves *being written*, which the next claimer fetches again
  (its claim free means the writer is gone) and eviction reclaims (its hold free too).
- A piece is counted in the machine's bytes from its claim (*being written*) until it is
  evicted; the counting and the choice of what to evict happen under one more exclusive byte,
  ``claims`` byte ``n`` (past every piece), so the ranks together stay within the limit.
- The first rank to open the folder (no other holds ``users.lock``) empties it; the last one to
  close it removes it. A cache never outlives its users, so no byte on its disk was verified by
  a process that is gone (``door.lock`` orders the opening and closing).
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import fcntl
import hashlib
import os
import shutil
import struct
import tempfile
from collections.abc import Callable
from pathlib import Path

import numpy as np

from dtrain.errors import DataError

ABSENT, WRITING, PRESENT = 0, 1, 2
_PUNCH_HOLE = 0x02 | 0x01  # FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE
_libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
_libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
# Linux's struct flock (x86-64, aarch64): l_type, l_whence, l_start, l_len, l_pid (0 for OFD).
_FLOCK = struct.Struct("hhqqi4x")


def punch_hole(fd: int, offset: int, length: int) -> None:
    """Free ``length`` bytes at ``offset`` of a file, which then reads as zeros."""
    if _libc.fallocate(fd, _PUNCH_HOLE, offset, length) != 0:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code))


def folder_name(url: str, fingerprint: str, piece_bytes: int) -> str:
    """The folder of one dataset's pieces: the same on every rank of a machine that reads it."""
    digest = hashlib.sha256(f"{url}\n{fingerprint}\n{piece_bytes}".encode()).hexdigest()
    return f"dtrain-shards-{digest[:16]}"


def lock_bytes(fd: int, kind: int, start: int, length: int = 1, wait: bool = True) -> bool:
    """Take (``fcntl.F_RDLCK``/``F_WRLCK``) or drop (``F_UNLCK``) bytes ``start ..
    start+length-1`` of ``fd``'s lock; False when ``wait`` is off and another holds them."""
    arg = _FLOCK.pack(kind, os.SEEK_SET, start, length, 0)
    try:
        fcntl.fcntl(fd, fcntl.F_OFD_SETLKW if wait else fcntl.F_OFD_SETLK, arg)
    except OSError as exc:
        if not wait and exc.errno in (errno.EAGAIN, errno.EACCES):
            return False
        raise
    return True


def runs(pieces: np.ndarray) -> list[tuple[int, int]]:
    """Sorted, distinct ``pieces`` as ``(first, count)`` runs of consecutive ids: one lock call
    a run."""
    if len(pieces) == 0:
        return []
    cut = np.flatnonzero(np.diff(pieces) != 1) + 1
    return [(int(run[0]), len(run)) for run in np.split(pieces, cut)]


class NodeCache:
    """One rank's view of its machine's folder of pieces (see the module's docstring)."""

    def __init__(self, parent: str, name: str, piece_size: np.ndarray) -> None:
        self.piece_size = piece_size
        self.folder = _parent(parent) / name
        self._door = self._join()
        n = len(piece_size)
        self._holds = os.open(self.folder / "holds.lock", os.O_RDWR | os.O_CREAT, 0o600)
        self._claims = os.open(self.folder / "claims.lock", os.O_RDWR | os.O_CREAT, 0o600)
        self._space_byte = n
        # state[p]: ABSENT, WRITING or PRESENT; every rank of the machine maps the same bytes.
        self.state = np.memmap(self.folder / "pieces.state", dtype=np.uint8, mode="r+", shape=(n,))

    # -- joining and leaving -------------------------------------------------------------

    def _join(self) -> int:
        """Register as a user of the folder, emptying it first when no one else uses it."""
        while True:
            _own_folder(self.folder)
            door = os.open(self.folder / "door.lock", os.O_RDWR | os.O_CREAT, 0o600)
            fcntl.flock(door, fcntl.LOCK_EX)
            try:
                # The last user may have removed the folder while this rank waited at the door.
                if os.fstat(door).st_ino != os.stat(self.folder / "door.lock").st_ino:
                    raise FileNotFoundError
            except FileNotFoundError:
                os.close(door)
                continue
            users = os.open(self.folder / "users.lock", os.O_RDWR | os.O_CREAT, 0o600)
            with contextlib.suppress(BlockingIOError):
                fcntl.flock(users, fcntl.LOCK_EX | fcntl.LOCK_NB)
                self._empty(len(self.piece_size))  # the first user: nothing kept is trusted
            fcntl.flock(users, fcntl.LOCK_SH)  # held for life; the kernel drops it at death
            fcntl.flock(door, fcntl.LOCK_UN)
            self._users = users
            return door

    def _empty(self, n: int) -> None:
        for entry in self.folder.iterdir():
            if entry.name not in ("door.lock", "users.lock"):
                entry.unlink()
        with open(self.folder / "pieces.state", "wb") as fh:
            fh.truncate(n)
        _check_punch_hole(self.folder)

    def close(self) -> None:
        """Leave the folder; the last user removes it."""
        fcntl.flock(self._door, fcntl.LOCK_EX)
        try:
            fcntl.flock(self._users, fcntl.LOCK_UN)
            with contextlib.suppress(BlockingIOError):
                fcntl.flock(self._users, fcntl.LOCK_EX | fcntl.LOCK_NB)
                shutil.rmtree(self.folder, ignore_errors=True)
        finally:
            for fd in (self._users, self._holds, self._claims, self._door):
                os.close(fd)

    # -- pieces --------------------------------------------------------------------------

    def hold(self, pieces: np.ndarray) -> None:
        """Shared locks on ``pieces`` (sorted, distinct): no rank evicts them until released.
        Waits only while an eviction of one of them runs (a hole punched, no longer)."""
        for first, count in runs(pieces):
            lock_bytes(self._holds, fcntl.F_RDLCK, first, count)

    def release(self, pieces: np.ndarray) -> None:
        for first, count in runs(pieces):
            lock_bytes(self._holds, fcntl.F_UNLCK, first, count)

    def claim(self, piece: int) -> None:
        """The right to fetch ``piece`` (exclusive): waits while another rank fetches it."""
        lock_bytes(self._claims, fcntl.F_WRLCK, piece)

    def try_claim(self, piece: int) -> bool:
        """:meth:`claim` without waiting: False when another rank fetches ``piece``."""
        return lock_bytes(self._claims, fcntl.F_WRLCK, piece, wait=False)

    def unclaim(self, piece: int) -> None:
        lock_bytes(self._claims, fcntl.F_UNLCK, piece)

    def lock_space(self) -> None:
        """Exclusive use of the machine's count of bytes (see the module's docstring)."""
        lock_bytes(self._claims, fcntl.F_WRLCK, self._space_byte)

    def unlock_space(self) -> None:
        lock_bytes(self._claims, fcntl.F_UNLCK, self._space_byte)

    def resident(self) -> int:
        """Bytes of the pieces present or being written, on the whole machine."""
        return int(self.piece_size[self.state != ABSENT].sum())

    def try_evict(self, piece: int, punch: Callable[[int], None]) -> bool:
        """Drop ``piece`` unless some rank holds it (no wait); ``punch(piece)`` frees its
        bytes. Called under :meth:`lock_space`, for a piece this rank does not hold."""
        if self.state[piece] == ABSENT:
            return False
        if not lock_bytes(self._holds, fcntl.F_WRLCK, piece, wait=False):
            return False
        try:
            self.state[piece] = ABSENT  # first: a rank that holds it next fetches it again
            punch(piece)
        finally:
            lock_bytes(self._holds, fcntl.F_UNLCK, piece)
        return True


def _parent(cache_dir: str) -> Path:
    parent = Path(cache_dir or tempfile.gettempdir())
    try:
        parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise DataError(
            f"data.cache_dir {cache_dir}: cannot make it ({exc.strerror or exc})"
        ) from None
    return parent


def _own_folder(folder: Path) -> None:
    """``folder`` made (mode 0700), or found, this user's and closed to others. Its pieces are
    trusted once marked present, so a folder another local user made or can write (the
    default parent is the shared temporary folder, the name predictable) is refused."""
    folder.mkdir(mode=0o700, exist_ok=True)
    found = folder.lstat()
    if found.st_uid != os.geteuid() or found.st_mode & 0o077 or folder.is_symlink():
        raise DataError(
            f"data.cache_dir {folder.parent}: {folder.name} belongs to another user or is open "
            "to others, and the cache trusts what it holds; remove it, or set data.cache_dir "
            "to a folder of your own"
        )


def _check_punch_hole(folder: Path) -> None:
    probe = folder / ".probe"
    fd = os.open(probe, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        os.pwrite(fd, b"\1" * 8192, 0)
        punch_hole(fd, 0, 4096)
    except OSError as exc:
        if exc.errno in (errno.EOPNOTSUPP, errno.ENOSYS):
            raise DataError(
                f"data.cache_dir {folder.parent}: its file system cannot free part of a file "
                "(fallocate's punch hole), which the cache of shard pieces needs to stay "
                "within data.cache_bytes; choose a folder on ext4, xfs, btrfs or tmpfs"
            ) from None
        raise
    finally:
        os.close(fd)
        probe.unlink()
