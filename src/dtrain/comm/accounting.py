"""What communication costs a rank: the bytes it sends and the time it waits.

Bytes are counted from tensor sizes and the collective's algorithm, not measured on a socket,
so they are exact and the same on every run. The model is the bandwidth-optimal ring, which is
what the collectives of gloo and NCCL approach for the large tensors that dominate traffic:

=================  ==================================  ========================================
collective         bytes one rank sends                why
=================  ==================================  ========================================
all-reduce of S    2 (N-1)/N x S                       reduce-scatter, then all-gather: each is
                                                       N-1 hops of a 1/N chunk
all-gather of s    (N-1) x s                           each rank's part passes N-1 links
(per rank)
broadcast of S     S on every rank                     a pipelined chain: each rank forwards
                                                       (the last one sends nothing; counted as
                                                       S for all, an upper bound by one chunk)
all-reduce of S    what the transport says it sends    (:mod:`dtrain.comm.transport`)
through an opt-in
transport
=================  ==================================  ========================================

With 2 ranks an all-reduce sends exactly its payload. The waiting time is the time a rank is
blocked on communication that no computation hides: for gradients synchronized during
backward, from the end of the backward computation (the last bucket launched) until every
bucket is reduced; for a blocking collective, its whole duration.

What each strategy counts, and how waiting is timed: docs/communication.md, "Bytes, exactly"
and "Waiting" (not counted: DDP's own small metadata exchanges at construction and rebuild).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass


def all_reduce_bytes(payload: int, world_size: int) -> int:
    """Bytes one rank sends in a ring all-reduce of ``payload`` bytes."""
    if world_size < 2:
        return 0
    return 2 * (world_size - 1) * payload // world_size


def all_gather_bytes(part: int, world_size: int) -> int:
    """Bytes one rank sends in a ring all-gather where every rank contributes ``part`` bytes."""
    return (world_size - 1) * part if world_size > 1 else 0


@dataclass
class CommCounter:
    """A rank's running totals since it started; the trainer logs their differences."""

    bytes_sent: int = 0
    wait_s: float = 0.0
    collectives: int = 0

    def all_reduce(self, payload: int, world_size: int) -> None:
        self.bytes_sent += all_reduce_bytes(payload, world_size)
        self.collectives += world_size > 1

    def sent(self, nbytes: int, world_size: int) -> None:
        """A collective that sent ``nbytes`` from this rank, as whatever carried it counts them
        (an opt-in transport's all-reduce)."""
        self.bytes_sent += nbytes
        self.collectives += world_size > 1

    def all_gather(self, part: int, world_size: int) -> None:
        self.bytes_sent += all_gather_bytes(part, world_size)
        self.collectives += world_size > 1

    def broadcast(self, payload: int, world_size: int) -> None:
        self.bytes_sent += payload if world_size > 1 else 0  # every rank forwards it
        self.collectives += world_size > 1

    def waited(self, seconds: float) -> None:
        self.wait_s += max(0.0, seconds)

    @contextmanager
    def waiting(self) -> Iterator[None]:
        """Count the block's duration as time waiting on communication."""
        started = time.perf_counter()
        try:
            yield
        finally:
            self.wait_s += time.perf_counter() - started

    def totals(self) -> tuple[int, float]:
        return self.bytes_sent, self.wait_s
