"""Run folders in an object store, for ``dtrain report`` and ``dtrain status``: they read local
folders, so a store's run folder is read through a temporary copy of the records it holds
(:func:`dtrain.checkpoint.publish.fetch_records`: uploaded at each checkpoint and at the end).
``status`` reads the live folder instead where this machine ran the run's rank 0 (its local
folder holds the records as they grow, and the liveness records, which never leave it)."""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from dtrain.checkpoint.publish import RECORDS, fetch_records
from dtrain.errors import UserError
from dtrain.fsutil import local_run_dir, scheme_of
from dtrain.storage.objects import ObjectPath, location


@contextmanager
def readable_runs(run_dirs: list[str], live: bool = False) -> Iterator[list[Path]]:
    """Local folders to read ``run_dirs`` from, for as long as the context lasts. ``live``:
    a store's run folder whose local folder exists on this machine is read there."""
    with tempfile.TemporaryDirectory(prefix="dtrain-records-") as scratch:
        folders = []
        for index, text in enumerate(run_dirs):
            if not scheme_of(text):
                folders.append(Path(text))
                continue
            local = local_run_dir(text)
            if live and any((local / name).is_file() for name in RECORDS):
                folders.append(local)
                continue
            store = location(text)
            assert isinstance(store, ObjectPath)
            if not store.is_dir():
                raise UserError(f"run folder {text} does not exist (nothing under that prefix)")
            folders.append(fetch_records(store, Path(scratch) / str(index)))
        yield folders
