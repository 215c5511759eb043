"""DCP's reader of a checkpoint's sharded state (``dcp/``), as data only: its metadata through
:func:`dtrain.checkpoint.safe_load.read_metadata`, its non-tensor items through
``torch.load(weights_only=True)`` (torch's own planner loads them with ``weights_only=False``).
Every read of ``dcp/`` goes through :func:`load_sharded` or :class:`SafeReader`."""

from __future__ import annotations

import io
import os
import pickle
from collections.abc import Collection, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import ReadItem

from dtrain.checkpoint.layout import SHARDED_DIR
from dtrain.checkpoint.safe_load import (
    ONLY_DATA,
    first_line,
    open_verified,
    printable,
    read_metadata,
    why_refused,
)
from dtrain.errors import CheckpointError
from dtrain.storage.objects import Location, ObjectPath


class SafeReader(FileSystemReader):
    """DCP's file reader for ``step_dir/dcp``, its metadata read by :func:`read_metadata`
    (once: the reader keeps it). In an object store it reads through fsspec, as torch's
    ``FsspecReader`` does, with the store's own file system."""

    def __init__(self, step_dir: Location, listed: Collection[str]) -> None:
        folder = step_dir / SHARDED_DIR
        super().__init__(str(folder) if isinstance(folder, Path) else "")
        if isinstance(folder, ObjectPath):
            store_fs = _copies_first(folder.fs)
            self.fs = store_fs
            self.path = str(folder)
        self.step_dir = step_dir
        self.listed = frozenset(listed)
        self._metadata: Metadata | None = None

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if kwargs.get("rank") is not None:
            # DCP's fallback to a rank's own __R.metadata, which dtrain never writes: reached
            # only where .metadata failed, which load_sharded reports first.
            raise CheckpointError(f"{self.step_dir / SHARDED_DIR} has only one metadata file")
        if self._metadata is None:
            metadata = read_metadata(self.step_dir, self.listed)
            # As torch's reader does: this load's id, for DCP's logging.
            storage_meta = metadata.storage_meta or StorageMeta()
            storage_meta.load_id = self.load_id
            metadata.storage_meta = storage_meta
            self._metadata = metadata
        return self._metadata


def _copies_first(fs: Any) -> Any:
    """torch's fsspec file system for DCP on the store's ``fs``, whose files open as a resume's
    copies where it keeps them (:mod:`dtrain.checkpoint.copies`)."""
    from torch.distributed.checkpoint._fsspec_filesystem import FileSystem

    class CopiesFirst(FileSystem):
        @contextmanager
        def create_stream(self, path: str | os.PathLike[str], mode: str) -> Iterator[Any]:
            if "r" not in mode or "+" in mode:
                with super().create_stream(path, mode) as stream:
                    yield stream
                return
            with open_verified(ObjectPath(os.fspath(path), self.fs)) as stream:
                yield stream

    store_fs = CopiesFirst()
    store_fs.fs = fs
    return store_fs


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, but a non-tensor item loads as plain data only (torch's
    loads it with ``weights_only=False``)."""

    def __init__(self, reader: SafeReader) -> None:
        super().__init__()
        self.reader = reader

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        shown_fqn = printable(str(fqn))
        try:
            loaded = torch.load(value, weights_only=True)
        except Exception as exc:
            file = self.reader.storage_data[read_item.storage_index].relative_path
            shown = f"{SHARDED_DIR}/{file} in {self.reader.step_dir}"
            if isinstance(exc, pickle.UnpicklingError):
                why = why_refused(exc).removeprefix("it ")
                raise CheckpointError(
                    f"{shown} is not a checkpoint's data: its item {shown_fqn} {why}; {ONLY_DATA}"
                ) from None
            raise CheckpointError(
                f"{shown} is corrupted: its item {shown_fqn} cannot be loaded: {first_line(exc)}"
            ) from None
        # What DefaultLoadPlanner.load_bytes does with it.
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[fqn], loaded)
        else:
            self.state_dict[fqn] = loaded


def load_sharded(template: dict[str, Any], reader: SafeReader, *, no_dist: bool = False) -> None:
    """Fill ``template`` in place from ``reader``'s shards through DCP (collective unless
    ``no_dist``), refusing what is not tensors and plain data in one line."""
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict_loader import load

    # Read first, outside DCP: inside, a failure is logged as a warning with its traceback
    # and then wrapped in an error of DCP's own.
    reader.read_metadata()
    try:
        load(template, storage_reader=reader, planner=SafeLoadPlanner(reader), no_dist=no_dist)
    except CheckpointException as exc:
        # DCP gathers every rank's failure into one exception; ours is one line, on every rank.
        for failure, _ in exc.failures.values():
            if isinstance(failure, CheckpointError):
                raise CheckpointError(str(failure)) from None
        raise
