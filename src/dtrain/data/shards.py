"""The on-disk dataset format: memory-mapped NumPy shards plus a JSON manifest.

Layout of a dataset folder::

    manifest.json                 sample count, fields, per-file byte size and SHA-256
    shard-00000.<field>.npy       fixed-size field: array of shape (n, *shape)
    shard-00000.<field>.npy       variable-length field: the values of all samples, end to end
    shard-00000.<field>.idx.npy   ... and its offsets, int64, n + 1 entries

Every file is a standard ``.npy`` that ``np.load(mmap_mode="r")`` opens without reading it, so
access to any sample is O(1) and a rank's resident memory does not grow with the dataset.
Writing is atomic: shards go into a hidden temporary folder next to the target, which is renamed
into place only once the manifest is written, so an interrupted write never leaves a folder that
looks whole. Opening checks each file's size against the manifest (a truncated file is caught at
once, without reading it); ``verify`` also checks every checksum.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
import uuid
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from dtrain.errors import DataError

FORMAT = "dtrain-shards"
VERSION = 1
MANIFEST = "manifest.json"
DEFAULT_SHARD_BYTES = 64 * 2**20

Sample = Mapping[str, Any]


@dataclass(frozen=True)
class FieldSpec:
    dtype: str
    shape: tuple[int, ...] | None  # None: variable-length 1-D

    @property
    def variable(self) -> bool:
        return self.shape is None

    def to_json(self) -> dict[str, Any]:
        return {"dtype": self.dtype, "shape": None if self.shape is None else list(self.shape)}


# ---------------------------------------------------------------------------------------------
# Writing


class ShardWriter:
    """Streams samples into shards of about ``shard_bytes`` each. Use as a context manager, or
    call :meth:`close` (commit) / :meth:`abort` yourself."""

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
        self.fields: dict[str, FieldSpec] | None = dict(fields) if fields else None
        self.shard_bytes = shard_bytes
        self.overwrite = overwrite
        self.metadata = dict(metadata or {})
        self.tmp_dir = self.out_dir.parent / f".{self.out_dir.name}.tmp-{uuid.uuid4().hex[:8]}"
        self.tmp_dir.mkdir(parents=True)
        self.shards: list[dict[str, Any]] = []
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

    def write(self, sample: Sample) -> None:
        if self.fields is None:
            self.fields = {name: _infer_field(name, value) for name, value in sample.items()}
            self._buffer = {name: [] for name in self.fields}
        if set(sample) != set(self.fields):
            raise DataError(
                f"sample {self.num_samples} has fields {sorted(sample)}, expected "
                f"{sorted(self.fields)}"
            )
        if not self._buffer:
            self._buffer = {name: [] for name in self.fields}
        for name, spec in self.fields.items():
            arr = np.asarray(sample[name], dtype=spec.dtype)
            if spec.variable:
                if arr.ndim != 1:
                    raise DataError(f"sample {self.num_samples}: field {name!r} must be 1-D")
            elif arr.shape != spec.shape:
                raise DataError(
                    f"sample {self.num_samples}: field {name!r} has shape "
                    f"{arr.shape}, expected {spec.shape}"
                )
            self._buffer[name].append(arr)
            self._buffer_bytes += arr.nbytes
        self._buffer_count += 1
        self.num_samples += 1
        if self._buffer_bytes >= self.shard_bytes:
            self._flush()

    def _flush(self) -> None:
        if self._buffer_count == 0 or self.fields is None:
            return
        name = f"shard-{len(self.shards):05d}"
        files: dict[str, dict[str, Any]] = {}
        for field_name, spec in self.fields.items():
            parts = self._buffer[field_name]
            if spec.variable:
                lengths = np.fromiter((len(p) for p in parts), dtype=np.int64, count=len(parts))
                offsets = np.zeros(len(parts) + 1, dtype=np.int64)
                np.cumsum(lengths, out=offsets[1:])
                values = np.concatenate(parts) if parts else np.zeros(0, dtype=spec.dtype)
                files[f"{name}.{field_name}.npy"] = self._save(f"{name}.{field_name}.npy", values)
                files[f"{name}.{field_name}.idx.npy"] = self._save(
                    f"{name}.{field_name}.idx.npy", offsets
                )
            else:
                files[f"{name}.{field_name}.npy"] = self._save(
                    f"{name}.{field_name}.npy", np.stack(parts)
                )
        self.shards.append({"name": name, "num_samples": self._buffer_count, "files": files})
        self._buffer = {n: [] for n in self.fields}
        self._buffer_bytes = 0
        self._buffer_count = 0

    def _save(self, filename: str, array: np.ndarray) -> dict[str, Any]:
        path = self.tmp_dir / filename
        with path.open("wb") as fh:
            np.save(fh, np.ascontiguousarray(array), allow_pickle=False)
            fh.flush()
            os.fsync(fh.fileno())
        return {"bytes": path.stat().st_size, "sha256": sha256_file(path)}

    def close(self) -> Path:
        """Write the manifest and move the dataset into place."""
        if self.closed:
            return self.out_dir
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
            "fingerprint": _fingerprint(self.shards),
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "metadata": self.metadata,
        }
        with (self.tmp_dir / MANIFEST).open("w") as fh:
            json.dump(manifest, fh, indent=1)
            fh.flush()
            os.fsync(fh.fileno())
        if self.out_dir.exists():
            # Replace an existing dataset (overwrite=True): move it aside first so that the
            # target name only ever holds a complete dataset.
            old = self.out_dir.parent / f".{self.out_dir.name}.old-{uuid.uuid4().hex[:8]}"
            os.replace(self.out_dir, old)
            os.replace(self.tmp_dir, self.out_dir)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(self.tmp_dir, self.out_dir)
        _fsync_dir(self.out_dir.parent)
        self.closed = True
        return self.out_dir

    def abort(self) -> None:
        shutil.rmtree(self.tmp_dir, ignore_errors=True)
        self.closed = True


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

    Fields are inferred from the first sample unless given: a 1-D array whose length may vary
    becomes a variable-length field only when declared so (``FieldSpec(dtype, None)``) or when
    it is a ``bytes``/``str``/list value; arrays otherwise keep their shape."""
    with ShardWriter(
        out_dir, fields, shard_bytes=shard_bytes, overwrite=overwrite, metadata=metadata
    ) as writer:
        for sample in samples:
            writer.write(sample)
            if progress is not None:
                progress(1)
    return writer.out_dir


