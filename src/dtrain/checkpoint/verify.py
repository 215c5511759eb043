"""Verifying a checkpoint's files against its completion marker, the work shared by the ranks.

The marker lists every file's size and the SHA-256 of each of its pieces
(:data:`~dtrain.checkpoint.layout.PIECE_BYTES`). :func:`assign` deals the pieces out: a pure
function of the marker and the world size, so every rank computes the same shares without
asking. A rank's own files -- its RNG state, its communication state, its replica, its DCP
shards -- are its own to verify (it reads them again to load them, from the page cache its
check filled); every other piece goes to the rank with the fewest bytes so far, so each rank
hashes about ``1 / world size`` of the checkpoint. :func:`verify_pieces` checks one share and
names the first file that does not match.

How the ranks then agree on the outcome, without waiting for each other under the collective
timeout, is :mod:`dtrain.checkpoint.resume`'s.
"""

from __future__ import annotations

import hashlib
import heapq
import re
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from dtrain.checkpoint import copies
from dtrain.checkpoint.copies import RangeRead
from dtrain.checkpoint.layout import MARKER, SHARDED_DIR
from dtrain.checkpoint.store import open_read
from dtrain.fault.failpoints import failpoint
from dtrain.storage.objects import Location, ObjectPath, StoreError

# Bytes read and hashed between two progress marks.
_CHUNK = 8 * 2**20
# A store's runs of pieces asked for at once (the one being hashed and those after it): a
# request's round trip is not waited for run after run, and their answers stream side by side,
# each holding at most about two chunks unread (:class:`~dtrain.checkpoint.copies.RangeRead`).
READS_IN_FLIGHT = 4

# Files that belong to one rank, by the rank in their name: rng-rankNNNNN.pt,
# comm-rankNNNNN.pt, model-rankNNNNN.pt and optimizer-rankNNNNN.pt (localsgd, diloco), and
# DCP's dcp/__R_I.distcp.
_OWNED = (
    re.compile(r"^(?:rng|comm|model|optimizer)-rank(\d+)\.pt$"),
    re.compile(rf"^{SHARDED_DIR}/__(\d+)_\d+\.distcp$"),
)


@dataclass(frozen=True)
class Piece:
    """One piece of a file to hash: ``length`` bytes from ``start``, whose SHA-256 is
    ``digest``."""

    name: str  # the file, relative to the step folder
    index: int
    start: int
    length: int
    digest: str
    file_bytes: int  # the whole file's size, as the marker gives it

    def describe(self) -> str:
        if self.file_bytes <= self.length:
            return ""
        return f" (bytes {self.start}-{self.start + self.length - 1} of {self.file_bytes})"


def pieces_of(marker: dict[str, Any]) -> list[Piece]:
    """Every piece of every file the marker lists (a marker that :func:`read_marker` took)."""
    out = []
    for name, info in sorted(marker["files"].items()):
        size = int(info["bytes"])
        step = int(info["piece_bytes"])
        for index, digest in enumerate(info["pieces"]):
            start = index * step
            out.append(Piece(name, index, start, max(0, min(step, size - start)), digest, size))
    return out


def owner_of(name: str, world_size: int) -> int | None:
    """The rank whose own file ``name`` is, if it is one and that rank exists now."""
    for pattern in _OWNED:
        match = pattern.match(name)
        if match:
            rank = int(match.group(1))
            return rank if rank < world_size else None
    return None


def assign(marker: dict[str, Any], world_size: int) -> list[list[Piece]]:
    """Each rank's pieces to verify (index: rank), in file order. A rank's own files are its
    own; the other pieces go, largest first, to the rank with the fewest bytes so far (ties:
    the lowest rank)."""
    shares: list[list[Piece]] = [[] for _ in range(world_size)]
    loads = [0] * world_size
    rest = []
    for piece in pieces_of(marker):
        owner = owner_of(piece.name, world_size)
        if owner is None:
            rest.append(piece)
        else:
            shares[owner].append(piece)
            loads[owner] += piece.length
    heap = [(load, rank) for rank, load in enumerate(loads)]
    heapq.heapify(heap)
    for piece in sorted(rest, key=lambda p: (-p.length, p.name, p.index)):
        load, rank = heapq.heappop(heap)
        shares[rank].append(piece)
        heapq.heappush(heap, (load + piece.length, rank))
    return [sorted(share, key=lambda p: (p.name, p.start)) for share in shares]


def verify_pieces(
    step_dir: Location, pieces: Iterable[Piece], on_progress: Callable[[], None] | None = None
) -> str | None:
    """Check ``pieces`` of the checkpoint in ``step_dir``: None, or the first problem, naming
    the file (missing, of another size, or failing its checksum). ``on_progress`` is called
    after each 8 MiB hashed and each piece. A store's pieces that follow each other in one
    file are one ranged read (:func:`runs_of`), :data:`READS_IN_FLIGHT` of them asked for at a
    time, and each file's size comes with its first range's answer (no listing, no look-up)."""
    tick = on_progress or (lambda: None)
    todo = list(pieces)
    if isinstance(step_dir, ObjectPath):
        return _verify_stored(step_dir, todo, tick)
    sizes: dict[str, int] = {}
    buffer = bytearray(_CHUNK)
    for piece in todo:
        path = step_dir / piece.name
        problem = _size_problem(path, None, piece, sizes)
        if problem:
            return problem
        failpoint("checkpoint.verify_piece", path=path, index=piece.index)
        if _hash_range(path, piece.start, piece.length, buffer, tick) != piece.digest:
            return f"{path} fails its SHA-256 checksum{piece.describe()}"
        tick()
    return None


