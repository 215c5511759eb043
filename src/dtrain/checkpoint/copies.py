"""Verified copies of a store's checkpoint files, in memory or on the local disk, while a resume
reads them: one read of each byte from the store.

Locally, a resume hashes its share of a checkpoint's pieces and then loads its files again from
the page cache its check filled; a store has no page cache, so the load would download every
byte a second time. While a resume's scope is open (:func:`start`: from the choice of the
checkpoint, :func:`dtrain.checkpoint.resume.resolve_resume`, to the end of its load; or the
block of :func:`keep_copies`), each piece this process hashes from a store is kept, as it
streams past, in a copy of its file: in memory while the copies there hold at most
:data:`MEMORY_BYTES` (a small checkpoint: nothing written to a local file and read back), else
a sparse local file in a private folder (``run.local_dir``); a load then reads the copy, first
downloading only the ranges of the file this rank did not verify (the pieces the other ranks
checked: :func:`dtrain.checkpoint.verify.assign`), once. The copy of a whole file goes as soon
as it is loaded, and the rest when the scope ends: memory and the local disk hold at most this
rank's share of the checkpoint and the file being loaded.

Why copies of what a rank verified rather than verifying what it loads: the ranks of a
replicated job all load the same files, and verification is shared so that each hashes
``1 / world size`` of them; a rank completes its copy with the rest, so every rank still
downloads each byte it loads once, and the bytes it checked are the very bytes it loads.

A copy only ever holds bytes that arrived from the store; the ranges marked verified are those
whose piece matched the marker. Where the local disk refuses a copy (full), all copies are
dropped and reads go to the store as without them: slower, never other bytes.
"""

from __future__ import annotations

import asyncio
import bisect
import io
import os
import shutil
import tempfile
import weakref
from abc import ABC, abstractmethod
from collections.abc import Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import IO, Any

from dtrain.storage.objects import Location, ObjectPath

# Bytes of one ranged read from the store (and written to a copy at once).
CHUNK_BYTES = 4 * 2**20
# The most bytes of copies one process holds in memory at once; a file that would go past it
# is copied to the local disk. A small checkpoint's copies cost more to write to a file and
# read back (12 MiB: about 4 ms, a tenth of its whole resume) than to keep; a large one's
# share would take a rank's memory twice over beside the state it loads into, which is why
# copies go to disk at all. 256 MiB holds every file of a 100 MB model's AdamW checkpoint.
MEMORY_BYTES = 256 * 2**20


class RangeRead:
    """``length`` bytes of the object from ``start`` (fewer where it is shorter), in chunks of
    at most :data:`CHUNK_BYTES`: one ranged GET, asked for as soon as this is made, and its
    first chunk read as soon as it answers (a reader hashing an earlier range meanwhile finds
    it there: the store's answers stream side by side, not each once its turn comes), then
    streamed with one chunk read ahead -- a buffered file reads past the range, and a request
    per chunk costs a round trip each. What it holds unread is at most about two chunks (the
    stream's own buffer stops at twice the read asked for). :meth:`close` gives it up unread."""

    def __init__(self, path: ObjectPath, start: int, length: int) -> None:
        self.path, self.start, self.length = path, start, length
        self._answer: Future[Any] | None = None  # (the answer, its first chunk)
        self._ahead: Future[Any] | None = None
        if path.scheme == "s3" and length > 0:
            bucket, key = path.bucket_and_key
            span = f"bytes={start}-{start + length - 1}"
            call = path.fs._call_s3("get_object", Bucket=bucket, Key=key, Range=span)
            first = _answer_and_first(call, min(CHUNK_BYTES, length))
            self._answer = asyncio.run_coroutine_threadsafe(first, path.fs.loop)

    def total(self) -> int | None:
        """The whole object's size, from the answer's ``Content-Range`` (waited for); None
        where the store's answer gives none (another fsspec store, an empty range).
        FileNotFoundError: no such object."""
        if self._answer is None:
            return None
        answer, _ = self.path._call("read", self._answer.result)
        size = str(answer.get("ContentRange") or "").rpartition("/")[2]
        return int(size) if size.isdigit() else None

    def __iter__(self) -> Iterator[bytes]:
        path, start, length = self.path, self.start, self.length
        if length <= 0:
            return
        if self._answer is None:  # another fsspec store: a ranged read per chunk
            for at in range(start, start + length, CHUNK_BYTES):
                end = min(at + CHUNK_BYTES, start + length)
                yield path.read_range(at, end)
            return
        answer, chunk = path._call("read", self._answer.result)
        body, loop = answer["Body"], path.fs.loop
        left = length
        while chunk:
            left -= len(chunk)
            if left <= 0:
                yield bytes(chunk)
                return
            ahead = asyncio.run_coroutine_threadsafe(body.read(min(CHUNK_BYTES, left)), loop)
            self._ahead = ahead
            yield bytes(chunk)
            chunk = path._call("read", ahead.result)

    def close(self) -> None:
        for future in (self._ahead, self._answer):
            if future is not None:
                future.cancel()
        answer = self._answer
        answered = answer is not None and answer.done() and not answer.cancelled()
        if answer is not None and answered and answer.exception() is None:
            # The body is the loop's to close (a request cancelled earlier closed its own).
            self.path.fs.loop.call_soon_threadsafe(answer.result()[0]["Body"].close)


