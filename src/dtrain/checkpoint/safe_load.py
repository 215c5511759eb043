"""Loading a checkpoint as data, never as code: what every read of a checkpoint's files admits
(the policy: docs/security.md).

Whole files load with ``torch.load(weights_only=True)`` (:func:`load_file`). torch's own DCP
reader unpickles ``dcp/.metadata`` with a plain ``pickle.load`` and each non-tensor item with
``torch.load(weights_only=False)``, either of which runs whatever a crafted file asks. Here
``.metadata`` is unpickled admitting only the classes DCP's metadata is made of
(:data:`METADATA_GLOBALS`, and torch's dtypes, layouts and memory formats by name), then
checked: every storage entry names a plain file in ``dcp/`` that the completion marker lists (a
crafted entry cannot make us read another file), with no stream transform (dtrain writes none)
(:func:`read_metadata`); :mod:`dtrain.checkpoint.safe_dcp` builds DCP's reader on it.

The marker's digests are unkeyed (whoever can write a checkpoint can re-seal it): what stops a
crafted file is this. This module imports no ``torch.distributed.checkpoint``, which brings in
DTensor: the launcher and the replicated strategies read whole files only.
"""

from __future__ import annotations

import io
import pickle
import re
from collections.abc import Collection
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from dtrain.checkpoint import copies
from dtrain.checkpoint.layout import SHARDED_DIR
from dtrain.checkpoint.store import open_read
from dtrain.errors import CheckpointError
from dtrain.storage.objects import Location, ObjectPath

if TYPE_CHECKING:
    from torch.distributed.checkpoint.metadata import Metadata

METADATA_FILE = ".metadata"  # DCP's name for it (torch.distributed.checkpoint.filesystem)
ONLY_DATA = "dtrain loads only tensors and plain data"

_DCP = "torch.distributed.checkpoint.metadata"
# What pickling DCP's metadata of fsdp, tensor and pipeline checkpoints asks ``find_class`` for
# (torch 2.13), and nothing else. Each is a dataclass, an enum or a torch type built from plain
# values; none runs code of the file's choosing.
METADATA_GLOBALS: frozenset[tuple[str, str]] = frozenset(
    {
        (_DCP, "Metadata"),
        (_DCP, "MetadataIndex"),
        (_DCP, "StorageMeta"),
        (_DCP, "TensorStorageMetadata"),
        (_DCP, "BytesStorageMetadata"),
        (_DCP, "ChunkStorageMetadata"),
        (_DCP, "TensorProperties"),
        (_DCP, "_MEM_FORMAT_ENCODING"),
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        ("torch", "Size"),
        ("torch.serialization", "_get_layout"),  # a layout by its name ("torch.strided")
        ("pathlib", "PosixPath"),  # StorageMeta.checkpoint_id: the folder it was saved into
        ("pathlib._local", "PosixPath"),  # the same, pickled by Python 3.13 and later
    }
)
# torch's dtypes, layouts and memory formats pickle as module globals (``torch.float32``): the
# names of those, looked up in torch's namespace (never with getattr, which may import).
_TORCH_CONSTANTS = (torch.dtype, torch.layout, torch.memory_format)
_TORCH_CONSTANT_NAMES = frozenset(
    name for name, value in vars(torch).items() if isinstance(value, _TORCH_CONSTANTS)
)


# ---------------------------------------------------------------------------------------------
# Whole files


def torch_load(path: Location) -> Any:
    """``path`` as tensors (on the CPU) and plain data; a ``pickle.UnpicklingError`` for
    anything else (:func:`why_refused` says what in one line). A store's file is read whole
    first (one request, rather than one per record of the archive)."""
    if isinstance(path, Path):
        return torch.load(path, map_location="cpu", weights_only=True)
    kept = copies.active()
    copy = kept.completed(path) if kept is not None else None
    if kept is not None and copy is not None:  # a resume's copy: verified, completed once
        source = copy.loadable()
        try:
            return torch.load(source, map_location="cpu", weights_only=True)
        finally:
            if not isinstance(source, Path):
                source.close()
            kept.release(path.url)  # loaded once: its room goes
    return torch.load(io.BytesIO(path.read_bytes()), map_location="cpu", weights_only=True)


def load_file(step_dir: Location, name: str) -> Any:
    """The checkpoint file ``name`` of ``step_dir``, as tensors and plain data."""
    path = step_dir / name
    try:
        return torch_load(path)
    except FileNotFoundError:
        raise CheckpointError(f"{path} is missing") from None
    except pickle.UnpicklingError as exc:
        raise CheckpointError(
            f"{name} in {step_dir} is not a checkpoint's data: {why_refused(exc)}; {ONLY_DATA}"
        ) from None
    except Exception as exc:  # a corrupted archive
        raise CheckpointError(f"{path} cannot be loaded: {first_line(exc)}") from None


