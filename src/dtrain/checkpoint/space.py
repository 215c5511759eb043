"""Room on the disk for a save: the bytes a rank's part of a checkpoint needs, the bytes free
where it goes, and the words for a disk that cannot hold it (docs/fault-tolerance.md, "A full
disk"): a save checks before it writes, so a rank whose files cannot fit leaves the disk as it
was for the other writers, and is not committed.
"""

from __future__ import annotations

import sys
from typing import Any

import torch

from dtrain.checkpoint import store
from dtrain.fsutil import format_size
from dtrain.fsutil import is_disk_full as is_disk_full
from dtrain.storage.objects import Location

# What torch.save adds to a file beyond its tensors' bytes (the pickled structure, the zip
# records) is small; a rank is only refused at once when its tensors alone cannot fit.


class DiskFull(Exception):
    """No room on the disk for a rank's files of a checkpoint (the message says where, and
    how much was needed and is free)."""


def state_bytes(obj: Any) -> int:
    """The bytes ``torch.save`` writes for the tensors in a nested state: each storage once,
    however many tensors view it (a DTensor: this rank's shard)."""
    seen: dict[int, int] = {}
    _storages(obj, seen)
    return sum(seen.values())


def _storages(obj: Any, seen: dict[int, int]) -> None:
    # No DTensor can exist before its module is imported, and importing it costs a replicated
    # run a second it never needs.
    dtensors = sys.modules.get("torch.distributed.tensor")
    if dtensors is not None and isinstance(obj, dtensors.DTensor):
        _storages(obj.to_local(), seen)
    elif isinstance(obj, torch.Tensor):
        storage = obj.untyped_storage()
        seen[storage.data_ptr()] = int(storage.nbytes())
    elif isinstance(obj, (dict, list, tuple)):
        for value in obj.values() if isinstance(obj, dict) else obj:
            _storages(value, seen)
    elif isinstance(obj, (bytes, bytearray)):
        seen[id(obj)] = len(obj)


def words(folder: Location, need: int) -> str:
    """A full disk, in words: where, what was needed, what is free."""
    try:
        room = store.free_bytes(folder)
        free = "an unknown amount" if room is None else format_size(room)
    except OSError:
        free = "an unknown amount"
    return (
        f"no space left on the disk of {folder}: this rank's files of the checkpoint need "
        f"{format_size(need)} and {free} is free; free some space there or choose another run.dir"
    )


def check_room(folder: Location, need: int) -> None:
    """Raise :class:`DiskFull` when ``need`` bytes cannot fit on ``folder``'s disk."""
    room = store.free_bytes(folder)
    if room is not None and need > room:
        raise DiskFull(words(folder, need))
