"""Fail points: named places in dtrain where a test can make something go wrong.

Code calls ``failpoint(name, **args)`` where a fault is worth injecting; a test installs one
handler for the whole process (every thread: a background save calls it from its writer thread),
which gets every point's name and arguments and may sleep, raise, record or send a signal. With
no handler installed a point costs a call and one ``if``. (The name comes from FreeBSD's
``fail(9)``; etcd and TiKV have the same.)

    def crash_at_step_7(name: str, **args: Any) -> None:
        if name == "train.step" and args["step"] == 7:
            raise RuntimeError("injected crash")

    with failpoints(crash_at_step_7):
        trainer.fit()

``set_handler`` installs one without a ``with`` (for a worker process's whole life: the
chaos task ``tests.tasks:chaos_gpt`` does it in its factory).

The points (keyword arguments; the ranks that reach them). An exception from a handler at a
``checkpoint.*`` point fails the save as a failure in that phase does, except
``after_marker``, where it is a warning and the step stays committed:

- ``checkpoint.write`` (step): every rank, in the thread that writes, ``.tmp-step-N/`` made,
  before any file;
- ``checkpoint.write_file`` (step, path): every rank, before each ``torch.save`` file or
  ``meta.json`` in ``.tmp-step-N/`` (DCP's ``dcp/`` files have no point);
- ``checkpoint.before_rename`` / ``before_marker`` / ``after_marker`` (step): rank 0, before
  ``.tmp-step-N`` becomes ``step-N``, before ``COMMITTED.json``, before pruning;
- ``checkpoint.verify_piece`` (path, index): every rank, before it hashes each piece it checks;
- ``train.before_collective`` (step): every rank, the batch fetched, before the step's first
  collective (the agreement on its item count and on stopping);
- ``train.step`` (step): every rank, the step agreed, before forward and backward (``step``
  counts from 1, as ``metrics.jsonl``);
- ``balance.timing`` (step, window): every rank, on a timing window's last step, before the
  exchange; a handler may overwrite ``window`` (laid out as
  :data:`dtrain.balance.timing.FIELDS`) in place to feed the controller exact numbers.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Protocol


class Handler(Protocol):
    def __call__(self, name: str, /, **args: Any) -> None: ...


_handler: Handler | None = None


def failpoint(name: str, /, **args: Any) -> None:
    """The fail point ``name``: calls the installed handler, if any, with ``args``."""
    if _handler is not None:
        _handler(name, **args)


def set_handler(handler: Handler | None) -> Handler | None:
    """Install ``handler`` for every fail point of this process (None: none); returns the one
    it replaces."""
    global _handler
    previous, _handler = _handler, handler
    return previous


@contextmanager
def failpoints(handler: Handler) -> Iterator[None]:
    """``handler`` installed for the ``with`` block (the previous one back after it)."""
    previous = set_handler(handler)
    try:
        yield
    finally:
        set_handler(previous)
