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
from collections.abc import Callable, Iterable, Mapping, Sequence
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
        if shard_bytes <= 0:
            raise ValueError(f"shard_bytes must be positive, got {shard_bytes}")
        self.declared: dict[str, FieldSpec] = dict(fields or {})
        self.fields: dict[str, FieldSpec] | None = None
        self.shard_bytes = shard_bytes
        self.overwrite = overwrite
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
        for name, arr in converted.items():
            self._buffer[name].append(arr)
            self._buffer_bytes += arr.nbytes
        self._buffer_count += 1
        self.num_samples += 1
        if self._buffer_bytes >= self.shard_bytes:
            self._flush()

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
            for name, spec in fields.items():
                where = f"samples {self.num_samples}..{self.num_samples + end - begin - 1}"
                block = to_field_array(
                    arrays[name][begin:end], spec.dtype, f"{where}, field {name!r}"
                )
                self._buffer[name].append(block)
                self._buffer_bytes += block.nbytes
            self._buffer_count += end - begin
            self.num_samples += end - begin
            begin = end
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
                    f"{name}.{field_name}.npy", np.concatenate(parts)
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
    for name, spec in m["fields"].items():
        problem = _field_problem(spec)
        if problem:
            return f"field {name!r}: {problem}"
    for shard in m["shards"]:
        if not (
            isinstance(shard, dict)
            and isinstance(shard.get("name"), str)
            and isinstance(shard.get("num_samples"), int)
            and isinstance(shard.get("files"), dict)
        ):
            return f"shard entry {str(shard)[:80]} lacks name, num_samples or files"
        for fname, info in shard["files"].items():
            if not (
                isinstance(info, dict)
                and isinstance(info.get("bytes"), int)
                and isinstance(info.get("sha256"), str)
            ):
                return f"file entry {fname!r} lacks bytes or sha256"
        for field_name, spec in m["fields"].items():
            wanted = [f"{shard['name']}.{field_name}.npy"]
            if spec["shape"] is None:
                wanted.append(f"{shard['name']}.{field_name}.idx.npy")
            missing = [f for f in wanted if f not in shard["files"]]
            if missing:
                return f"shard {shard['name']!r} does not list {missing}"
    if sum(s["num_samples"] for s in m["shards"]) != m["num_samples"]:
        return "the shards' sample counts do not add up to num_samples"
    return ""


def _field_problem(spec: Any) -> str:
    if not isinstance(spec, dict) or "dtype" not in spec or "shape" not in spec:
        return "needs dtype and shape"
    try:
        np.dtype(spec["dtype"])
    except TypeError:
        return f"dtype {spec['dtype']!r} is not a NumPy dtype"
    shape = spec["shape"]
    if shape is not None and not (
        isinstance(shape, list) and all(isinstance(d, int) and d >= 0 for d in shape)
    ):
        return f"shape {shape!r} is neither null nor a list of sizes"
    return ""


@dataclass(frozen=True)
class _Segments:
    """A batch of ids split by shard: ``parts`` holds (shard, where in the batch -- a slice
    when the ids ascend, else positions --, ids local to the shard)."""

    count: int
    ascending: bool
    parts: list[tuple[int, Any, np.ndarray]]


