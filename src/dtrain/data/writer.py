"""Writing a dataset: :class:`ShardWriter` and :func:`write_shards`.

Shards go into a hidden temporary folder next to the target, which is renamed into place only
once the manifest is written, so an interrupted write never leaves a folder that looks whole. A
write that fails (a full disk: one line, a :class:`DataError`) removes that folder.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from dtrain.data.format import (
    DEFAULT_SHARD_BYTES,
    FORMAT,
    MANIFEST,
    VERSION,
    FieldSpec,
    Sample,
    manifest_fingerprint,
    read_manifest,
)
from dtrain.errors import DataError
from dtrain.fsutil import (
    format_size,
    fsync_dir,
    is_disk_full,
    sha256_file,
    write_bytes_synced,
)


class ShardWriter:
    """Streams samples into shards of about ``shard_bytes`` each. Use as a context manager, or
    call :meth:`close` (commit) / :meth:`abort` yourself.

    ``fields`` declares some or all fields; the others are inferred from the first sample (see
    :func:`write_shards`)."""

    def __init__(
        self,
        out_dir: str | Path,
        fields: Mapping[str, FieldSpec] | None = None,
        *,
        shard_bytes: int = DEFAULT_SHARD_BYTES,
        overwrite: bool = False,
        metadata: Mapping[str, Any] | None = None,
    ) -> None:
        self.out_dir = Path(out_dir)
        if self.out_dir.exists() and not overwrite:
            raise DataError(
                f"output folder {self.out_dir} already exists; pass --overwrite "
                "(overwrite=True) to replace it"
            )
        check_replaceable(self.out_dir)
        if shard_bytes <= 0:
            raise ValueError(f"shard_bytes must be positive, got {shard_bytes}")
        self.declared: dict[str, FieldSpec] = dict(fields or {})
        self.fields: dict[str, FieldSpec] | None = None
        self.shard_bytes = shard_bytes
        self.metadata = dict(metadata or {})
        self.tmp_dir = self.out_dir.parent / f".{self.out_dir.name}.tmp-{uuid.uuid4().hex[:8]}"
        self.tmp_dir.mkdir(parents=True)
        self.shards: list[dict[str, Any]] = []
        # Per field: blocks of rows (fixed-size fields) or one array per sample (variable).
        self._buffer: dict[str, list[np.ndarray]] = {}
        self._buffer_bytes = 0
        self._buffer_count = 0
        self.num_samples = 0
        self.closed = False

    def __enter__(self) -> ShardWriter:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()

    def _set_fields(self, sample: Sample) -> dict[str, FieldSpec]:
        if self.fields is None:
            # Declared fields first, in their order; then the ones the sample adds. A declared
            # field the sample lacks is reported by the field check that follows.
            self.fields = dict(self.declared)
            for name, value in sample.items():
                if name not in self.fields:
                    self.fields[name] = _infer_field(name, value)
            self._buffer = {name: [] for name in self.fields}
        return self.fields

    def write(self, sample: Sample) -> None:
        fields = self._set_fields(sample)
        if set(sample) != set(fields):
            raise DataError(
                f"sample {self.num_samples} has fields {sorted(sample)}, expected {sorted(fields)}"
            )
        converted = {}
        for name, spec in fields.items():
            where = f"sample {self.num_samples}, field {name!r}"
            arr = to_field_array(sample[name], spec.dtype, where)
            if spec.variable:
                if arr.ndim != 1:
                    raise DataError(
                        f"{where}: a variable-length field must be 1-D, got {arr.shape}"
                    )
            elif arr.shape != spec.shape:
                raise DataError(f"{where}: shape {arr.shape}, expected {spec.shape}")
            converted[name] = arr if spec.variable else arr[None]
        self._append(converted, 1)

    def write_rows(self, columns: Mapping[str, Any]) -> None:
        """Many samples at once: one array per field, one row per sample (fixed-size fields
        only). The fast path for array sources: no Python work per sample."""
        arrays = {name: np.asarray(col) for name, col in columns.items()}
        rows = {name: (a.shape[0] if a.ndim else -1) for name, a in arrays.items()}
        if len(set(rows.values())) != 1 or -1 in rows.values():
            raise DataError(f"write_rows needs arrays with the same number of rows, got {rows}")
        n = next(iter(rows.values()))
        if n == 0:
            return
        fields = self._set_fields({name: a[0] for name, a in arrays.items()})
        if set(arrays) != set(fields):
            raise DataError(f"rows have fields {sorted(arrays)}, expected {sorted(fields)}")
        for name, spec in fields.items():
            where = f"samples {self.num_samples}..{self.num_samples + n - 1}, field {name!r}"
            if spec.variable:
                raise DataError(f"{where}: write_rows takes fixed-size fields only; use write()")
            if arrays[name].shape[1:] != spec.shape:
                raise DataError(f"{where}: shape {arrays[name].shape[1:]}, expected {spec.shape}")
        row_bytes = max(1, sum(np.dtype(s.dtype).itemsize * _numel(s) for s in fields.values()))
        begin = 0
        while begin < n:
            room = max(1, -(-(self.shard_bytes - self._buffer_bytes) // row_bytes))
            end = min(n, begin + room)
            where = f"samples {self.num_samples}..{self.num_samples + end - begin - 1}"
            blocks = {
                name: to_field_array(
                    arrays[name][begin:end], spec.dtype, f"{where}, field {name!r}"
                )
                for name, spec in fields.items()
            }
            self._append(blocks, end - begin)
            begin = end

    def _append(self, arrays: dict[str, np.ndarray], count: int) -> None:
        """Buffer ``count`` samples (``arrays``: each field's, checked), flushing a full shard."""
        for name, arr in arrays.items():
            self._buffer[name].append(arr)
            self._buffer_bytes += arr.nbytes
        self._buffer_count += count
        self.num_samples += count
        if self._buffer_bytes >= self.shard_bytes:
            self._flush()

    def _flush(self) -> None:
        if self._buffer_count == 0 or self.fields is None:
            return
        name = f"shard-{len(self.shards):05d}"
        arrays: dict[str, np.ndarray] = {}
        for field_name, spec in self.fields.items():
            parts = self._buffer[field_name]  # not empty: the shard holds a sample
            arrays[f"{name}.{field_name}.npy"] = np.concatenate(parts)
            if spec.variable:
                lengths = np.fromiter((len(p) for p in parts), dtype=np.int64, count=len(parts))
                offsets = np.zeros(len(parts) + 1, dtype=np.int64)
                np.cumsum(lengths, out=offsets[1:])
                arrays[f"{name}.{field_name}.idx.npy"] = offsets
        files = {filename: self._save(filename, array) for filename, array in arrays.items()}
        self.shards.append({"name": name, "num_samples": self._buffer_count, "files": files})
        self._buffer = {n: [] for n in self.fields}
        self._buffer_bytes = 0
        self._buffer_count = 0

    def _save(self, filename: str, array: np.ndarray) -> dict[str, Any]:
        path = self.tmp_dir / filename
        with self._room(array.nbytes), path.open("wb") as fh:
            np.save(fh, np.ascontiguousarray(array), allow_pickle=False)
            fh.flush()
            os.fsync(fh.fileno())
        return {"bytes": path.stat().st_size, "sha256": sha256_file(path)}

    @contextlib.contextmanager
    def _room(self, need: int) -> Iterator[None]:
        """A write of ``need`` bytes into the temporary folder. A full disk (or quota) is the
        user's to fix -- free space, or write elsewhere -- so a :class:`DataError` in one line:
        the folder, what the dataset had taken when the disk filled (a lower bound of what it
        needs: the rest of the source is unread), what is free once the partial copy is
        removed."""
        try:
            yield
        except OSError as exc:
            # NumPy's array writer reports a short write without an errno ("575000 requested
            # and 499584 written"): a disk with less room left than the write needed is full.
            if not (is_disk_full(exc) or self._free() < need):
                raise
            # The shards written, and the one being written (its buffer is kept until then).
            taken = self._buffer_bytes + sum(
                info["bytes"] for shard in self.shards for info in shard["files"].values()
            )
            self.abort()
            raise DataError(
                f"no space left on the disk of {self.out_dir.parent} for the dataset "
                f"{self.out_dir.name}: it needs more than {format_size(taken)} (what it held "
                f"when the disk filled) and {format_size(self._free())} is free with its "
                "partial copy removed; free some space there or choose another output folder"
            ) from None

    def _free(self) -> int:
        """Bytes an unprivileged writer may still use on the target's disk."""
        stats = os.statvfs(self.out_dir.parent)
        return stats.f_bavail * stats.f_frsize

    def close(self) -> Path:
        """Write the manifest and move the dataset into place; if anything fails, the
        temporary folder is removed (nothing is left beside the target)."""
        if self.closed:
            return self.out_dir
        try:
            return self._commit()
        except BaseException:
            self.abort()
            raise

    def _commit(self) -> Path:
        self._flush()
        if self.num_samples == 0 or self.fields is None:
            self.abort()
            raise DataError(f"no samples were written to {self.out_dir}: the source is empty")
        manifest = {
            "format": FORMAT,
            "version": VERSION,
            "num_samples": self.num_samples,
            "fields": {n: s.to_json() for n, s in self.fields.items()},
            "shards": self.shards,
            "fingerprint": manifest_fingerprint(self.shards),
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "metadata": self.metadata,
        }
        text = json.dumps(manifest, indent=1).encode()
        with self._room(len(text)):
            write_bytes_synced(self.tmp_dir / MANIFEST, text)
        if os.path.lexists(self.out_dir):
            # Checked again: the folder may have changed in the minutes the shards took.
            check_replaceable(self.out_dir)
            # Replace an existing dataset (overwrite=True): move it aside first so that the
            # target name only ever holds a complete dataset.
            old = self.out_dir.parent / f".{self.out_dir.name}.old-{uuid.uuid4().hex[:8]}"
            os.replace(self.out_dir, old)
            os.replace(self.tmp_dir, self.out_dir)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(self.tmp_dir, self.out_dir)
        fsync_dir(self.out_dir.parent)
        self.closed = True
        return self.out_dir

    def abort(self) -> None:
        shutil.rmtree(self.tmp_dir, ignore_errors=True)
        self.closed = True


def check_replaceable(out_dir: Path) -> None:
    """Raise :class:`DataError` unless ``out_dir`` is absent or a dtrain dataset that an
    overwrite may replace: a folder holding a valid manifest and only the files it lists (what
    :class:`ShardWriter` writes). Anything else -- a plain file, a link, someone's folder, a
    dataset with files of the user's own added -- is left as it is: an overwrite deletes what
    it replaces, and a mistyped OUT must not cost the user a folder."""
    if not os.path.lexists(out_dir):
        return
    why = _not_a_dataset(out_dir)
    if why:
        raise DataError(
            f"--overwrite (overwrite=True) replaces only a dtrain dataset, and {out_dir} is "
            f"not one ({why}); it was left as it is: choose another output folder, or remove "
            "it yourself"
        )


def _not_a_dataset(path: Path) -> str:
    """Why ``path`` is not a folder :class:`ShardWriter` wrote; empty when it is one."""
    if path.is_symlink():
        return "a symbolic link"
    if not path.is_dir():
        return "a file, not a folder"
    try:
        manifest = read_manifest(path)
    except DataError:
        return f"it holds no readable {MANIFEST} of format {FORMAT!r}"
    listed = {MANIFEST} | {name for shard in manifest["shards"] for name in shard["files"]}
    others = sorted(
        entry.name
        for entry in path.iterdir()
        if entry.name not in listed or entry.is_symlink() or not entry.is_file()
    )
    if others:
        more = f" and {len(others) - 1} more" if len(others) > 1 else ""
        return f"it holds {others[0]!r}{more}, which its {MANIFEST} does not list"
    return ""


def write_shards(
    samples: Iterable[Sample],
    out_dir: str | Path,
    *,
    fields: Mapping[str, FieldSpec] | None = None,
    shard_bytes: int = DEFAULT_SHARD_BYTES,
    overwrite: bool = False,
    metadata: Mapping[str, Any] | None = None,
    progress: Callable[[int], object] | None = None,
) -> Path:
    """Write an iterable of samples (dicts of arrays) as a sharded dataset; returns its path.

    Fields not declared in ``fields`` are inferred from the first sample: a ``bytes``/``str``
    value becomes a variable-length ``uint8`` field (UTF-8 for text), a list or tuple a
    variable-length field of its NumPy dtype, and an array keeps its shape (a fixed-size field).
    Declare a 1-D array whose length varies as ``FieldSpec(dtype, None)``. Values are converted
    to the field's dtype only when nothing is lost (an integer out of the dtype's range is an
    error, not a wrap-around).

    The write is atomic: if ``samples`` raises, or the process dies, no dataset appears at
    ``out_dir`` (an interrupted process may leave a hidden ``.NAME.tmp-*`` folder beside it)."""
    with ShardWriter(
        out_dir, fields, shard_bytes=shard_bytes, overwrite=overwrite, metadata=metadata
    ) as writer:
        for sample in samples:
            writer.write(sample)
            if progress is not None:
                progress(1)
    return writer.out_dir


def _infer_field(name: str, value: Any) -> FieldSpec:
    if isinstance(value, (bytes, bytearray, memoryview, str)):
        return FieldSpec("uint8", None)
    if isinstance(value, (list, tuple)):
        arr = np.asarray(value)
        if arr.dtype == object or arr.ndim != 1:
            raise DataError(f"field {name!r}: a list value must be a flat list of numbers")
        return FieldSpec(str(arr.dtype) if arr.size else "int64", None)
    arr = np.asarray(value)
    if arr.dtype == object or arr.dtype.kind in "USV":
        raise DataError(
            f"field {name!r} holds {arr.dtype} values; give numbers, bytes or text (str)"
        )
    return FieldSpec(str(arr.dtype), tuple(arr.shape))


def _numel(spec: FieldSpec) -> int:
    return int(np.prod(spec.shape)) if spec.shape else 1


def to_field_array(value: Any, dtype: str, where: str) -> np.ndarray:
    """``value`` as an array of ``dtype``, refusing conversions that would change values;
    ``where`` starts the error message (e.g. ``"data.jsonl:12, field 'text'"``)."""
    if isinstance(value, str):
        value = value.encode("utf-8")
    if isinstance(value, (bytes, bytearray, memoryview)):
        arr = np.frombuffer(value, dtype=np.uint8)
    else:
        try:
            arr = np.asarray(value)
        except (ValueError, TypeError) as exc:
            raise DataError(f"{where}: cannot be read as an array ({exc})") from None
    target = np.dtype(dtype)
    if arr.dtype == target:
        return arr
    if arr.size == 0:  # e.g. [] is float64 to NumPy; there is nothing to lose
        return arr.astype(target)
    if arr.dtype.kind in "biu" and target.kind in "iu":
        # Integers narrow only when every value fits: token ids above 255 must not wrap in uint8.
        info = np.iinfo(target)
        if arr.size and (int(arr.min()) < info.min or int(arr.max()) > info.max):
            raise DataError(
                f"{where}: values {int(arr.min())}..{int(arr.max())} do not fit {target} "
                f"({info.min}..{info.max}); declare a wider dtype"
            )
        return arr.astype(target)
    if not np.can_cast(arr.dtype, target, casting="same_kind") and not (
        arr.dtype.kind in "biu" and target.kind in "fc"
    ):
        raise DataError(f"{where}: {arr.dtype} values cannot be stored as {target} without loss")
    return arr.astype(target)
