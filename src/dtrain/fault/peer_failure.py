"""What a failed collective is, and the words that report it: the error the trainer raises
(:class:`PeerFailure`), the test for whether an exception is a collective failing at all, and
the phrases :class:`~dtrain.fault.watchdog.Watchdog` builds its diagnosis from (a rank and its
process, a heartbeat as the old report it is, the collective's own error in one line).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch.distributed as dist

if TYPE_CHECKING:
    from dtrain.fault.liveness import Liveness

# How much of the collective's own error a PeerFailure quotes: its first line, which names the
# socket or timeout; gloo's advice that follows adds nothing to the diagnosis.
CAUSE_CHARS = 160


class PeerFailure(RuntimeError):
    """A collective failed because another rank died, raised or stopped responding."""


class NetworkFailure(PeerFailure):
    """A collective failed because the network lost a peer (or the store's host): it does not
    answer at all, where a process that died would be refused by its machine."""


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


def since_words(since: float | None) -> str:
    """`` since 08:40:01 (12s ago)`` for a wall-clock time, or nothing when unknown."""
    if since is None:
        return ""
    ago = max(0.0, time.time() - since)
    return f" since {time.strftime('%H:%M:%S', time.localtime(since))} ({ago:.0f}s ago)"


def probe_words(
    rank_words: str, state: str, said: str, address: str, beat: Liveness, now: float, node: str
) -> tuple[str, bool]:
    """A silent rank on another machine, by what a probe of its address found (see
    :func:`dtrain.dist.reachability.probe`); with whether the network lost it."""
    from dtrain.dist.reachability import REFUSED, UNREACHABLE

    if state == REFUSED:
        return (
            f"{rank_words} died: killed or crashed (its machine refuses connections to it: "
            f"{said}; it posted no error): {beat_words(beat, now)}",
            False,
        )
    if state == UNREACHABLE:
        last = now - beat.seen_at
        return (
            f"{rank_words} is cut off: {node} has no network path to it at {address} ({said})"
            f"{since_words(time.time() - last)}: {beat_words(beat, now)}",
            True,
        )
    return (
        f"{rank_words} stopped responding: its process is alive (it accepts connections) but "
        f"silent: {beat_words(beat, now)}",
        False,
    )


def who(rank: int, beat: Liveness) -> str:
    """A rank and the process its heartbeat names."""
    return f"rank {rank} ({beat.host}, pid {beat.pid})"


def beat_words(beat: Liveness, now: float) -> str:
    """A heartbeat as what it is: a report from some time ago, never where the rank is now."""
    age = max(0.0, now - beat.seen_at)
    return f"its last heartbeat, {age:.1f}s old, was at step {beat.step} in {beat.phase}"
