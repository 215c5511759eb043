"""Writing a checkpoint file as a stream: ``torch.save`` (and ``torch.distributed.checkpoint``)
serialize straight into the file, and every piece of it is hashed as it passes.

So a save holds no copy of the state beside its snapshot (``torch.save`` hands its writer a
view of each tensor's memory, which goes to the file as it is), and the marker gets each
piece's SHA-256 (:data:`~dtrain.checkpoint.layout.PIECE_BYTES`) without reading the file back.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import TracebackType
from typing import Any

import torch

from dtrain.checkpoint import layout
from dtrain.checkpoint.store import open_write
from dtrain.checkpoint.upload import PartUpload, Uploads
from dtrain.errors import CheckpointError
from dtrain.storage.objects import Location, ObjectPath, location


def nothing() -> None:
    """What a progress mark calls where no one watches."""


class PieceHasher:
    """The SHA-256 of each ``piece_bytes`` piece of a stream of bytes fed in parts of any size
    (the last piece may be shorter; an empty stream is one empty piece)."""

    def __init__(self, piece_bytes: int | None = None) -> None:
        self.piece_bytes = piece_bytes or layout.PIECE_BYTES  # read now: tests make it small
        self.size = 0
        self._done: list[str] = []
        self._piece = hashlib.sha256()
        self._filled = 0  # bytes in the current piece

    def update(self, data: Any) -> None:
        view = _byte_view(data)
        while len(view):
            part = view[: self.piece_bytes - self._filled]
            self._piece.update(part)
            self._filled += len(part)
            self.size += len(part)
            view = view[len(part) :]
            if self._filled == self.piece_bytes:
                self._done.append(self._piece.hexdigest())
                self._piece, self._filled = hashlib.sha256(), 0

    def digests(self) -> list[str]:
        if self._filled or not self._done:
            return [*self._done, self._piece.hexdigest()]
        return list(self._done)


def _byte_view(data: Any) -> memoryview:
    view = memoryview(data)
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


def file_entry(hasher: PieceHasher) -> dict[str, Any]:
    """A file's entry in the completion marker."""
    return {"bytes": hasher.size, "piece_bytes": hasher.piece_bytes, "pieces": hasher.digests()}


class HashingWriter:
    """A file opened for writing whose bytes are hashed, piece by piece, as they are written.
    What ``torch.save`` and DCP's writer call on a stream: ``write``, ``flush``, ``tell``,
    ``fileno``, ``close``. ``on_progress`` is called after each piece written (a file may be
    GBs); :meth:`finish` syncs the file to its storage and gives its marker entry. In an object
    store the file is a multipart upload whose parts go out while the next are written
    (:mod:`dtrain.checkpoint.upload`), complete (and visible) once closed."""

    def __init__(
        self,
        path: Location | str,
        on_progress: Callable[[], None] | None = None,
        uploads: Uploads | None = None,
    ) -> None:
        self.path = location(path)
        # Buffered: torch writes each record's small header apart from its data; the data,
        # larger than the buffer, goes to the file directly.
        self._fh: Any
        self.hasher = PieceHasher()
        # A store's upload hashes what it sends, from its own copy of the bytes (its requests
        # need not wait for the digest: :mod:`dtrain.checkpoint.upload`); a file's, here.
        self._hashed_here = True
        if isinstance(self.path, ObjectPath) and self.path.scheme == "s3":  # parts in flight
            upload = PartUpload(self.path, uploads=uploads, digest=self.hasher.update)
            self._fh, self._sync, self._hashed_here = upload, lambda fh: None, False
        else:
            self._fh, self._sync = open_write(self.path)
        self._on_progress = on_progress or nothing
        self._size = 0  # bytes written
        self._marked = 0  # pieces written when progress was last marked

    def write(self, data: Any) -> int:
        view = _byte_view(data)
        step = self.hasher.piece_bytes
        for start in range(0, len(view), step):
            part = view[start : start + step]
            self._fh.write(part)
            if self._hashed_here:
                self.hasher.update(part)
            self._size += len(part)
            if self._size // step > self._marked:  # another piece done, however fed
                self._marked = self._size // step
                self._on_progress()
        return len(view)

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return False

    def tell(self) -> int:
        return self._size

    def flush(self) -> None:
        if not self._fh.closed:
            self._fh.flush()

    def fileno(self) -> int:
        return self._fh.fileno()

    @property
    def closed(self) -> bool:
        return self._fh.closed

    def close(self) -> None:
        self._fh.close()

    def finish(self) -> dict[str, Any]:
        """Sync (unless the writer synced before closing, as DCP does) and close; the file's
        marker entry."""
        if not self._fh.closed:
            self._fh.flush()
            self._sync(self._fh)
            self._fh.close()
        if self.hasher.size != self._size:  # every byte written is hashed, once
            raise CheckpointError(
                f"{self.path}: {self.hasher.size} bytes hashed of {self._size} written"
            )
        self._on_progress()
        return file_entry(self.hasher)

    def __enter__(self) -> HashingWriter:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        if error is not None and isinstance(self._fh, PartUpload):
            self._fh.abort()  # a failed write leaves no object behind (a file: its partial bytes)
        else:
            self._fh.close()


