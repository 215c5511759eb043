"""What a save adds to a process's memory, measured in a process of its own:
``python -m tests.save_memory ROOT MB``, printing one JSON line.

The measure is the resident set's high-water mark (``VmHWM`` in ``/proc/self/status``, reset
to the current resident set by writing 5 to ``/proc/self/clear_refs`` just before the save):
it counts every byte the save touches -- torch's allocations and Python's alike, which
``tracemalloc`` (Python's only) would miss -- and none of the page cache the written files
fill. A fresh process, so that nothing another test left behind moves the mark. Linux only.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from dtrain.checkpoint.write import Checkpointer


def status_bytes(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key):
            return int(line.split()[1]) * 1024
    raise KeyError(key)


def extra_bytes(save: object) -> int:
    """The high-water mark of the resident set while ``save()`` runs, above where it began."""
    Path("/proc/self/clear_refs").write_text("5")
    base = status_bytes("VmRSS:")
    save()  # type: ignore[operator]
    return status_bytes("VmHWM:") - base


def main(root: Path, megabytes: int) -> dict[str, float]:
    torch.manual_seed(0)
    # A model's state: a few large tensors and many small ones.
    n = megabytes * 2**20 // 4
    state = {
        "model.pt": {"big": torch.randn(n // 2), "small": [torch.randn(1000) for _ in range(200)]},
        "optimizer.pt": {"m": torch.randn(n // 4), "v": torch.randn(n // 4)},
    }
    snapshot = sum(
        t.numel() * t.element_size()
        for part in state.values()
        for value in part.values()
        for t in (value if isinstance(value, list) else [value])
    )
    checkpointer = Checkpointer(root, rank=0, world_size=1, keep_last=10, keep_every=0)
    # Warm up: every code path of a save run once, on a tiny state.
    checkpointer.save(1, {"tiny.pt": {"x": torch.ones(4)}}, {"step": 1}, blocking=True)

    def save_async() -> None:
        checkpointer.save(2, state, {"step": 2}, blocking=False)
        assert checkpointer.wait() is None

    def save_blocking() -> None:
        checkpointer.save(3, state, {"step": 3}, blocking=True)

    blocking = extra_bytes(save_blocking)
    asynchronous = extra_bytes(save_async)
    return {"snapshot": snapshot, "async_extra": asynchronous, "blocking_extra": blocking}


if __name__ == "__main__":
    print(json.dumps(main(Path(sys.argv[1]), int(sys.argv[2]))))
