"""Running out of memory, said in one line: which rank, where (step and phase), how many bytes
the allocation asked for, and what to try. The allocator's own error (torch's enforce message,
CUDA's report, a chain of autograd callbacks around it) goes to the run folder's log with the
rest of the traceback (:mod:`dtrain.fault.error_log`).

Only an allocation that fails is seen here. When the kernel's OOM killer ends a process
instead (Linux overcommits memory: a large allocation often succeeds and the process is killed
later, when it touches the pages), the rank dies of SIGKILL and the launcher names it as killed
(:func:`dtrain.launch.reports.report_failure`).
"""

from __future__ import annotations

import re
from collections.abc import Iterator

# What each allocator says, and where it gives the size.
_CPU = re.compile(r"can't allocate memory: you tried to allocate (\d+) bytes")
_CUDA = re.compile(r"out of memory\. Tried to allocate ([\d.]+ [KMGT]?i?B)", re.IGNORECASE)

WHAT_TO_TRY = (
    "try a smaller micro-batch (more data.micro_batches, or a smaller data.global_batch_size), "
    "activation checkpointing in the task's model, or strategy.name = 'fsdp' (shards "
    "parameters, gradients and optimizer state over the ranks)"
)


class OutOfMemory(RuntimeError):
    """A rank's allocation failed: the words of :func:`describe`, the allocator's error as
    its cause."""


def _chain(error: BaseException) -> Iterator[BaseException]:
    """The error and those it was raised from or during, innermost last; each once."""
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        yield current
        current = current.__cause__ or current.__context__


def asked_for(error: BaseException) -> str | None:
    """How much memory a failed allocation asked for, in words ("3.2 GiB of CPU memory"), or
    None when ``error`` is no allocation failure. An allocation failure whose size is not
    known (Python's own MemoryError) says so."""
    for item in _chain(error):
        text = str(item)
        if match := _CPU.search(text):
            count = int(match.group(1))
            return f"{_bytes(count)} ({count} bytes) of CPU memory"
        if match := _CUDA.search(text):
            return f"{match.group(1)} of GPU memory"
        if isinstance(item, MemoryError):
            return "an unknown number of bytes (Python's MemoryError)"
        import torch  # at first use: importing this module costs no torch import

        if isinstance(item, torch.OutOfMemoryError):
            return "an unknown number of bytes of GPU memory"
    return None


def describe(error: BaseException, who: str, where: str) -> str | None:
    """One line for an allocation failure (None for any other error): ``who`` names the rank
    ("rank 1 (host-a)"), ``where`` its place ("at step 3 in forward_backward")."""
    size = asked_for(error)
    if size is None:
        return None
    return f"{who} ran out of memory {where}: an allocation asked for {size}; {WHAT_TO_TRY}"


def _bytes(count: int) -> str:
    value = float(count)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")
