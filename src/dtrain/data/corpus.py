"""The default corpus: the Python standard library's own ``.py`` sources.

Every Python installation has them (about 30 MB of real text), so the default job needs no
download. Files are split into train and validation by a hash of their relative path, which
keeps the split the same on every machine with the same Python version. The prepared shards are
cached; concurrent workers take a file lock, so one prepares and the rest reuse it.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import sys
import sysconfig
import zlib
from pathlib import Path

from dtrain.data.prepare import list_text_files, text_samples
from dtrain.data.shards import MANIFEST, FieldSpec, write_shards

EXCLUDED_DIRS = ("site-packages", "dist-packages", "__pycache__")
VAL_EVERY = 100  # about 1% of the files go to validation


def stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_files() -> list[Path]:
    return list_text_files(stdlib_dir(), (".py",), EXCLUDED_DIRS)


def is_validation(rel_path: str) -> bool:
    return zlib.crc32(rel_path.encode()) % VAL_EVERY == 0


def cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "dtrain"


def corpus_dir(root: Path | None, files: list[Path]) -> Path:
    """A folder name that changes when the corpus would (another Python, other files)."""
    digest = hashlib.sha256()
    for path in files:
        digest.update(f"{path}:{path.stat().st_size}".encode())
    version = f"py{sys.version_info.major}{sys.version_info.minor}"
    return (root or cache_root()) / f"stdlib-{version}-{digest.hexdigest()[:12]}"


def prepare_stdlib_corpus(root: Path | None = None) -> Path:
    """Prepared ``train`` and ``val`` datasets of the stdlib corpus; prepared on first use."""
    files = stdlib_files()
    out = corpus_dir(root, files)
    if (out / "train" / MANIFEST).exists() and (out / "val" / MANIFEST).exists():
        return out
    out.mkdir(parents=True, exist_ok=True)
    with (out / ".lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # the first worker prepares; the others wait here
        for leftover in out.glob(".*.tmp-*"):  # an interrupted earlier prepare
            shutil.rmtree(leftover, ignore_errors=True)
        base = stdlib_dir()
        splits = {
            "train": [f for f in files if not is_validation(str(f.relative_to(base)))],
            "val": [f for f in files if is_validation(str(f.relative_to(base)))],
        }
        for name, split_files in splits.items():
            if not (out / name / MANIFEST).exists():
                write_shards(
                    text_samples(split_files),
                    out / name,
                    overwrite=True,
                    fields={"tokens": FieldSpec("uint8", None)},
                    shard_bytes=8 * 2**20,
                    metadata={"source": str(base), "split": name},
                )
    return out
