"""A run folder in an object store gets the run's records as copies: an object cannot be
appended to, so ``metrics.jsonl`` and ``status.json`` grow in rank 0's local folder
(:func:`dtrain.fsutil.local_run_dir`) and are uploaded whole (:func:`publish_records`);
``dtrain report`` and ``dtrain status`` read those copies (:func:`fetch_records`). What stays
per machine: docs/fault-tolerance.md. For a local run folder both are the same folder and
nothing is copied."""

from __future__ import annotations

import contextlib
from pathlib import Path

from dtrain.checkpoint.store import write_whole
from dtrain.fault.status import STATUS_FILE
from dtrain.fsutil import local_run_dir, scheme_of, write_atomic
from dtrain.storage.objects import ObjectPath, location

# What a store's run folder holds beside its checkpoints and config.toml: the names the
# metrics sink, the status writer and the Hugging Face config writer use in the local folder.
RECORDS = ("metrics.jsonl", STATUS_FILE)
RECORD_FOLDERS = ("hf_config",)
# In a local copy of a store's records (:func:`fetch_records`): the store's run folder, for
# what is listed there rather than copied (train.profile's traces).
ORIGIN = ".dtrain-origin"


def publish_records(run_dir: str, local_dir: str = "") -> None:
    """Upload the run's records from this machine's local folder to the store's run folder
    (nothing for a local run folder). Each object is replaced whole."""
    if not scheme_of(run_dir):
        return
    store, local = location(run_dir), local_run_dir(run_dir, local_dir)
    for name in RECORDS:
        if (local / name).is_file():
            write_whole(store / name, (local / name).read_bytes())
    for folder in RECORD_FOLDERS:
        if (local / folder).is_dir():
            for path in sorted((local / folder).iterdir()):
                if path.is_file():
                    write_whole(store / folder / path.name, path.read_bytes())


def fetch_records(store: ObjectPath, into: Path) -> Path:
    """Copy what :func:`publish_records` uploaded, ``config.toml`` and the trackers' run ids
    (``trackers.json``, which rank 0 writes into the store itself) into ``into`` (a
    folder named as the store's run folder); that folder."""
    folder = into / (store.name or store.bucket)
    folder.mkdir(parents=True, exist_ok=True)
    for name in (*RECORDS, "config.toml", "trackers.json"):
        with contextlib.suppress(FileNotFoundError):
            write_atomic(folder / name, (store / name).read_bytes())
    write_atomic(folder / ORIGIN, store.url)
    return folder


def origin_of(folder: Path) -> str:
    """The store's run folder that ``folder`` is a copy of (:func:`fetch_records`); empty for
    a run folder itself."""
    try:
        return (folder / ORIGIN).read_text().strip()
    except OSError:
        return ""


def publish_files(run_dir: str, sub: str, files: list[Path]) -> None:
    """Upload ``files`` (this machine's) into ``sub/`` of the store's run folder ``run_dir``,
    each object whole."""
    for path in files:
        write_whole(location(run_dir) / sub / path.name, path.read_bytes())