def _infer_field(name: str, value: Any) -> FieldSpec:
    if isinstance(value, (bytes, bytearray)):
        return FieldSpec("uint8", None)
    if isinstance(value, (list, tuple)):
        return FieldSpec(str(np.asarray(value).dtype), None)
    arr = np.asarray(value)
    if arr.dtype == object:
        raise DataError(f"field {name!r} holds Python objects; give numeric arrays")
    return FieldSpec(str(arr.dtype), tuple(arr.shape))


def _fingerprint(shards: list[dict[str, Any]]) -> str:
    h = hashlib.sha256()
    for shard in shards:
        for fname in sorted(shard["files"]):
            h.update(fname.encode())
            h.update(shard["files"][fname]["sha256"].encode())
    return h.hexdigest()


def sha256_file(path: str | Path, chunk: int = 8 * 2**20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(chunk):
            h.update(block)
    return h.hexdigest()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# ---------------------------------------------------------------------------------------------
# Reading


def read_manifest(data_dir: str | Path) -> dict[str, Any]:
    data_dir = Path(data_dir)
    path = data_dir / MANIFEST
    if not data_dir.exists():
        raise DataError(
            f"dataset folder {data_dir} does not exist; create it with "
            "`dtrain prepare SOURCE {data_dir}`"
        )
    if not path.exists():
        raise DataError(
            f"{path} is missing: {data_dir} is not a dtrain dataset (or its "
            "`dtrain prepare` did not finish)"
        )
    try:
        manifest = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise DataError(f"{path} is malformed: {exc}") from None
    problems = _manifest_problems(manifest)
    if problems:
        raise DataError(f"{path} is malformed: {problems}")
    return manifest


def _manifest_problems(m: Any) -> str:
    if not isinstance(m, dict):
        return "not a JSON object"
    if m.get("format") != FORMAT:
        return f"format is {m.get('format')!r}, expected {FORMAT!r}"
    if m.get("version") != VERSION:
        return f"version {m.get('version')!r} is not supported (expected {VERSION})"
    for key, kind in (("num_samples", int), ("fields", dict), ("shards", list)):
        if not isinstance(m.get(key), kind):
            return f"key {key!r} is missing or of the wrong type"
    if sum(s.get("num_samples", 0) for s in m["shards"]) != m["num_samples"]:
        return "the shards' sample counts do not add up to num_samples"
    for shard in m["shards"]:
        if not isinstance(shard.get("files"), dict) or not isinstance(shard.get("name"), str):
            return f"shard entry {shard!r} lacks name or files"
    return ""


class ShardedDataset:
    """Random access to a dtrain dataset; samples are dicts of NumPy arrays (views into the
    memory-mapped files, so nothing is read until used)."""

    def __init__(self, data_dir: str | Path) -> None:
        self.path = Path(data_dir)
        self.manifest = read_manifest(self.path)
        self.fields = {
            name: FieldSpec(f["dtype"], None if f["shape"] is None else tuple(f["shape"]))
            for name, f in self.manifest["fields"].items()
        }
        self.shard_sizes = tuple(int(s["num_samples"]) for s in self.manifest["shards"])
        self._starts = np.concatenate([[0], np.cumsum(self.shard_sizes)]).astype(np.int64)
        self._check_sizes()
        self._arrays: dict[tuple[int, str], np.ndarray] = {}
        self._lengths: np.ndarray | None = None

    @property
    def fingerprint(self) -> str:
        return str(self.manifest["fingerprint"])

    def __len__(self) -> int:
        return int(self.manifest["num_samples"])

    def _check_sizes(self) -> None:
        for shard in self.manifest["shards"]:
            for fname, info in shard["files"].items():
                path = self.path / fname
                if not path.exists():
                    raise DataError(
                        f"shard file {path} is missing (listed in the manifest); "
                        "re-run `dtrain prepare`"
                    )
                actual = path.stat().st_size
                if actual != info["bytes"]:
                    raise DataError(
                        f"shard file {path} has {actual} bytes, the manifest says "
                        f"{info['bytes']}: it is truncated or was changed"
                    )

    def _array(self, shard: int, filename: str) -> np.ndarray:
        key = (shard, filename)
        arr = self._arrays.get(key)
        if arr is None:
            path = self.path / filename
            try:
                arr = np.load(path, mmap_mode="r", allow_pickle=False)
            except (ValueError, OSError) as exc:
                raise DataError(f"shard file {path} cannot be read as .npy: {exc}") from None
            self._arrays[key] = arr
        return arr

    def locate(self, index: int) -> tuple[int, int]:
        if not 0 <= index < len(self):
            raise IndexError(f"sample {index} is out of range for {len(self)} samples")
        shard = int(np.searchsorted(self._starts, index, side="right")) - 1
        return shard, index - int(self._starts[shard])

    def field_values(self, shard: int, name: str) -> np.ndarray:
        return self._array(shard, f"{self.manifest['shards'][shard]['name']}.{name}.npy")

    def field_offsets(self, shard: int, name: str) -> np.ndarray:
        return self._array(shard, f"{self.manifest['shards'][shard]['name']}.{name}.idx.npy")

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        shard, local = self.locate(int(index))
        out = {}
        for name, spec in self.fields.items():
            values = self.field_values(shard, name)
            if spec.variable:
                offsets = self.field_offsets(shard, name)
                out[name] = values[offsets[local] : offsets[local + 1]]
            else:
                out[name] = values[local]
        return out

    def __getitems__(self, indices: list[int]) -> list[dict[str, np.ndarray]]:
        return [self[i] for i in indices]

    def gather(self, name: str, indices: np.ndarray) -> np.ndarray:
        """A fixed-size field for many samples at once, shard by shard, as one array."""
        spec = self.fields[name]
        if spec.variable or spec.shape is None:
            raise ValueError(f"field {name!r} is variable-length; use __getitem__")
        indices = np.asarray(indices, dtype=np.int64)
        out = np.empty((len(indices), *spec.shape), dtype=spec.dtype)
        shards = np.searchsorted(self._starts, indices, side="right") - 1
        for shard in np.unique(shards):
            mask = shards == shard
            out[mask] = self.field_values(int(shard), name)[indices[mask] - self._starts[shard]]
        return out

    def sample_lengths(self, name: str | None = None) -> np.ndarray | None:
        """Length of every sample's variable-length field (the token count), or None for a
        dataset of fixed-size samples."""
        if name is None:
            variable = [n for n, s in self.fields.items() if s.variable]
            if not variable:
                return None
            name = variable[0]
        if self._lengths is None:
            parts = [np.diff(self.field_offsets(s, name)) for s in range(len(self.shard_sizes))]
            self._lengths = np.concatenate(parts).astype(np.int64)
        return self._lengths


# ---------------------------------------------------------------------------------------------
# Verifying


@dataclass(frozen=True)
class BadFile:
    path: Path
    problem: str

    def __str__(self) -> str:
        return f"{self.path}: {self.problem}"


def verify_dataset(
    data_dir: str | Path, progress: Callable[[int], None] | None = None
) -> list[BadFile]:
    """Check every file of a dataset against the manifest: presence, size, SHA-256."""
    data_dir = Path(data_dir)
    manifest = read_manifest(data_dir)
    bad: list[BadFile] = []
    for shard in manifest["shards"]:
        for fname, info in shard["files"].items():
            path = data_dir / fname
            if not path.exists():
                bad.append(BadFile(path, "missing"))
                continue
            size = path.stat().st_size
            if size != info["bytes"]:
                bad.append(BadFile(path, f"size {size} bytes, expected {info['bytes']}"))
                continue
            digest = sha256_file(path)
            if digest != info["sha256"]:
                bad.append(
                    BadFile(path, f"sha256 {digest[:16]}..., expected {info['sha256'][:16]}...")
                )
            if progress is not None:
                progress(size)
    return bad
