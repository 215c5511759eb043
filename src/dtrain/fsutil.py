"""Durable file writes: what crash-consistency rests on (checkpoints, datasets, run records).
A file is whole or absent: written beside its final name, fsynced, renamed into place, and the
folder fsynced so that the rename itself survives a power cut."""

from __future__ import annotations

import os
from pathlib import Path


def fsync_dir(path: Path | str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_bytes_synced(path: Path | str, data: bytes) -> None:
    """Write ``data`` to ``path`` and fsync the file (not atomic by itself)."""
    with open(path, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())


def write_atomic(path: Path | str, data: bytes | str) -> None:
    """Replace ``path`` with ``data`` atomically and durably."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    write_bytes_synced(tmp, data.encode() if isinstance(data, str) else data)
    os.replace(tmp, path)
    fsync_dir(path.parent)
