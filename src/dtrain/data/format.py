"""The dataset format's constants, field types and manifest: what both the writer and the
reader agree on. See :mod:`dtrain.data.shards` for the layout of a dataset folder."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from dtrain.errors import DataError
from dtrain.fsutil import scheme_of
from dtrain.storage.objects import Location, ObjectPath, StoreError, location, store_refusal

FORMAT = "dtrain-shards"
VERSION = 1
MANIFEST = "manifest.json"
DEFAULT_SHARD_BYTES = 64 * 2**20

Sample = Mapping[str, Any]


@dataclass(frozen=True)
class FieldSpec:
    """One field of every sample: a NumPy dtype and a fixed shape, or ``shape=None`` for a
    variable-length 1-D field (token sequences)."""

    dtype: str
    shape: tuple[int, ...] | None  # None: variable-length 1-D

    @property
    def variable(self) -> bool:
        return self.shape is None

    def to_json(self) -> dict[str, Any]:
        return {"dtype": self.dtype, "shape": None if self.shape is None else list(self.shape)}


def manifest_fingerprint(shards: list[dict[str, Any]]) -> str:
    """What identifies a dataset's contents: a hash of its files' names and checksums (a
    resume checks it, so a position is never applied to other data)."""
    h = hashlib.sha256()
    for shard in shards:
        for fname in sorted(shard["files"]):
            h.update(fname.encode())
            h.update(shard["files"][fname]["sha256"].encode())
    return h.hexdigest()


def read_manifest(data_dir: str | Location) -> dict[str, Any]:
    """The manifest of a dataset folder (local, or a prefix in an object store), checked for
    shape: raises :class:`DataError` naming the folder or file and what is wrong."""
    data_dir = location(data_dir)
    path = data_dir / MANIFEST
    try:
        # Read first, looked for only when missing: in a store, every rank of a job opens the
        # dataset at its start, and each look-up before the read is a round trip more.
        manifest = json.loads(path.read_text())
    except FileNotFoundError:
        if not data_dir.exists():
            raise DataError(
                f"dataset folder {data_dir} does not exist; create it with "
                f"`dtrain prepare SOURCE {data_dir}`"
            ) from None
        raise DataError(
            f"{path} is missing: {data_dir} is not a dtrain dataset (or its "
            "`dtrain prepare` did not finish)"
        ) from None
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


def check_store_datasets(paths: list[str], key: str) -> None:
    """Before any worker starts: each dataset a task names in an object store is there, with
    its manifest (one small read each; a local one is checked by the workers, as always)."""
    for path in paths:
        if scheme_of(path):
            where = ObjectPath(path)
            try:
                read_manifest(where)
            except DataError as exc:
                raise DataError(f"{key}: {exc}") from None
            except StoreError as exc:  # no credentials, no endpoint: the run folder's words
                raise store_refusal(f"{key} {path}", where, exc, "cannot read it: ") from None
