"""Durable file writes: what crash-consistency rests on (checkpoints, datasets, run records).
A file is whole or absent: written beside its final name, fsynced, renamed into place, and the
folder fsynced so that the rename itself survives a power cut. And the checksum that checkpoint
markers and dataset manifests record of each file. And where a command writes what it makes
(``dtrain export``'s file, ``dtrain report``'s page, ``dtrain prepare``'s dataset, ``dtrain
train``'s run folder): checked before any of the work, so that a path the user cannot write is
one line naming it instead of a traceback at the end. And the words for a disk that is full."""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import re
import tempfile
from pathlib import Path
from typing import BinaryIO

from dtrain.errors import UserError

_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")


def scheme_of(path: str | os.PathLike[str]) -> str:
    """The scheme of a URL (``s3`` for ``s3://bucket/key``); empty for a local path."""
    match = _SCHEME.match(str(path))
    return match.group(1).lower() if match else ""


def local_run_dir(run_dir: str, local_dir: str = "") -> Path:
    """Where a run keeps what is per machine and short-lived (launch files, liveness, logs,
    ``metrics.jsonl`` as it grows): the run folder itself when it is local; for a run folder
    in an object store (``s3://bucket/prefix``), ``local_dir`` or, empty, a folder of the
    user's cache named after the URL (``~/.cache/dtrain/runs/s3/bucket/prefix``)."""
    scheme = scheme_of(run_dir)
    if not scheme:
        return Path(run_dir)
    if local_dir:
        return Path(local_dir)
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    rest = str(run_dir).split("://", 1)[1].strip("/")
    return Path(cache, "dtrain", "runs", scheme, *[part for part in rest.split("/") if part])


def fsync_dir(path: Path | str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_bytes_synced(path: Path | str, data: bytes, mode: int | None = None) -> None:
    """Write ``data`` to ``path`` and fsync the file (not atomic by itself). ``mode``: the
    file is created anew with these permission bits (a file already at ``path`` is removed
    first), so that it is never readable more widely, even for a moment, as a chmod after
    the write would leave it."""
    if mode is None:
        opened = open(path, "wb")  # noqa: SIM115 (closed by the with below)
    else:
        Path(path).unlink(missing_ok=True)
        opened = os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode), "wb")
    with opened as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())


def sha256_file(path: Path | str) -> str:
    """The SHA-256 of a file's bytes, read in 8 MiB chunks (a shard may be GBs)."""
    with open(path, "rb") as fh:
        return sha256_stream(fh)


def sha256_stream(fh: BinaryIO) -> str:
    """The SHA-256 of what is left to read of ``fh`` (a file, or an object in a store)."""
    h = hashlib.sha256()
    while block := fh.read(8 * 2**20):
        h.update(block)
    return h.hexdigest()


def proc_field(path: str, key: str) -> str | None:
    """The value of the first ``key:`` line of a ``/proc`` file (None: no such line, or no
    such file: not Linux)."""
    with contextlib.suppress(OSError), open(path) as fh:
        for line in fh:
            name, colon, value = line.partition(":")
            if colon and name.strip() == key:
                return value.strip()
    return None


def current_umask() -> int:
    """This process's umask, read without changing it: ``os.umask`` only sets it, and setting
    it even for an instant changes the mode of a file another thread creates meanwhile."""
    if (umask := proc_field("/proc/self/status", "Umask")) is not None:
        return int(umask, 8)
    old = os.umask(0o077)  # no /proc (not Linux): the strictest mask for that instant
    os.umask(old)
    return old


def follow_umask(path: Path | str) -> None:
    """Give ``path`` -- a file, or a folder and everything in it -- the modes a plain ``open``
    or ``mkdir`` gives under the user's umask (0666 or 0777 less it). For what a library wrote
    with modes of its own: safetensors' ``save_file`` makes 0600 whatever the umask, so an
    export would be unreadable to the group that can read the run folder it came from."""
    mask = current_umask()
    path = Path(path)
    if path.is_symlink():
        return  # a link's mode is its target's: not ours to change
    if not path.is_dir():
        os.chmod(path, 0o666 & ~mask)
        return
    os.chmod(path, 0o777 & ~mask)
    for folder, dirs, files in os.walk(path):
        for names, mode in ((dirs, 0o777), (files, 0o666)):
            for name in names:
                entry = os.path.join(folder, name)
                if not os.path.islink(entry):
                    os.chmod(entry, mode & ~mask)


def write_atomic(path: Path | str, data: bytes | str, mode: int | None = None) -> None:
    """Replace ``path`` with ``data`` atomically and durably; ``mode``: the file's permission
    bits from its creation on (a secret: 0o600), else what the umask makes."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        write_bytes_synced(tmp, data.encode() if isinstance(data, str) else data, mode=mode)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)  # a full disk leaves no half-written file behind
        raise
    fsync_dir(path.parent)


def require_output_folder(folder: Path, label: str, choose: str = "path") -> None:
    """``folder`` exists (made with its parents if need be) and takes a new file; otherwise a
    :class:`UserError` that starts with ``label`` (what the user gave, e.g. ``"OUT x.pt"``) and
    asks for another ``choose`` (e.g. ``"run.dir"``)."""
    blocker = next((p for p in (folder, *folder.parents) if p.exists() and not p.is_dir()), None)
    if blocker is not None:  # the folder is, or runs through, a file
        raise UserError(f"{label}: {blocker} is a file, not a folder; choose another {choose}")
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".dtrain-write-check-", dir=folder)
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        raise UserError(
            f"{label}: cannot write in {folder} ({exc.strerror or exc}); choose a {choose} where "
            "this user may write"
        ) from None


def is_disk_full(error: BaseException) -> bool:
    """Whether ``error`` is a write that found no room (the disk, or the user's quota)."""
    return isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT)


def format_size(size: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if size >= scale:
            return f"{size / scale:.1f} {unit}"
    return f"{size:.0f} B"