def why_refused(exc: BaseException) -> str:
    """torch's refusal of a file (several paragraphs) in a few words: 'it tries to load
    posix.system'."""
    match = re.search(r"GLOBAL ([\w.]+)", str(exc))
    if match:
        return f"it tries to load {match.group(1)}"
    boilerplate = ("Weights only load failed", "Please file an issue", "Check the documentation")
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    told = [line for line in lines if not line.startswith(boilerplate)]
    return f"it holds what torch.load(weights_only=True) refuses ({(told or lines or ['?'])[0]})"


def printable(text: str) -> str:
    """``text`` as it is, or quoted where it holds a line break or other control character
    (a crafted file chooses it, and an error stays one line)."""
    return text if text.isprintable() else repr(text)


def first_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return lines[0] if lines else type(exc).__name__


# ---------------------------------------------------------------------------------------------
# DCP's sharded state


class _Refused(pickle.UnpicklingError):
    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.name = name


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP's metadata and nothing else: any other global is refused before it is
    imported."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in METADATA_GLOBALS or (
            module == "torch" and name in _TORCH_CONSTANT_NAMES
        ):
            return super().find_class(module, name)
        raise _Refused(f"{module}.{name}")


def open_verified(path: Location) -> Any:
    """``path`` opened for reading: a resume's copy of a store's file where it keeps
    one (:mod:`dtrain.checkpoint.copies`), else the file itself."""
    kept = copies.active() if isinstance(path, ObjectPath) else None
    copy = kept.completed(path) if kept is not None and isinstance(path, ObjectPath) else None
    return copy.open() if copy is not None else open_read(path)


def read_metadata(step_dir: Location, listed: Collection[str]) -> Metadata:
    """``dcp/.metadata`` of ``step_dir``, checked: a :class:`CheckpointError` naming it where it
    holds anything but DCP's metadata, or names a file outside ``listed`` (the names in ``dcp/``
    that the completion marker lists)."""
    shown = f"{SHARDED_DIR}/{METADATA_FILE} in {step_dir}"
    if METADATA_FILE not in listed:
        raise CheckpointError(f"{shown} is not a file the completion marker lists")
    try:
        with open_verified(step_dir / SHARDED_DIR / METADATA_FILE) as fh:
            metadata = _MetadataUnpickler(fh).load()
    except FileNotFoundError:
        raise CheckpointError(f"{shown} is missing") from None
    except _Refused as exc:
        raise CheckpointError(
            f"{shown} is not a checkpoint's metadata: it tries to load {printable(exc.name)}; "
            f"{ONLY_DATA}"
        ) from None
    except Exception as exc:  # truncated, or values an allowed class rejects
        raise CheckpointError(f"{shown} is corrupted: {first_line(exc)}") from None
    problem = metadata_problem(metadata, listed)
    if problem:
        raise CheckpointError(f"{shown} is not a checkpoint's metadata: {problem}")
    return metadata


def metadata_problem(metadata: Any, listed: Collection[str]) -> str:
    """What is wrong with unpickled metadata ('' for nothing): its types, and where its storage
    entries point."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        BytesStorageMetadata,
        Metadata,
        MetadataIndex,
        TensorStorageMetadata,
    )

    if not isinstance(metadata, Metadata):
        return f"it holds a {type(metadata).__name__}, not DCP's Metadata"
    items = metadata.state_dict_metadata
    if not isinstance(items, dict) or not all(
        isinstance(key, str) and isinstance(item, (TensorStorageMetadata, BytesStorageMetadata))
        for key, item in items.items()
    ):
        return "its state_dict_metadata is not a table of tensors and items"
    storage = metadata.storage_data
    if not isinstance(storage, dict):
        return "its storage_data is not a table"
    for index, info in storage.items():
        if not isinstance(index, MetadataIndex) or not isinstance(info, _StorageInfo):
            return "its storage_data holds other types than DCP's"
        where = f"its entry for {printable(str(index.fqn))}"
        name = info.relative_path
        if not isinstance(name, str) or not plain_file_name(name):
            return f"{where} points at {name!r}, not a file in {SHARDED_DIR}/"
        if name not in listed:
            return f"{where} points at {name!r}, a file the completion marker does not list"
        if not all(isinstance(n, int) and n >= 0 for n in (info.offset, info.length)):
            return f"{where} has no plain offset and length"
        if info.transform_descriptors:  # e.g. zstd: dtrain writes none
            return f"{where} asks for stream transforms {list(info.transform_descriptors)}"
    return ""


def plain_file_name(name: str) -> bool:
    """A file name right inside a folder: not empty, no separator or NUL, not . or .."""
    return (
        bool(name) and name not in (".", "..") and not any(sep in name for sep in ("/", "\\", "\0"))
    )