async def _answer_and_first(call: Any, first: int) -> tuple[Any, bytes]:
    """A ranged GET's answer and the first ``first`` bytes of its body (its body closed where
    this is cancelled or fails meanwhile)."""
    answer = await call
    try:
        return answer, await answer["Body"].read(first)
    except BaseException:
        answer["Body"].close()
        raise


def read_whole(path: ObjectPath) -> bytes:
    """A small object's bytes: one GET (s3fs's ``cat_file`` asks for its size first)."""
    if path.scheme != "s3":
        return path.read_bytes()
    from fsspec.asyn import sync

    async def get() -> bytes:
        bucket, key = path.bucket_and_key
        answer = await path.fs._call_s3("get_object", Bucket=bucket, Key=key)
        async with answer["Body"] as body:
            return bytes(await body.read())

    return bytes(path._call("read", partial(sync, path.fs.loop, get)))


def read_range(path: ObjectPath, start: int, length: int) -> Iterator[bytes]:
    """The bytes of one range (:class:`RangeRead`), its request closed however it ends."""
    reading = RangeRead(path, start, length)
    try:
        yield from reading
    finally:
        reading.close()


class _Copy(ABC):
    """What this process kept of one file of ``size`` bytes: the ranges written, and those of
    them that matched the marker (``verified``)."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.verified: list[tuple[int, int]] = []  # (start, length)

    def gaps(self) -> list[tuple[int, int]]:
        """The ranges not verified here, in order."""
        out, at = [], 0
        for start, length in sorted(self.verified):
            if start > at:
                out.append((at, start - at))
            at = max(at, start + length)
        if at < self.size:
            out.append((at, self.size - at))
        return out

    @abstractmethod
    def put(self, start: int, data: bytes) -> None:
        """Keep ``data`` at ``start`` (OSError: the local disk refused it)."""

    @abstractmethod
    def keep_verified(self) -> None:
        """Before the gaps are filled: let what it holds of them go."""

    @abstractmethod
    def open(self) -> IO[bytes]:
        """The copy, for reading (complete once :meth:`KeptCopies.completed` gave it)."""

    def loadable(self) -> Path | IO[bytes]:
        """What ``torch.load`` reads it from."""
        return self.open()

    @abstractmethod
    def drop(self) -> None:
        """Give its room back."""


class _MemoryCopy(_Copy):
    """A copy in this process's memory (a file of at most :data:`MEMORY_BYTES`): the chunks as
    they arrived from the store, kept as they are (no local file written and read back, no
    copy into one buffer); the load reads the very bytes that were hashed."""

    def __init__(self, size: int) -> None:
        super().__init__(size)
        self._chunks: list[tuple[int, memoryview]] = []  # (start, bytes), disjoint

    def put(self, start: int, data: bytes) -> None:
        self._chunks.append((start, memoryview(data)))

    def keep_verified(self) -> None:
        """Drop what lies outside the verified ranges (fetched again to fill the gaps: a chunk
        may straddle a piece that failed its checksum)."""
        kept = []
        for start, chunk in self._chunks:
            for first, length in self.verified:
                low, high = max(start, first), min(start + len(chunk), first + length)
                if low < high:
                    kept.append((low, chunk[low - start : high - start]))
        self._chunks = kept

    def open(self) -> IO[bytes]:
        return io.BufferedReader(_ChunksReader(sorted(self._chunks, key=lambda c: c[0])))

    def drop(self) -> None:
        self._chunks = []


class _ChunksReader(io.RawIOBase):
    """A read-only, seekable file over disjoint chunks of bytes in memory that follow each
    other from 0, read in place (io.BytesIO would need them joined: a copy)."""

    def __init__(self, chunks: list[tuple[int, memoryview]]) -> None:
        super().__init__()
        self._starts = [start for start, _ in chunks]
        self._chunks = [chunk for _, chunk in chunks]
        self._size = chunks[-1][0] + len(chunks[-1][1]) if chunks else 0
        self._at = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._at

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._at, io.SEEK_END: self._size}[whence]
        self._at = max(0, base + offset)
        return self._at

    def readinto(self, buffer: Any) -> int:
        out = memoryview(buffer).cast("B")
        done = 0
        while done < len(out) and self._at < self._size:
            index = bisect.bisect_right(self._starts, self._at) - 1
            chunk = self._chunks[index]
            part = chunk[self._at - self._starts[index] :][: len(out) - done]
            out[done : done + len(part)] = part
            done += len(part)
            self._at += len(part)
        return done


class _DiskCopy(_Copy):
    """A sparse copy in a local file (a file larger than what memory keeps)."""

    def __init__(self, size: int, local: Path) -> None:
        super().__init__(size)
        self.local = local
        with open(local, "wb") as fh:
            fh.truncate(size)  # sparse: only what is written takes room

    def put(self, start: int, data: bytes) -> None:
        with open(self.local, "r+b") as fh:
            fh.seek(start)
            fh.write(data)

    def keep_verified(self) -> None:
        """Nothing: the gaps' bytes are written over in place."""

    def open(self) -> IO[bytes]:
        return open(self.local, "rb")

    def loadable(self) -> Path | IO[bytes]:
        return self.local

    def drop(self) -> None:
        self.local.unlink(missing_ok=True)


