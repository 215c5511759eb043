"""A dataset's shards in an object store (``s3://bucket/data``), read through a bounded cache
of pieces that the ranks of a machine share (:mod:`dtrain.data.node_cache`).

A shard file is read in pieces: byte ranges of ``piece_bytes`` (the manifest's; `dtrain prepare`
to a store records one SHA-256 per piece), fetched by one rank of the machine, up to
``RUN_PIECES`` consecutive ones with one range request, each checked (its hash, or its length
where the manifest has no piece hashes), and
written at its offset into the machine's sparse local file of the shard file's size. That file
is memory-mapped as a local shard is, so reading rows is the local path's; only the bytes of
the pieces fetched are on the disk.

Invariants: a piece is read only while it is held (:meth:`StoreShards.hold`, which fetches what
is absent, or waits for the thread or the rank already fetching it), and a piece any rank of
the machine holds is never evicted. Evicting punches the piece's bytes out of the local file
(``fallocate``), this rank's least recently used first among the pieces no rank holds, so the
machine's disk use stays under ``limit`` as long as the pieces held at once fit in it (each
rank's read-ahead, :mod:`dtrain.data.read_ahead`, holds at most its share, :attr:`budget`).
The offsets files of variable-length fields (8 bytes a sample) are read whole, into memory, by
each rank.
"""

from __future__ import annotations

import hashlib
import io
import itertools
import os
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np

from dtrain.config.sections import STORE_PIECE_BYTES
from dtrain.data.node_cache import ABSENT, PRESENT, WRITING, NodeCache, folder_name, punch_hole
from dtrain.errors import DataError
from dtrain.storage.objects import ObjectPath, StoreError

# Consecutive pieces of a file fetched with one range request, at most: fewer requests (each
# costs the client and the store CPU of its own), still several in flight for a step.
RUN_PIECES = 4


