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

The points, with their keyword arguments. The checkpointer (:mod:`dtrain.checkpoint.write`),
in the order of one save; an exception raised in a handler fails the save as a failure in that
phase does (the step is not committed, and the error is reported):

``checkpoint.write`` (step)
    every rank, in the thread that writes (the training thread for a synchronous save, the
    background writer for an asynchronous one), once ``.tmp-step-N/`` exists, before any file;
``checkpoint.write_file`` (step, path)
    every rank, before each file of ``torch.save`` data or ``meta.json`` is written; ``path``
    is the file in ``.tmp-step-N/`` (the sharded ``dcp/`` files are written by
    ``torch.distributed.checkpoint`` and have no point);
``checkpoint.before_rename`` (step)
    rank 0, every rank's files written and reported, before ``.tmp-step-N`` becomes ``step-N``;
``checkpoint.before_marker`` (step)
    rank 0, ``step-N`` in place, before its ``COMMITTED.json`` is written;
``checkpoint.after_marker`` (step)
    rank 0, the step committed, before older checkpoints are pruned (a failure here is a
    warning: the checkpoint stays committed).

Verifying a checkpoint (:mod:`dtrain.checkpoint.verify`), before resume or a rollback:

``checkpoint.verify_piece`` (path, index)
    every rank, before it hashes each piece of its share; ``path`` is the file, ``index`` the
    piece's.

The training loop (:mod:`dtrain.train.trainer`); ``step`` is the number of the step being trained
(1 for the first, as ``metrics.jsonl`` counts):

``train.before_collective`` (step)
    every rank, the step's batch fetched, just before the step's first collective (the
    all-reduce in which the ranks agree on its item count and on stopping);
``train.step`` (step)
    every rank, the ranks agreed to train the step, before its forward and backward.

Load balancing (:mod:`dtrain.balance.balancer`):

``balance.timing`` (step, window)
    every rank, on a timing window's last step, before the ranks exchange their timing
    windows; ``window`` is this rank's (a NumPy array laid out as
    :data:`dtrain.balance.timing.FIELDS`), which a handler may overwrite in place to feed the
    controller exact numbers.
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