class ShardedDataset:
    """Random access to a dtrain dataset; samples are dicts of NumPy arrays (views into the
    memory-mapped files, so nothing is read until used).

    Opening reads only the manifest and the files' sizes; each file is mapped on first use and
    its ``.npy`` header checked against the manifest then."""

    def __init__(self, data_dir: str | Path) -> None:
        self.path = Path(data_dir)
        self.manifest = read_manifest(self.path)
        self.fields = {
            name: FieldSpec(f["dtype"], None if f["shape"] is None else tuple(f["shape"]))
            for name, f in self.manifest["fields"].items()
        }
        self.shard_sizes = tuple(int(s["num_samples"]) for s in self.manifest["shards"])
        self._starts = np.concatenate([[0], np.cumsum(self.shard_sizes)]).astype(np.int64)
        self._start_list: list[int] = self._starts.tolist()
        self._shard_names = [str(s["name"]) for s in self.manifest["shards"]]
        self._check_sizes()
        self._arrays: dict[str, np.ndarray] = {}
        self._columns: dict[str, list[np.ndarray | None]] = {}  # field -> shard -> values
        self._lengths: dict[str, np.ndarray] = {}
        self._fixed_only: bool | None = None
        self._collate_fast: tuple[Any, Any] = (None, None)

    @property
    def fingerprint(self) -> str:
        return str(self.manifest["fingerprint"])

    def __len__(self) -> int:
        return int(self.manifest["num_samples"])

    def __getstate__(self) -> dict[str, Any]:
        # Sent to DataLoader workers (spawn/forkserver): pickling a memory map would copy the
        # whole file, so each process maps the files again on first use.
        state = self.__dict__.copy()
        state.update(_arrays={}, _columns={}, _fixed_only=None, _collate_fast=(None, None))
        return state

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
                        f"{info['bytes']}: it is truncated or was changed; re-run "
                        "`dtrain prepare` (`dtrain verify` lists every bad file)"
                    )

    def _array(self, filename: str, dtype: str, shape: tuple[int, ...]) -> np.ndarray:
        arr = self._arrays.get(filename)
        if arr is None:
            path = self.path / filename
            try:
                mapped = np.load(path, mmap_mode="r", allow_pickle=False)
            except (ValueError, OSError) as exc:
                raise DataError(f"shard file {path} cannot be read as .npy: {exc}") from None
            if mapped.dtype != np.dtype(dtype) or mapped.shape != shape:
                raise DataError(
                    f"shard file {path} holds {mapped.dtype} {mapped.shape}, the manifest says "
                    f"{np.dtype(dtype)} {shape}; re-run `dtrain prepare`"
                )
            # A plain ndarray view of the map (it keeps the map alive): indexing it skips
            # np.memmap's Python-level __getitem__/__array_finalize__, which dominate per-sample
            # reads of small samples.
            arr = mapped.view(np.ndarray)
            self._arrays[filename] = arr
        return arr

    def locate(self, index: int) -> tuple[int, int]:
        if not 0 <= index < len(self):
            raise IndexError(f"sample {index} is out of range for {len(self)} samples")
        shard = int(np.searchsorted(self._starts, index, side="right")) - 1
        return shard, index - int(self._starts[shard])

    def field_offsets(self, shard: int, name: str) -> np.ndarray:
        n = self.shard_sizes[shard]
        offsets = self._array(f"{self._shard_names[shard]}.{name}.idx.npy", "int64", (n + 1,))
        return offsets

    def field_values(self, shard: int, name: str) -> np.ndarray:
        spec = self.fields[name]
        filename = f"{self._shard_names[shard]}.{name}.npy"
        if spec.shape is not None:
            return self._array(filename, spec.dtype, (self.shard_sizes[shard], *spec.shape))
        if filename not in self._arrays:
            total = int(self.field_offsets(shard, name)[-1])
            return self._array(filename, spec.dtype, (total,))
        return self._arrays[filename]

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

    def gather(self, name: str, indices: np.ndarray | Sequence[int]) -> np.ndarray:
        """A fixed-size field for many samples at once, as one new array: one vectorized read
        per shard touched instead of one Python call per sample. Ascending ids (as the
        partitioner lists them) are copied once, straight into the result."""
        return self._gather(name, self._segments(np.asarray(indices, dtype=np.int64)))

    def fetch_collated(self, indices: Sequence[int], collate_fn: Any) -> Any | None:
        """The batch ``collate_fn`` would make of these samples, read in one vectorized step
        per field -- or None when there is no fast path (variable-length fields, or a collate
        function other than torch's ``default_collate``). Used by :mod:`dtrain.data.loader`."""
        if self._fixed_only is None:
            # Imported here, so that `dtrain prepare` and `verify` start without torch.
            import torch
            from torch.utils.data import default_collate

            self._fixed_only = not any(s.variable for s in self.fields.values())
            self._collate_fast = (default_collate, torch.from_numpy)
        default, from_numpy = self._collate_fast
        if collate_fn is not default or not self._fixed_only:
            return None
        segments = self._segments(np.asarray(indices, dtype=np.int64))
        return {name: from_numpy(self._gather(name, segments)) for name in self.fields}

    def _segments(self, idx: np.ndarray) -> _Segments:
        """Where each id lives: per shard touched, the positions in the batch and the local
        ids. Computed once per batch and shared by its fields."""
        n = len(idx)
        if n == 0:
            return _Segments(n, True, [])
        ascending = n == 1 or bool(np.all(idx[1:] >= idx[:-1]))
        low, high = (int(idx[0]), int(idx[-1])) if ascending else (int(idx.min()), int(idx.max()))
        if low < 0 or high >= len(self):
            raise IndexError(f"sample ids {low}..{high} out of range for {len(self)} samples")
        parts: list[tuple[int, Any, np.ndarray]] = []
        if ascending:
            # Each shard's ids are one contiguous run of the batch.
            found = np.searchsorted(idx, self._starts)
            cuts = found.tolist()
            shards: Iterable[int] = range(len(self.shard_sizes))
            if len(cuts) > 64:  # many shards: visit only the ones this batch touches
                shards = np.flatnonzero(found[1:] > found[:-1]).tolist()
            for shard in shards:
                a, b = cuts[shard], cuts[shard + 1]
                if a < b:
                    parts.append((shard, slice(a, b), idx[a:b] - self._start_list[shard]))
            return _Segments(n, True, parts)
        shard_of = np.searchsorted(self._starts, idx, side="right") - 1
        by_shard = np.argsort(shard_of, kind="stable")
        cuts = np.flatnonzero(np.diff(shard_of[by_shard])) + 1
        for positions in np.split(by_shard, cuts):
            shard = int(shard_of[positions[0]])
            parts.append((shard, positions, idx[positions] - self._starts[shard]))
        return _Segments(n, False, parts)

    def _gather(self, name: str, segments: _Segments) -> np.ndarray:
        spec = self.fields[name]
        if spec.shape is None:
            raise ValueError(f"field {name!r} is variable-length; use __getitem__")
        out = np.empty((segments.count, *spec.shape), dtype=spec.dtype)
        column = self._columns.get(name)
        if column is None:
            column = self._columns[name] = [None] * len(self.shard_sizes)
        for shard, where, local in segments.parts:
            values = column[shard]
            if values is None:
                values = column[shard] = self.field_values(shard, name)
            # The range is checked, so take() may skip its own check ("clip"); with the
            # default ("raise") NumPy buffers a take into ``out``: a second copy.
            if segments.ascending:
                values.take(local, 0, out[where], "clip")
            else:
                out[where] = values.take(local, 0, None, "clip")
        return out

    def sample_lengths(self, name: str | None = None) -> np.ndarray | None:
        """Length of every sample's variable-length field (the token count), or None for a
        dataset of fixed-size samples. Reads only the offsets files."""
        if name is None:
            variable = [n for n, s in self.fields.items() if s.variable]
            if not variable:
                return None
            name = variable[0]
        if not self.fields[name].variable:
            raise ValueError(f"field {name!r} has a fixed size; it has no lengths")
        if name not in self._lengths:
            parts = [np.diff(self.field_offsets(s, name)) for s in range(len(self.shard_sizes))]
            self._lengths[name] = np.concatenate(parts).astype(np.int64)
        return self._lengths[name]


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
    """Check every file of a dataset against the manifest: presence, size, SHA-256 (reads
    every byte). Also checks that the manifest's fingerprint matches its checksums, which
    catches a hand-edited manifest."""
    data_dir = Path(data_dir)
    manifest = read_manifest(data_dir)
    bad: list[BadFile] = []
    if _fingerprint(manifest["shards"]) != manifest.get("fingerprint"):
        bad.append(BadFile(data_dir / MANIFEST, "fingerprint does not match the files' checksums"))
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