class KeptCopies:
    """The copies of one scope (:func:`keep_copies`): in memory up to :data:`MEMORY_BYTES`
    together, the others in a private folder made in ``parent`` when the first is needed."""

    def __init__(self, parent: Path) -> None:
        self.parent = parent
        self.folder: Path | None = None  # made for the first copy on disk
        self._copies: dict[str, _Copy] = {}
        self.refused = False  # the local disk refused a write: no more copies
        self._made = 0
        self.in_memory = 0  # bytes of the copies held in memory now
        self._whole: dict[str, bytes] = {}  # small objects read whole (markers), by URL

    def read_once(self, path: ObjectPath) -> bytes:
        """A small object (a completion marker, a few kB), read from the store once in this
        scope: every reader of it in the resume sees the same bytes."""
        if path.url not in self._whole:
            self._whole[path.url] = read_whole(path)
        return self._whole[path.url]

    def _copy(self, path: ObjectPath, size: int) -> _Copy:
        copy = self._copies.get(path.url)
        if copy is None or copy.size != size:
            self.release(path.url)
            if self.in_memory + size <= MEMORY_BYTES:
                copy = _MemoryCopy(size)
                self.in_memory += size
            else:
                if self.folder is None:
                    self.parent.mkdir(parents=True, exist_ok=True)
                    prefix = f".resume-copies-{os.getpid()}-"
                    self.folder = Path(tempfile.mkdtemp(prefix=prefix, dir=self.parent))
                self._made += 1
                copy = _DiskCopy(size, self.folder / f"{self._made:05d}-{path.name}")
            self._copies[path.url] = copy
        return copy

    def write(self, path: ObjectPath, size: int, start: int, data: bytes) -> None:
        """Keep ``data``, read from the store at ``start`` of the file (``size`` bytes)."""
        if not self.refused:
            try:
                self._copy(path, size).put(start, data)
            except OSError:
                self._refuse()

    def mark_verified(self, path: ObjectPath, start: int, length: int) -> None:
        """The range's piece matched the marker: its bytes in the copy are the verified ones."""
        copy = self._copies.get(path.url)
        if copy is not None and not self.refused:
            copy.verified.append((start, length))

    def forget(self, prefix: Location) -> None:
        """Drop the copies of the files under ``prefix`` (a checkpoint the resume skipped)."""
        head = f"{prefix}/"
        for url in [url for url in self._copies if url.startswith(head)]:
            self.release(url)

    def release(self, url: str) -> None:
        copy = self._copies.pop(url, None)
        if copy is not None:
            if isinstance(copy, _MemoryCopy):
                self.in_memory -= copy.size
            copy.drop()

    def completed(self, path: ObjectPath) -> _Copy | None:
        """The copy of the file, its unverified ranges downloaded now (once); None where this
        process kept none of it."""
        copy = self._copies.get(path.url)
        if copy is None or self.refused:
            return None
        gaps = copy.gaps()
        if gaps:
            copy.keep_verified()
        for start, length in gaps:
            at = start
            for data in read_range(path, start, length):
                try:
                    copy.put(at, data)
                except OSError:
                    self._refuse()
                    return None
                at += len(data)
        copy.verified = [(0, copy.size)]
        return copy

    def remove(self) -> None:
        """Drop every copy (the scope's end)."""
        for url in list(self._copies):
            self.release(url)
        if self.folder is not None:
            shutil.rmtree(self.folder, ignore_errors=True)

    def _refuse(self) -> None:
        self.refused = True
        for url in list(self._copies):
            self.release(url)