def write_file(
    path: Location,
    obj: Any,
    on_progress: Callable[[], None] | None = None,
    uploads: Uploads | None = None,
) -> dict[str, Any]:
    """Write ``obj`` (bytes as they are, anything else through ``torch.save``) to ``path``,
    synced to its storage; its marker entry. ``uploads``: where a store's file may finish its
    upload after this returns (the save waits for them all before it counts its files)."""
    with HashingWriter(path, on_progress, uploads) as out:
        if isinstance(obj, (bytes, bytearray, memoryview)):
            out.write(obj)
        else:
            torch.save(obj, out)  # type: ignore[arg-type]
        return out.finish()


def hashing_file_system(
    records: dict[str, dict[str, Any]],
    on_progress: Callable[[], None],
    folder: Location,
    uploads: Uploads | None = None,
) -> Any:
    """A DCP file system (for ``FileSystemWriter.fs``) for ``folder`` (local, or a store's,
    through fsspec) whose written files are hashed as they are written: ``records`` gets each
    file's marker entry under its final path. ``uploads``: where a store's file may finish its
    upload while DCP writes the next (as :func:`write_file`'s)."""
    base: Any
    if isinstance(folder, ObjectPath):
        from torch.distributed.checkpoint._fsspec_filesystem import FileSystem as base
    else:
        from torch.distributed.checkpoint.filesystem import FileSystem as base

    class HashingFileSystem(base):  # type: ignore[misc]
        @contextmanager
        def create_stream(self, path: str | os.PathLike[str], mode: str) -> Iterator[Any]:
            if "w" not in mode:
                with super().create_stream(path, mode) as stream:
                    yield stream
                return
            where: Location = Path(path)
            if isinstance(folder, ObjectPath):
                # DCP writes its metadata beside its name and renames it into place; a store's
                # object written in one request is whole or absent already, so it goes to its
                # name at once (a rename there is a copy and a delete: two requests more).
                where = folder / _final_name(Path(path).name)
            with HashingWriter(where, on_progress, uploads) as out:
                yield out
                records[str(path)] = out.finish()

        def mkdir(self, path: str | os.PathLike[str]) -> None:
            if not isinstance(folder, ObjectPath):  # a store's prefix needs no making
                super().mkdir(path)

        def exists(self, path: str | os.PathLike[str]) -> bool:
            if isinstance(folder, ObjectPath):
                # DCP asks only whether a .metadata is there already: to warn that it will be
                # replaced, and to delete it before its rename. A store's put replaces it whole,
                # and the marker, not DCP's metadata, says whether the folder counts: no
                # request (each rank would send one, and rank 0 another at the end).
                return False
            return bool(super().exists(path))

        def rename(self, path: str | os.PathLike[str], new_path: str | os.PathLike[str]) -> None:
            if isinstance(folder, ObjectPath):
                # Written to its final name already (create_stream): nothing to move.
                if _final_name(Path(path).name) != Path(new_path).name:
                    raise CheckpointError(f"DCP renamed {path} to {new_path} in {folder}")
            else:
                super().rename(path, new_path)
            if str(path) in records:
                records[str(new_path)] = records.pop(str(path))

    hashing = HashingFileSystem()
    if isinstance(folder, ObjectPath):
        hashing.fs = folder.fs  # the store's own, which caches no listing
    return hashing


def _final_name(name: str) -> str:
    """The name DCP renames a file it wrote as ``name`` to (its ``.metadata.tmp``)."""
    return name.removesuffix(".tmp")


def progress_planner(on_progress: Callable[[], None]) -> Any:
    """DCP's default save planner, marking progress as the writer takes each item (it asks
    for an item as it comes to write it)."""
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    class ProgressPlanner(DefaultSavePlanner):
        def resolve_data(self, write_item: Any) -> Any:
            on_progress()
            return super().resolve_data(write_item)

    return ProgressPlanner()