def piece_hashes(path: str | os.PathLike[str], piece_bytes: int) -> list[str]:
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
        self.holds = np.zeros(n, dtype=np.int64)  # this rank's readers of each piece
        self.held_bytes = 0  # bytes of the pieces this rank's readers hold
        self.fetched = 0  # bytes this rank fetched, every piece each time it fetched it
        self.requests = 0  # range requests this rank sent
        self.hash_seconds = 0.0  # time this rank spent on the SHA-256 of what it fetched
        # Ranks of this machine reading through the cache: each holds at most its share of
        # `limit` ahead (dtrain.data.read_ahead), so that together they fit in it.
        self.sharers = 1
        self._recent: OrderedDict[int, None] = OrderedDict()  # pieces this rank used, LRU first
        self._fetching: set[int] = set()
        self._lock = threading.Condition()
        self._check_objects()
        fingerprint = str(manifest.get("fingerprint", ""))
        self.cache = NodeCache(
            cache_dir, folder_name(str(root), fingerprint, self.piece_bytes), self.piece_size
        )
        self.folder = str(self.cache.folder)
        self._fds: dict[int, int] = {}
        self._finalizer = weakref.finalize(self, _close, self.cache, self._fds)

    def close(self) -> None:
        """Leave the machine's cache (the last rank to leave removes it); also at exit."""
        self._finalizer()

    @property
    def budget(self) -> int:
        """Bytes this rank may hold ahead: its share of the machine's ``limit``."""
        return max(self.piece_bytes, self.limit // self.sharers)

    def present(self, pieces: np.ndarray) -> np.ndarray:
        """Which of ``pieces`` are on this machine's disk, checked (a rank of it fetched them)."""
        return np.asarray(self.cache.state[pieces] == PRESENT)

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
        with self._lock:
            self.requests += 1
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
        """Hold ``pieces`` (no fetch): no rank of the machine evicts them until
        :meth:`give_back`."""
        with self._lock:
            fresh = pieces[self.holds[pieces] == 0]
            self.cache.hold(fresh)
            self.held_bytes += self.bytes_of(fresh)
            self.holds[pieces] += 1
            for p in pieces.tolist():
                self._recent[p] = None
                self._recent.move_to_end(p)
            # Only an order of eviction (others' pieces are evicted too): kept to about what
            # the cache holds, since other ranks may evict what this one used.
            while len(self._recent) > 2 * (self.limit // self.piece_bytes + 1):
                self._recent.popitem(last=False)

    def give_back(self, pieces: np.ndarray) -> None:
        with self._lock:
            self.holds[pieces] -= 1
            gone = pieces[self.holds[pieces] == 0]
            self.held_bytes -= self.bytes_of(gone)
            self.cache.release(gone)
            self._lock.notify_all()

    def wait_room(self, nbytes: int, stopped: threading.Event) -> bool:
        """Wait until ``nbytes`` more can be held within this rank's budget; False when
        ``stopped``."""
        with self._lock:
            while self.held_bytes + nbytes > self.budget and not stopped.is_set():
                self._lock.wait(0.5)
            return not stopped.is_set()

    def wake(self) -> None:
        """Wake the threads in :meth:`wait_room` (one was stopped)."""
        with self._lock:
            self._lock.notify_all()

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
        """Make held ``pieces`` present: fetch those no thread of this rank fetches, wait for
        the others. A piece another thread failed to fetch is absent and no longer being
        fetched: this thread then fetches it itself, and meets the failure itself (never a
        wait forever)."""
        while True:
            with self._lock:
                missing = pieces[self.cache.state[pieces] != PRESENT].tolist()
                if not missing:
                    # The lock's acquire orders this rank's reads of the bytes after the
                    # state it saw (the writer set the state after its write returned).
                    return
                mine = [p for p in missing if p not in self._fetching]
                if not mine:
                    self._lock.wait(0.5)
                    continue
                self._fetching.update(mine)
            try:
                for run in self.runs(np.asarray(mine, dtype=np.int64)):
                    self._fetch_run(run.tolist())
            finally:
                with self._lock:
                    self._fetching.difference_update(mine)
                    self._lock.notify_all()

    def runs(self, pieces: np.ndarray) -> list[np.ndarray]:
        """Sorted ``pieces`` cut into runs of consecutive pieces of one file, each at most
        :data:`RUN_PIECES` long: one range request a run."""
        if len(pieces) == 0:
            return []
        file = np.searchsorted(self.base, pieces, side="right")
        cut = np.flatnonzero((np.diff(pieces) != 1) | (np.diff(file) != 0)) + 1
        out = []
        for run in np.split(pieces, cut):
            out.extend(np.split(run, range(RUN_PIECES, len(run), RUN_PIECES)))
        return out

    def _fetch_run(self, run: list[int]) -> None:
        """Fetch held pieces of one file, consecutive, with one range request; those another
        rank of the machine fetches are left for it: this waits for the first piece's claim
        only, never while it holds another (so no two ranks wait on each other)."""
        file = int(np.searchsorted(self.base, run[0], side="right")) - 1
        self.local_path(file)
        self.cache.claim(run[0])  # waits while another rank fetches it
        claimed = [run[0]]
        try:
            for p in run[1:]:
                if not self.cache.try_claim(p):
                    break
                claimed.append(p)
            # The claimed pieces still absent, up to the first one another rank fetched.
            todo = list(itertools.takewhile(lambda p: self.cache.state[p] != PRESENT, claimed))
            if todo:
                self._fetch_claimed(file, todo)
        finally:
            for p in claimed:
                self.cache.unclaim(p)

    def _fetch_claimed(self, file: int, run: list[int]) -> None:
        first = run[0] - int(self.base[file])
        start = first * self.piece_bytes
        sizes = self.piece_size[run]
        self._reserve(run)
        try:
            data = self._request(file, start, start + int(sizes.sum()))
            offset = 0
            for k, size in enumerate(sizes.tolist()):
                self._check(file, first + k, data[offset : offset + size])
                offset += size
            os.pwrite(self._fds[file], data, start)
        except BaseException:
            self._drop(run)
            raise
        self.cache.state[run] = PRESENT  # after the checked bytes are written
        with self._lock:
            self.fetched += len(data)
            self.requests += 1

    def _reserve(self, pieces: list[int]) -> None:
        """Count claimed ``pieces`` in the machine's bytes, evicting what must go for them. A
        piece a rank that claimed it before died with is counted already (being written)."""
        with self._lock:
            self.cache.lock_space()
            try:
                new = [p for p in pieces if self.cache.state[p] == ABSENT]
                self._make_room(self.bytes_of(np.asarray(new, dtype=np.int64)))
                self.cache.state[new] = WRITING
            finally:
                self.cache.unlock_space()

    def _drop(self, pieces: list[int]) -> None:
        """Claimed pieces whose fetch failed: no longer counted, their bytes (if any) freed."""
        with self._lock:
            self.cache.lock_space()
            try:
                for p in pieces:
                    self.cache.state[p] = ABSENT
                    self._punch(p)
            finally:
                self.cache.unlock_space()

    def _make_room(self, size: int) -> None:
        """Evict pieces no rank holds, this rank's least recently used first, then any other,
        until ``size`` more fit in the machine's ``limit`` (called under the space lock)."""
        resident = self.cache.resident()
        if resident + size <= self.limit:
            return
        others = np.flatnonzero(self.cache.state != ABSENT).tolist()
        for p in [*self._recent, *others]:
            # A piece this rank holds: its own shared lock would not stop its eviction.
            if self.holds[p] > 0:
                continue
            if self.cache.try_evict(p, self._punch):
                resident -= int(self.piece_size[p])
            if self.cache.state[p] == ABSENT:
                self._recent.pop(p, None)
            if resident + size <= self.limit:
                return
        raise DataError(
            f"data.cache_bytes = {self.limit} cannot hold the pieces that the reads of "
            f"{self.root} on this machine need at once ({resident} bytes held, pieces of "
            f"{self.piece_bytes}); raise data.cache_bytes"
        )

    def _punch(self, piece: int) -> None:
        file = int(np.searchsorted(self.base, piece, side="right")) - 1
        start = (piece - int(self.base[file])) * self.piece_bytes
        self.local_path(file)
        punch_hole(self._fds[file], start, int(self.piece_size[piece]))

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
        if hashes is None:
            return
        began = time.perf_counter()
        digest = hashlib.sha256(data).hexdigest()
        with self._lock:
            self.hash_seconds += time.perf_counter() - began
        if digest != hashes[k]:
            start = k * self.piece_bytes
            raise DataError(
                f"shard file {self.key(file)}: bytes {start}..{start + len(data)} fail their "
                "SHA-256 in the manifest: the object was changed or damaged; prepare the "
                "dataset again"
            )


def _close(cache: NodeCache, fds: dict[int, int]) -> None:
    for fd in fds.values():
        os.close(fd)
    cache.close()