_active: KeptCopies | None = None


def active() -> KeptCopies | None:
    """The copies of the resume in progress in this process, if any."""
    return _active


def start(folder: Path, root: Location) -> Scope | None:
    """From now on this process keeps what it verifies of a store's checkpoint and loads from
    it (see the module's text), until the scope is closed -- by whoever loads the checkpoint,
    however that ends (and at the latest when the scope is dropped, or the process exits).
    ``folder``: where this machine's run files are (``run.local_dir``); the copies go into a
    private folder in it. None where the checkpoints (``root``) are local: the page cache
    does it."""
    global _active
    if isinstance(root, Path):
        return None
    folder.mkdir(parents=True, exist_ok=True)
    scope = Scope(KeptCopies(folder), _active)
    _active = scope.kept
    return scope


class Scope:
    """An open :func:`start`: :meth:`close` ends it, the copies removed."""

    def __init__(self, kept: KeptCopies, outer: KeptCopies | None) -> None:
        self.kept, self._outer = kept, outer
        self._removal = weakref.finalize(self, kept.remove)

    def close(self) -> None:
        global _active
        if _active is self.kept:
            _active = self._outer
        self._removal()  # once: later calls do nothing


@contextmanager
def keep_copies(folder: Path, root: Location) -> Iterator[KeptCopies | None]:
    """:func:`start` for the block it opens."""
    scope = start(folder, root)
    try:
        yield scope.kept if scope is not None else None
    finally:
        if scope is not None:
            scope.close()
