"""A dataset's shards in an object store (``s3://bucket/data``), read by one process through a
bounded local cache of pieces.

A shard file is read in pieces: byte ranges of ``piece_bytes`` (the manifest's; `dtrain prepare`
to a store records one SHA-256 per piece), each fetched with one range request, checked (its
hash, or its length where the manifest has no piece hashes), and written at its offset into a
sparse local file of the shard file's size. That file is memory-mapped as a local shard is, so
reading rows is the local path's; only the bytes of the pieces fetched are on the disk.

Invariants: a piece is read only while it is held (:meth:`StoreShards.hold`, which fetches what
is absent, or waits for the thread already fetching it), and a held piece is never evicted.
Evicting punches the piece's bytes out of the local file (``fallocate``), least recently used
first among the pieces no one holds, so the cache's disk use stays under ``limit`` as long as
the pieces held at once fit in it (the read-ahead, :mod:`dtrain.data.read_ahead`, holds no more).
The offsets files of variable-length fields (8 bytes a sample) are read whole, into memory.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import hashlib
import io
import os
import shutil
import tempfile
import threading
import weakref
from collections import OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

from dtrain.config.sections import STORE_PIECE_BYTES
from dtrain.errors import DataError
from dtrain.storage.objects import ObjectPath, StoreError

_PUNCH_HOLE = 0x02 | 0x01  # FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE
_libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
_libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]


def punch_hole(fd: int, offset: int, length: int) -> None:
    """Free ``length`` bytes at ``offset`` of a file, which then reads as zeros."""
    if _libc.fallocate(fd, _PUNCH_HOLE, offset, length) != 0:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code))


def piece_hashes(path: Path, piece_bytes: int) -> list[str]:
    """The SHA-256 of each ``piece_bytes`` of a file, in order (what a reader checks each
    piece it fetches against)."""
    out = []
    with open(path, "rb") as fh:
        while chunk := fh.read(piece_bytes):
            out.append(hashlib.sha256(chunk).hexdigest())
    return out


class StoreShards:
    """The files of a dataset in a store, in manifest order, and the pieces of them that this
    process has fetched (see the module's docstring)."""

    def __init__(self, root: ObjectPath, manifest: dict[str, Any], cache_dir: str, limit: int):
        self.root = root
        self.piece_bytes = int(manifest.get("piece_bytes") or STORE_PIECE_BYTES)
        if self.piece_bytes <= 0:
            raise DataError(f"{root}/manifest.json: piece_bytes {self.piece_bytes} is not a size")
        self.limit = limit
        self.names: list[str] = []
        self.hashes: list[list[str] | None] = []
        sizes = []
        for shard in manifest["shards"]:
            for fname in sorted(shard["files"]):
                info = shard["files"][fname]
                self.names.append(fname)
                sizes.append(int(info["bytes"]))
                self.hashes.append(info.get("piece_sha256"))
        self.index = {name: i for i, name in enumerate(self.names)}
        self.sizes = np.asarray(sizes, dtype=np.int64)
        counts = -(-self.sizes // self.piece_bytes)
        # base[f]: the global id of file f's first piece; base[-1] the number of pieces.
        self.base = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        n = int(self.base[-1])
        # Every piece is piece_bytes long but a file's last, which holds what is left.
        last, has = self.base[1:] - 1, counts > 0
        self.piece_size = np.full(n, self.piece_bytes, dtype=np.int64)
        self.piece_size[last[has]] = self.sizes[has] - (counts[has] - 1) * self.piece_bytes
        for name, hashes, count in zip(self.names, self.hashes, counts.tolist(), strict=True):
            if hashes is not None and len(hashes) != count:
                raise DataError(
                    f"{root}/manifest.json is malformed: {name} lists {len(hashes)} piece "
                    f"hashes for {count} pieces of {self.piece_bytes} bytes; prepare the "
                    "dataset again"
                )
        self.present = np.zeros(n, dtype=bool)
        self.holds = np.zeros(n, dtype=np.int64)
        self.held_bytes = 0  # bytes of the pieces some reader holds
        self.resident = 0  # bytes of the pieces present on the disk
        self.fetched = 0  # bytes fetched so far, every piece each time it was fetched
        self._recent: OrderedDict[int, None] = OrderedDict()  # present pieces, LRU first
        self._fetching: set[int] = set()
        self._lock = threading.Condition()
        self._check_objects()
        folder = self._make_folder(cache_dir)
        self.folder = folder
        self._fds: dict[int, int] = {}
        self._finalizer = weakref.finalize(self, _remove, folder, self._fds)

    # -- opening ---------------------------------------------------------------------------

    def key(self, file: int) -> str:
        return f"{self.root}/{self.names[file]}"

    def _check_objects(self) -> None:
        """Every file the manifest lists is in the store with its size (one listing)."""
        sizes = self.root.sizes()  # the shard files lie flat under the prefix
        for name, size in zip(self.names, self.sizes.tolist(), strict=True):
            if name not in sizes:
                raise DataError(
                    f"shard file {name} is missing in the {self.root.store()} (key "
                    f"{self.root}/{name}, listed in its manifest); prepare the dataset again"
                )
            if sizes[name] != size:
                raise DataError(
                    f"shard file {self.root}/{name} has {sizes[name]} bytes in the store, the "
                    f"manifest says {size}: it was changed or cut short; prepare the dataset "
                    "again"
                )

    def _make_folder(self, cache_dir: str) -> str:
        if cache_dir:
            try:
                Path(cache_dir).mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise DataError(
                    f"data.cache_dir {cache_dir}: cannot make it ({exc.strerror or exc})"
                ) from None
        folder = tempfile.mkdtemp(prefix="dtrain-shards-", dir=cache_dir or None)
        probe = os.path.join(folder, ".probe")
        fd = os.open(probe, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            os.pwrite(fd, b"\1" * 8192, 0)
            punch_hole(fd, 0, 4096)
        except OSError as exc:
            shutil.rmtree(folder, ignore_errors=True)
            if exc.errno in (errno.EOPNOTSUPP, errno.ENOSYS):
                raise DataError(
                    f"data.cache_dir {cache_dir or tempfile.gettempdir()}: its file system "
                    "cannot free part of a file (fallocate's punch hole), which the cache of "
                    "shard pieces needs to stay within data.cache_bytes; choose a folder on "
                    "ext4, xfs, btrfs or tmpfs"
                ) from None
            raise
        finally:
            os.close(fd)
        os.unlink(probe)
        return folder

    def local_path(self, file: int) -> str:
        """The sparse local file of ``file``, made the first time it is asked for."""
        with self._lock:
            if file not in self._fds:
                path = os.path.join(self.folder, self.names[file])
                fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
                os.ftruncate(fd, int(self.sizes[file]))
                self._fds[file] = fd
            return os.path.join(self.folder, self.names[file])

    def read_whole(self, name: str) -> bytes:
        """A (small) file's bytes, every piece checked; not cached."""
        file = self.index[name]
        data = self._request(file, 0, int(self.sizes[file]))
        for k in range(int(self.base[file + 1] - self.base[file])):
            start = k * self.piece_bytes
            self._check(file, k, data[start : start + self.piece_bytes])
        return data

    def load_array(self, name: str) -> np.ndarray:
        return np.load(io.BytesIO(self.read_whole(name)), allow_pickle=False)

    # -- pieces ----------------------------------------------------------------------------

    def pieces(self, file: np.ndarray, start: np.ndarray, stop: np.ndarray) -> np.ndarray:
        """The global ids of the pieces that hold bytes ``start .. stop-1`` of each ``file``
        (arrays of one length), sorted, each once."""
        keep = stop > start
        file, start, stop = file[keep], start[keep], stop[keep]
        if len(file) == 0:
            return np.empty(0, dtype=np.int64)
        first = start // self.piece_bytes
        count = (stop - 1) // self.piece_bytes - first + 1
        # One run of consecutive pieces per range: its first piece repeated, plus 0, 1, ...
        total = int(count.sum())
        begin = np.repeat(np.cumsum(count) - count, count)
        local = np.repeat(first, count) + (np.arange(total) - begin)
        return np.unique(local + np.repeat(self.base[file], count))

    def bytes_of(self, pieces: np.ndarray) -> int:
        return int(self.piece_size[pieces].sum())

    def new_bytes(self, pieces: np.ndarray) -> int:
        """Bytes that holding ``pieces`` would add to what is held."""
        with self._lock:
            return self.bytes_of(pieces[self.holds[pieces] == 0])

    def take(self, pieces: np.ndarray) -> None:
        """Hold ``pieces`` (no fetch): none is evicted until :meth:`give_back`."""
        with self._lock:
            fresh = pieces[self.holds[pieces] == 0]
            self.held_bytes += self.bytes_of(fresh)
            self.holds[pieces] += 1
            for p in pieces[self.present[pieces]].tolist():
                self._recent.move_to_end(p)

    def give_back(self, pieces: np.ndarray) -> None:
        with self._lock:
            self.holds[pieces] -= 1
            self.held_bytes -= self.bytes_of(pieces[self.holds[pieces] == 0])
            self._lock.notify_all()

    def wait_room(self, nbytes: int, stopped: threading.Event) -> bool:
        """Wait until ``nbytes`` more can be held within the limit; False when ``stopped``."""
        with self._lock:
            while self.held_bytes + nbytes > self.limit and not stopped.is_set():
                self._lock.wait(0.5)
            return not stopped.is_set()

    @contextmanager
    def hold(self, pieces: np.ndarray) -> Iterator[None]:
        """``pieces`` present and held while the block reads them."""
        self.take(pieces)
        try:
            self.fetch(pieces)
            yield
        finally:
            self.give_back(pieces)

    def fetch(self, pieces: np.ndarray) -> None:
        """Make held ``pieces`` present: fetch those no thread fetches, wait for the others.
        A piece another thread failed to fetch is absent and no longer being fetched: this
        thread then fetches it itself, and meets the failure itself (never a wait forever)."""
        while True:
            with self._lock:
                missing = pieces[~self.present[pieces]].tolist()
                if not missing:
                    return
                mine = [p for p in missing if p not in self._fetching]
                if not mine:
                    self._lock.wait(0.5)
                    continue
                self._fetching.update(mine)
            try:
                for p in mine:
                    self._fetch_one(p)
            finally:
                with self._lock:
                    self._fetching.difference_update(mine)
                    self._lock.notify_all()

    def _fetch_one(self, piece: int) -> None:
        file = int(np.searchsorted(self.base, piece, side="right")) - 1
        k = piece - int(self.base[file])
        start = k * self.piece_bytes
        size = int(self.piece_size[piece])
        data = self._request(file, start, start + size)
        self._check(file, k, data)
        self.local_path(file)
        with self._lock:
            self._make_room(size)
            self.resident += size  # reserved before the write: two fetches never overrun
        try:
            os.pwrite(self._fds[file], data, start)
        except BaseException:
            with self._lock:
                self.resident -= size
            raise
        with self._lock:
            self.present[piece] = True
            self._recent[piece] = None
            self.fetched += size

    def _make_room(self, size: int) -> None:
        """Evict unheld pieces, least recently used first, until ``size`` more fit (called
        holding the lock)."""
        for p in list(self._recent):
            if self.resident + size <= self.limit:
                return
            if self.holds[p] == 0:
                self._evict(p)
        if self.resident + size > self.limit:
            raise DataError(
                f"data.cache_bytes = {self.limit} cannot hold the pieces that reads of "
                f"{self.root} need at once ({self.resident} bytes held, pieces of "
                f"{self.piece_bytes}); raise data.cache_bytes"
            )

    def _evict(self, piece: int) -> None:
        file = int(np.searchsorted(self.base, piece, side="right")) - 1
        start = (piece - int(self.base[file])) * self.piece_bytes
        punch_hole(self._fds[file], start, int(self.piece_size[piece]))
        self.present[piece] = False
        self.resident -= int(self.piece_size[piece])
        del self._recent[piece]

    def _request(self, file: int, start: int, stop: int) -> bytes:
        obj = self.root / self.names[file]
        key = str(obj)
        try:
            data = obj.read_range(start, stop)
        except FileNotFoundError:
            raise DataError(
                f"shard file {self.names[file]} is missing in the {self.root.store()} (key "
                f"{key}); prepare the dataset again"
            ) from None
        except StoreError as exc:
            raise DataError(f"reading shard file {self.names[file]}: {exc}") from None
        if len(data) != stop - start:
            raise DataError(
                f"shard file {key}: bytes {start}..{stop} came back as {len(data)} bytes: "
                "the object is shorter than its manifest says; prepare the dataset again"
            )
        return data

    def _check(self, file: int, k: int, data: bytes) -> None:
        hashes = self.hashes[file]
        if hashes is not None and hashlib.sha256(data).hexdigest() != hashes[k]:
            start = k * self.piece_bytes
            raise DataError(
                f"shard file {self.key(file)}: bytes {start}..{start + len(data)} fail their "
                "SHA-256 in the manifest: the object was changed or damaged; prepare the "
                "dataset again"
            )


def _remove(folder: str, fds: dict[int, int]) -> None:
    for fd in fds.values():
        os.close(fd)
    shutil.rmtree(folder, ignore_errors=True)
