"""Durable file writes: what crash-consistency rests on (checkpoints, datasets, run records).
A file is whole or absent: written beside its final name, fsynced, renamed into place, and the
folder fsynced so that the rename itself survives a power cut. And the checksum that checkpoint
markers and dataset manifests record of each file."""

from __future__ import annotations

import hashlib
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


def sha256_file(path: Path | str, chunk: int = 8 * 2**20) -> str:
    """The SHA-256 of a file's bytes, read in chunks (a shard or a checkpoint may be GBs)."""
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(chunk):
            h.update(block)
    return h.hexdigest()


def write_atomic(path: Path | str, data: bytes | str) -> None:
    """Replace ``path`` with ``data`` atomically and durably."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    write_bytes_synced(tmp, data.encode() if isinstance(data, str) else data)
    os.replace(tmp, path)
    fsync_dir(path.parent)