def runs_of(pieces: list[Piece]) -> list[list[Piece]]:
    """``pieces`` (in file order) cut where one does not continue the last: a run is pieces of
    one file that follow each other, which one ranged read of a store brings (a resume on one
    rank reads each file with one request, not one a piece)."""
    runs: list[list[Piece]] = []
    for piece in pieces:
        last = runs[-1][-1] if runs else None
        if last is not None and last.name == piece.name and last.start + last.length == piece.start:
            runs[-1].append(piece)
        else:
            runs.append([piece])
    return runs


def _verify_stored(
    step_dir: ObjectPath, pieces: list[Piece], tick: Callable[[], None]
) -> str | None:
    """:func:`verify_pieces` for a store: a ranged read per run, the next ones asked for while
    one is hashed (a request's round trip is not waited for run after run)."""
    sizes: dict[str, int] = {}
    runs = runs_of(pieces)
    reads: deque[RangeRead] = deque()  # the runs from the current one on, asked for
    try:
        for at, run in enumerate(runs):
            for ahead in runs[at + len(reads) : at + READS_IN_FLIGHT]:
                length = ahead[-1].start + ahead[-1].length - ahead[0].start
                reads.append(RangeRead(step_dir / ahead[0].name, ahead[0].start, length))
            path = step_dir / run[0].name
            problem = _size_problem(path, reads[0], run[0], sizes)
            problem = problem or _hash_run(path, run, tick, reads.popleft())
            if problem:
                return problem
    finally:
        for reading in reads:
            reading.close()
    return None


def _size_problem(
    path: Location, reading: RangeRead | None, piece: Piece, sizes: dict[str, int]
) -> str | None:
    """Where ``piece``'s file (looked at once) is missing or of another size than the marker
    says, in words."""
    if piece.name not in sizes:
        size = _size(path, reading, piece.file_bytes)
        if size is None:
            return f"{path} is missing (listed in {MARKER})"
        sizes[piece.name] = size
        if size != piece.file_bytes:
            return f"{path} has {size} bytes, expected {piece.file_bytes}"
    return None


def _size(path: Location, reading: RangeRead | None, expected: int) -> int | None:
    """The file's size (None: there is none): from ``reading``'s answer where it is a store's
    range (no request of its own), else looked up. A range that starts past the object's end
    is refused by the store (HTTP 416): its size is looked up then, and the store's failure
    stays one where the object has the ``expected`` size (its range was no fault)."""
    try:
        if reading is not None:
            try:
                total = reading.total()
            except StoreError:
                if path.stat().st_size == expected:
                    raise
                total = None
            if total is not None:
                return total
        return path.stat().st_size
    except FileNotFoundError:
        return None


def _hash_range(
    path: Location, start: int, length: int, buffer: bytearray, tick: Callable[[], None]
) -> str:
    digest = hashlib.sha256()
    view = memoryview(buffer)
    with open_read(path) as fh:
        fh.seek(start)
        left = length
        while left > 0:
            got = fh.readinto(view[: min(left, len(view))])
            if not got:
                break  # the file is shorter than its size said a moment ago
            digest.update(view[:got])
            left -= got
            tick()
    return digest.hexdigest()


def _hash_run(
    path: ObjectPath, run: list[Piece], tick: Callable[[], None], reading: RangeRead
) -> str | None:
    """Each piece of ``run`` hashed from ``reading`` (its range, asked of the store) and checked
    as its last byte passes; the first that fails, in words. Inside a resume
    (:func:`dtrain.checkpoint.copies.keep_copies`) each chunk is kept as it passes, and each
    piece's range counts as verified once its digest matched."""
    kept = copies.active()
    todo = iter(run)
    piece: Piece | None = next(todo)
    failpoint("checkpoint.verify_piece", path=path, index=run[0].index)
    digest, filled, at = hashlib.sha256(), 0, run[0].start
    try:
        for data in reading:
            if kept is not None:
                kept.write(path, run[0].file_bytes, at, data)
            at += len(data)
            view = memoryview(data)
            while piece is not None and (len(view) or filled == piece.length):
                take = view[: piece.length - filled]
                digest.update(take)
                filled += len(take)
                view = view[len(take) :]
                if filled < piece.length:
                    break
                if digest.hexdigest() != piece.digest:
                    return f"{path} fails its SHA-256 checksum{piece.describe()}"
                if kept is not None:
                    kept.mark_verified(path, piece.start, piece.length)
                tick()
                piece = next(todo, None)
                if piece is not None:
                    failpoint("checkpoint.verify_piece", path=path, index=piece.index)
                digest, filled = hashlib.sha256(), 0
            tick()
    finally:
        reading.close()
    if piece is None:
        return None
    if piece.length == 0 and digest.hexdigest() == piece.digest:  # an empty file: no request
        tick()
        return None
    return f"{path} fails its SHA-256 checksum{piece.describe()}"  # the answer ended short
