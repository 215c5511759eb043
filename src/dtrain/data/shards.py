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

A dataset in an object store (``s3://bucket/data``, written by ``dtrain prepare``) opens the
same way: its files are mapped from sparse local copies that hold the pieces fetched so far
(:mod:`dtrain.data.store_shards`); every read of it holds the pieces it touches, and copies.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from dtrain.data.format import (
    DEFAULT_SHARD_BYTES,
    FORMAT,
    MANIFEST,
    VERSION,
    FieldSpec,
    manifest_fingerprint,
    read_manifest,
)
from dtrain.data.rows import ShardRows
from dtrain.data.store_shards import StoreShards
from dtrain.data.writer import ShardWriter, to_field_array, write_shards
from dtrain.errors import DataError
from dtrain.fsutil import sha256_file, sha256_stream
from dtrain.storage.objects import Location, ObjectPath, location

# The format's public names, importable from here as well (the module users know).
__all__ = [
    "DEFAULT_SHARD_BYTES",
    "FORMAT",
    "MANIFEST",
    "VERSION",
    "BadFile",
    "FieldSpec",
    "ShardWriter",
    "ShardedDataset",
    "read_manifest",
    "sha256_file",
    "to_field_array",
    "verify_dataset",
    "write_shards",
]


class ShardedDataset:
    """Random access to a dtrain dataset; samples are dicts of NumPy arrays (views into the
    memory-mapped files, so nothing is read until used).

    Opening reads only the manifest and the files' sizes; each file is mapped on first use and
    its ``.npy`` header checked against the manifest then."""

    def __init__(
        self, data_dir: str | Location, cache_dir: str = "", cache_bytes: int = 2**30
    ) -> None:
        self.path = location(data_dir)
        self.manifest = read_manifest(self.path)
        self.fields = {
            name: FieldSpec(f["dtype"], None if f["shape"] is None else tuple(f["shape"]))
            for name, f in self.manifest["fields"].items()
        }
        self.shard_sizes = tuple(int(s["num_samples"]) for s in self.manifest["shards"])
        self._starts = np.concatenate([[0], np.cumsum(self.shard_sizes)]).astype(np.int64)
        self._shard_names = [str(s["name"]) for s in self.manifest["shards"]]
        # In an object store: its files, and this process's cache of their pieces.
        self.store: StoreShards | None = None
        if isinstance(self.path, ObjectPath):
            self.store = StoreShards(self.path, self.manifest, cache_dir, cache_bytes)
        else:
            self._check_sizes()
        self._arrays: dict[str, np.ndarray] = {}
        self._rows: dict[str, ShardRows] = {}  # fixed-size field -> its batched reader
        self._lengths: dict[str, np.ndarray] = {}
        self._layouts: dict[str, tuple[np.ndarray, np.ndarray, int]] = {}  # store only
        self._offsets: dict[str, np.ndarray] = {}  # store only

    @property
    def fingerprint(self) -> str:
        return str(self.manifest["fingerprint"])

    def __len__(self) -> int:
        return int(self.manifest["num_samples"])

    def __getstate__(self) -> dict[str, Any]:
        # Sent to DataLoader workers (spawn/forkserver): pickling a memory map would copy the
        # whole file, so each process maps the files again on first use.
        if self.store is not None:
            raise DataError(
                f"{self.path}: shards in an object store are read by the training process "
                "(its read-ahead thread), not by DataLoader worker processes: set "
                "data.num_workers = 0"
            )
        state = self.__dict__.copy()
        state.update(_arrays={}, _rows={})
        return state

    def _check_sizes(self) -> None:
        assert isinstance(self.path, Path)
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
                if self.store is not None:
                    mapped = self._store_array(filename, dtype, shape)
                else:
                    mapped = np.load(str(path), mmap_mode="r", allow_pickle=False)
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

    def _store_array(self, filename: str, dtype: str, shape: tuple[int, ...]) -> np.ndarray:
        """A file in the store: an offsets file read whole, into memory; a values file mapped
        from its sparse local copy, past a header whose length is the file's size less its
        data (the header's bytes are checked with the first piece's hash, not parsed)."""
        assert self.store is not None
        if filename.endswith(".idx.npy"):
            return self.store.load_array(filename)
        file = self.store.index[filename]
        data = np.dtype(dtype).itemsize * int(np.prod(shape, dtype=np.int64))
        header = int(self.store.sizes[file]) - data
        if header < 10:
            raise DataError(
                f"shard file {self.path}/{filename} has {self.store.sizes[file]} bytes, too few "
                f"for {np.dtype(dtype)} {shape}; prepare the dataset again"
            )
        if data == 0:
            return np.empty(shape, dtype=dtype)
        path = self.store.local_path(file)
        return np.memmap(path, dtype=dtype, mode="r", offset=header, shape=shape)

    def holding(self, ids: np.ndarray | Sequence[int]) -> AbstractContextManager[None]:
        """What a read of samples ``ids`` runs in: their pieces held (fetched first) for a
        dataset in a store; nothing for a local one."""
        if self.store is None:
            return nullcontext()
        return self.store.hold(self.pieces(ids))

    def pieces(self, ids: np.ndarray | Sequence[int]) -> np.ndarray:
        """The store's pieces that samples ``ids`` read, every field (a dataset in a store)."""
        idx, shard_of = self._ids_and_shards(ids)
        local = idx - self._starts[shard_of]
        parts = []
        for name, spec in self.fields.items():
            if spec.variable:
                # Each shard's offsets, end to end: sample idx of shard s is at idx + s.
                offsets = self._all_offsets(name)
                lo, hi = offsets[idx + shard_of], offsets[idx + shard_of + 1]
                parts.append(self.value_pieces(name, shard_of, lo, hi))
            else:
                parts.append(self.value_pieces(name, shard_of, local, local + 1))
        return np.unique(np.concatenate(parts)) if parts else np.empty(0, dtype=np.int64)

    def value_pieces(
        self, name: str, shard: np.ndarray, lo: np.ndarray, hi: np.ndarray
    ) -> np.ndarray:
        """The store's pieces that hold elements ``lo .. hi-1`` of field ``name`` in each
        ``shard`` (rows of a fixed-size field, values of a variable-length one)."""
        assert self.store is not None
        files, headers, item = self._file_layout(name)
        begin = headers[shard]
        return self.store.pieces(files[shard], begin + lo * item, begin + hi * item)

    def _file_layout(self, name: str) -> tuple[np.ndarray, np.ndarray, int]:
        """Per shard, the store's index of field ``name``'s values file and its header's
        length; and the bytes of one element."""
        cached = self._layouts.get(name)
        if cached is None:
            assert self.store is not None
            spec = self.fields[name]
            item = np.dtype(spec.dtype).itemsize * int(np.prod(spec.shape or (), dtype=np.int64))
            files = np.asarray(
                [self.store.index[f"{shard}.{name}.npy"] for shard in self._shard_names],
                dtype=np.int64,
            )
            if spec.variable:
                ends = [int(self.field_offsets(s, name)[-1]) for s in range(len(files))]
                count = np.asarray(ends, dtype=np.int64)
            else:
                count = np.asarray(self.shard_sizes, dtype=np.int64)
            cached = (files, self.store.sizes[files] - count * item, item)
            self._layouts[name] = cached
        return cached

    def _all_offsets(self, name: str) -> np.ndarray:
        cached = self._offsets.get(name)
        if cached is None:
            shards = range(len(self.shard_sizes))
            cached = np.concatenate([self.field_offsets(s, name) for s in shards])
            self._offsets[name] = cached
        return cached

    def locate(self, index: int) -> tuple[int, int]:
        if not 0 <= index < len(self):
            raise IndexError(f"sample {index} is out of range for {len(self)} samples")
        shard = int(np.searchsorted(self._starts, index, side="right")) - 1
        return shard, index - int(self._starts[shard])

    def field_offsets(self, shard: int, name: str) -> np.ndarray:
        n = self.shard_sizes[shard]
        return self._array(f"{self._shard_names[shard]}.{name}.idx.npy", "int64", (n + 1,))

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
        if self.store is None:
            return self._item(index)
        with self.holding([int(index)]):  # copied: the pieces may go once no longer held
            return {name: np.array(value) for name, value in self._item(index).items()}

    def _item(self, index: int) -> dict[str, np.ndarray]:
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

    def gather(self, name: str, indices: np.ndarray | Sequence[int]) -> np.ndarray:
        """A fixed-size field for many samples at once, as one new array: one vectorized read
        however many shards the ids touch (:class:`~dtrain.data.rows.ShardRows`)."""
        if self.store is None:  # local: nothing on the path
            return self._field_rows(name).read(*self._ids_and_shards(indices))
        with self.holding(indices):
            return self._field_rows(name).read(*self._ids_and_shards(indices))

    def fetch_collated(self, indices: Sequence[int], collate_fn: Any) -> Any | None:
        """The batch ``collate_fn`` would make of these samples, read in one vectorized step
        per field -- or None when there is no fast path (variable-length fields, or a collate
        function other than torch's ``default_collate``). Used by :mod:`dtrain.data.loader`."""
        # Imported here, so that `dtrain prepare` and `verify` start without torch.
        import torch
        from torch.utils.data import default_collate

        if collate_fn is not default_collate:
            return None
        variable = [name for name, spec in self.fields.items() if spec.variable]
        if variable:
            raise DataError(
                f"{self.path}: field(s) {variable} hold sequences of different lengths, which "
                "the default batch layout (torch's default_collate) cannot stack: train on "
                "dtrain.data.text.TokenWindows(dataset, seq_len[, stride=1]) with "
                "collate_fn=collate_windows (or TokenSequences with collate_padded), or give "
                "Task.collate_fn and Task.split_batch for these fields"
            )
        idx, shard_of = self._ids_and_shards(indices)  # shared by the fields
        if self.store is None:  # local: nothing on the path
            return {
                name: torch.from_numpy(self._field_rows(name).read(idx, shard_of))
                for name in self.fields
            }
        with self.holding(idx):
            return {
                name: torch.from_numpy(self._field_rows(name).read(idx, shard_of))
                for name in self.fields
            }

    def _ids_and_shards(self, indices: np.ndarray | Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
        """The ids as int64, checked to be in range, and the shard each lies in."""
        idx = np.asarray(indices, dtype=np.int64)
        # One pass for both ends: read as unsigned, a negative id is above any count.
        if len(idx) and int(idx.view(np.uint64).max()) >= len(self):
            raise IndexError(
                f"sample ids {int(idx.min())}..{int(idx.max())} out of range for "
                f"{len(self)} samples"
            )
        return idx, self._starts.searchsorted(idx, "right") - 1

    def _field_rows(self, name: str) -> ShardRows:
        rows = self._rows.get(name)
        if rows is None:
            spec = self.fields[name]
            if spec.shape is None:
                raise ValueError(f"field {name!r} is variable-length; use __getitem__")
            rows = ShardRows(
                lambda shard: self.field_values(shard, name),
                self._starts,
                np.dtype(spec.dtype),
                spec.shape,
            )
            self._rows[name] = rows
        return rows

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
    path: Location
    problem: str

    def __str__(self) -> str:
        return f"{self.path}: {self.problem}"


def verify_dataset(data_dir: str | Location) -> list[BadFile]:
    """Check every file of a dataset (a folder, or a prefix in an object store) against the
    manifest: presence, size, SHA-256 (reads every byte). Also checks that the manifest's
    fingerprint matches its checksums, which catches a hand-edited manifest."""
    data_dir = location(data_dir)
    manifest = read_manifest(data_dir)
    bad: list[BadFile] = []
    if manifest_fingerprint(manifest["shards"]) != manifest.get("fingerprint"):
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
            with path.open("rb") as fh:  # a local file or an object: the same bytes
                digest = sha256_stream(fh)
            if digest != info["sha256"]:
                bad.append(
                    BadFile(path, f"sha256 {digest[:16]}..., expected {info['sha256'][:16]}...")
                )
    return bad
