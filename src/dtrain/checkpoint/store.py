"""Where a run folder's checkpoints live: a local folder (a :class:`pathlib.Path`, as always) or
an object store through fsspec (an :class:`ObjectPath`, ``s3://bucket/prefix``). The one seam
between the checkpoint code and its storage: what reads and writes checkpoints takes a
:data:`Location` and asks :func:`storage_of` for what differs (a commit's rename, fsync, room
on a disk); a local folder goes the way it always went, with nothing added.

An object store has no atomic rename and no append: a save writes its pieces straight into
``step-N/`` (never counted until the marker object exists, written last, after every piece;
``COMMITTED.json`` is the commit), and a single object written with one request is whole or
absent, which is what a local file gets from its rename. Every request runs under
:data:`RETRY_POLICY`; a store that stops answering is an :class:`StoreError` naming the store,
the key and that policy, never a hang. The paths and their requests are
:mod:`dtrain.storage.objects`' (datasets' shards reach the store through them too).
"""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any, TypeVar

from dtrain.fsutil import fsync_dir, write_atomic
from dtrain.storage.objects import Location

T = TypeVar("T")

# ---------------------------------------------------------------------------------------------
# What differs between a folder and a store, for the writer of a checkpoint


def staging_folder(root: Location, name: str) -> Location:
    """Where a save of the folder ``name`` writes its files: beside it, renamed into place at
    the commit (a local folder); the folder itself, counted only once its marker exists (a
    store: a rename there copies every byte)."""
    return root / f".tmp-{name}" if isinstance(root, Path) else root / name


def move_into_place(staged: Location, final: Location) -> None:
    """The rename of a save's folder to its name, made durable (nothing in a store, where the
    files went to ``final`` directly)."""
    if isinstance(staged, Path) and isinstance(final, Path):
        os.replace(staged, final)
        fsync_dir(final.parent)


def remove_tree(folder: Location) -> None:
    """Delete a folder and everything in it, ignoring what is already gone."""
    if isinstance(folder, Path):
        shutil.rmtree(folder, ignore_errors=True)
    else:
        folder.remove_tree()


def set_aside(folder: Location, trash: Location) -> Location:
    """Take an uncommitted folder out of the way of its name before deleting it (a local
    folder is renamed ``trash``); what to delete. A store's has no rename, nor needs one: with
    its marker gone it never counts."""
    if isinstance(folder, Path) and isinstance(trash, Path):
        if trash.exists():
            shutil.rmtree(trash, ignore_errors=True)
        os.replace(folder, trash)
        return trash
    return folder


def sync_folder(folder: Location) -> None:
    """Make the folder's entries durable (what a store's single requests are already)."""
    if isinstance(folder, Path):
        fsync_dir(folder)


def write_whole(path: Location, data: str | bytes) -> None:
    """Write ``path`` whole or not at all (a local file: beside, fsynced, renamed; an object:
    one request)."""
    if isinstance(path, Path):
        write_atomic(path, data)
    else:
        path.write_bytes(data.encode() if isinstance(data, str) else data)


def open_read(path: Location) -> Any:
    """``path`` opened for reading: unbuffered where local (the reader brings its buffer); a
    store's file reads ranges of its own size."""
    if isinstance(path, Path):
        return open(path, "rb", buffering=0)
    return path.open("rb")


def open_write(path: Location) -> tuple[IO[bytes], Callable[[IO[bytes]], None]]:
    """``path`` opened for writing, and what makes its bytes durable before it is closed (an
    fsync; nothing for a store's file, whose upload completes when it is closed)."""
    if isinstance(path, Path):
        return open(path, "wb"), lambda fh: os.fsync(fh.fileno())
    return path.open("wb"), lambda fh: None


@contextmanager
def local_copy(folder: Location) -> Iterator[Path]:
    """The folder itself where local; else a temporary copy of the files directly in it (a
    small folder: a config), removed on exit."""
    if isinstance(folder, Path):
        yield folder
        return
    with tempfile.TemporaryDirectory(prefix="dtrain-") as scratch:
        copy = Path(scratch) / (folder.name or "copy")
        copy.mkdir()
        for entry in folder.iterdir():
            try:
                (copy / entry.name).write_bytes(entry.read_bytes())
            except (FileNotFoundError, IsADirectoryError):
                pass  # a sub-folder (a prefix), or removed meanwhile
        yield copy


def in_background(call: Callable[[Location], T], folder: Location) -> Future[T]:
    """``call(folder)`` started on a thread of its own (a store's request beside another one);
    its outcome, raised where it failed, from the future."""
    future: Future[T] = Future()

    def run() -> None:
        try:
            future.set_result(call(folder))
        except BaseException as exc:
            future.set_exception(exc)

    threading.Thread(target=run, name="dtrain-ckpt-listing", daemon=True).start()
    return future


def free_bytes(folder: Location) -> int | None:
    """Bytes a writer may still use where ``folder`` is (None: a store, which has no disk to
    fill that dtrain can see)."""
    if not isinstance(folder, Path):
        return None
    stats = os.statvfs(folder)
    return int(stats.f_bavail * stats.f_frsize)
