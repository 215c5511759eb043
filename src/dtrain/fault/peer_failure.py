"""What a failed collective is, and the words that report it: the error the trainer raises
(:class:`PeerFailure`), the test for whether an exception is a collective failing at all, and
the phrases :class:`~dtrain.fault.watchdog.Watchdog` builds its diagnosis from (a rank and its
process, a heartbeat as the old report it is, the collective's own error in one line).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch.distributed as dist

if TYPE_CHECKING:
    from dtrain.fault.liveness import Liveness

# How much of the collective's own error a PeerFailure quotes: its first line, which names the
# socket or timeout; gloo's advice that follows adds nothing to the diagnosis.
CAUSE_CHARS = 160


class PeerFailure(RuntimeError):
    """A collective failed because another rank died, raised or stopped responding."""


def is_collective_failure(exc: BaseException) -> bool:
    """Whether an exception is a collective failing (a peer's socket closed, the collective
    timeout expired) rather than this rank's own error: only then is a peer to be named."""
    if isinstance(exc, dist.DistError):
        return True
    text = str(exc).lower()
    return isinstance(exc, RuntimeError) and any(
        marker in text for marker in ("gloo", "connection", "timed out", "nccl", "peer")
    )


def connection_closed(exc: BaseException) -> bool:
    """Whether a collective failed because a peer's end of its connection closed or was reset
    -- the peer's process ended (a process that ends closes its sockets) -- rather than timing
    out (a peer stopped, hung or cut off)."""
    text = str(exc).lower()
    return any(m in text for m in ("closed by peer", "reset by peer", "broken pipe"))


def collective_cause(error: BaseException) -> str:
    """The collective's error in one line, without gloo's source location, cut at a word."""
    text = str(error).strip()
    cause = text.splitlines()[0] if text else type(error).__name__
    cause = cause.split("] ", 1)[-1]  # drop gloo's source location
    if len(cause) > CAUSE_CHARS:
        cause = cause[:CAUSE_CHARS].rsplit(" ", 1)[0] + " ..."
    return cause


def who(rank: int, beat: Liveness) -> str:
    """A rank and the process its heartbeat names."""
    return f"rank {rank} ({beat.host}, pid {beat.pid})"


def beat_words(beat: Liveness, now: float) -> str:
    """A heartbeat as what it is: a report from some time ago, never where the rank is now."""
    age = max(0.0, now - beat.seen_at)
    return f"its last heartbeat, {age:.1f}s old, was at step {beat.step} in {beat.phase}"
