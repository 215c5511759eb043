"""What a run ran on, and how much memory a rank holds: for the ``start`` and ``ranks``
records of ``metrics.jsonl``."""

from __future__ import annotations

import os
import platform
from typing import Any

import torch

from dtrain.fsutil import proc_field


def rss_anon_bytes() -> float:
    """This process's anonymous resident memory (heap, stacks, tensors on the CPU; not the
    file-backed pages of memory-mapped shards and libraries, which the kernel can drop):
    ``RssAnon`` of ``/proc/self/status``; NaN where there is none (not Linux)."""
    rss = proc_field("/proc/self/status", "RssAnon")  # "123 kB"
    return float(rss.split()[0]) * 1024 if rss else float("nan")


def memory_bytes(device: torch.device) -> float:
    """A rank's memory, as ``memory_kind`` says: on CUDA the most the caching allocator has
    held for tensors since the start (``torch.cuda.max_memory_allocated``), else RssAnon."""
    if device.type == "cuda":
        return float(torch.cuda.max_memory_allocated(device))
    return rss_anon_bytes()


def memory_kind(device: torch.device) -> str:
    return "cuda_max_allocated" if device.type == "cuda" else "rss_anon"


def describe(device: torch.device) -> dict[str, Any]:
    """This machine: CPU model and cores, memory, accelerator, versions."""
    cpu = proc_field("/proc/cpuinfo", "model name") or platform.processor() or platform.machine()
    total = proc_field("/proc/meminfo", "MemTotal")  # "123 kB"
    memory_gb = round(int(total.split()[0]) * 1024 / 1e9, 1) if total else None
    return {
        "device": device.type,
        "cpu": cpu,
        "cpu_cores": os.cpu_count(),
        "memory_gb": memory_gb,
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(terse=True),
    }
