"""A quicker interpreter exit for dtrain's processes (the launcher and every worker)."""

from __future__ import annotations

import atexit
import gc


def freeze_heap_at_exit() -> None:
    """At exit, before the interpreter finalizes, move every object it holds into the garbage
    collector's permanent generation (``gc.freeze``), which its last collections skip.

    With torch loaded those collections walk millions of objects: finalizing took a worker
    that had built DDP 0.65 s (DDP imports TorchDynamo) and a process that only imported torch
    0.33 s on this machine, 0.14 s with the heap frozen -- paid at the end of every run, by
    the workers and then by the launcher. Nothing else changes: atexit handlers (registered
    before this one) run, modules are torn down, and files, loggers and threads are closed as
    before; only reference cycles still unreachable at exit are not collected, and Python does
    not promise to finalize objects that exist at exit anyway. Idempotent: a second call
    replaces the first registration."""
    atexit.unregister(gc.freeze)
    atexit.register(gc.freeze)
