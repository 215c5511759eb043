"""Per-rank batches from a stream (an ``IterableDataset``, a Hugging Face streaming dataset, a
stream of dtrain's protocol), with the position of every source shard checkpointed (how a step
is formed and what each kind guarantees: docs/data.md, "Streams").

A step is cut across ranks and micro-steps by the map-style rule
(:func:`dtrain.data.partition.step_shape`); which items form it depends on the world size
(:mod:`dtrain.data.stream_units`). ``own`` shards (at least as many source shards as ranks):
each rank reads its own units, and after every step the ranks all-gather their units'
positions, so any rank's ``state_dict`` is the run's. ``dealt`` (fewer shards than ranks, or an
unsharded stream): every rank reads every item in order and keeps its part; nothing is
exchanged. Steps are read in the training thread (``data.prefetch`` does not apply).
"""

from __future__ import annotations

import collections
import itertools
from collections.abc import Callable, Iterator
from dataclasses import KW_ONLY, dataclass, field
from typing import Any

import numpy as np

from dtrain.data.loader import StepBatch, StepCut
from dtrain.data.partition import StepPlan, step_shape
from dtrain.data.stream_source import StreamSource
from dtrain.data.stream_units import UnitMap, UnitState, sample_id
from dtrain.errors import DataError

Exchange = Callable[[Any], list[Any]]  # collective: every rank's value, in rank order


class UnitReader:
    """One reader's units (those :class:`UnitState` says it owns), read ahead into a buffer of
    ``(sample id, item)``; what it delivered since the last :meth:`report`."""

    def __init__(self, source: StreamSource, units: UnitMap, state: UnitState, reader: int) -> None:
        self.source, self.units, self.state, self.reader = source, units, state, reader
        self._reading: dict[int, tuple[Iterator[Any], int]] = {}  # unit -> (items, next index)
        self._length: dict[int, int] = {}  # units read to their end -> their item count
        self._buffer: collections.deque[tuple[int, int, Any]] = collections.deque()
        self._delivered: dict[int, int] = {}  # since the last report: unit -> position
        self._done: list[int] = []

    def fill(self, count: int) -> bool:
        """Read ahead until ``count`` items wait; whether this reader ran short (its units
        are all read to their end)."""
        while len(self._buffer) < count:
            # Units finished since the last report are still the state's until it is merged.
            unread = [
                u
                for u in self.state.owned(self.reader)
                if u not in self._length and u not in self._done
            ]
            if not unread:
                return True
            unit = unread[0]
            if unit not in self._reading:
                start = self.state.open[unit]  # delivered: read again from there
                epoch, shard = self.units.locate(unit)
                self._reading[unit] = (self.source.read(shard, start, epoch), start)
            items, index = self._reading[unit]
            wanted = count - len(self._buffer)
            for item in itertools.islice(items, wanted):
                self._buffer.append((unit, index, item))
                index += 1
            self._reading[unit] = (items, index)
            if len(self._buffer) < count:  # the unit ended before the buffer was full
                del self._reading[unit]
                self._length[unit] = index
                # Nothing of it waits in the buffer: delivered up to here (since the last
                # report, or before it).
                if self._delivered.get(unit, self.state.open[unit]) == index:
                    self._finish(unit)
        return False

    def deliver(self, count: int) -> tuple[list[Any], list[int]]:
        """The next ``count`` items (:meth:`fill` read them) and their sample ids."""
        items, ids = [], []
        for _ in range(count):
            unit, index, item = self._buffer.popleft()
            items.append(item)
            ids.append(sample_id(unit, index))
            self._delivered[unit] = index + 1
            if self._length.get(unit) == index + 1:
                self._finish(unit)
        return items, ids

    def _finish(self, unit: int) -> None:
        self._done.append(unit)
        self._length.pop(unit, None)
        self._delivered.pop(unit, None)

    def report(self, short: bool) -> dict[str, Any]:
        out = {
            "reader": self.reader,
            "open": [[u, p] for u, p in self._delivered.items()],
            "done": list(self._done),
            "short": short,
        }
        self._delivered, self._done = {}, []
        return out


@dataclass(eq=False, repr=False)
class StreamLoader(StepCut):
    """Endless iterator of :class:`StepBatch` for one data-parallel rank, from a stream."""

    source: StreamSource
    _: KW_ONLY
    seed: int
    shuffle: str  # data.shuffle: other than "none", each pass's shard order is seeded
    exchange: Exchange
    units: UnitState = field(default_factory=UnitState, init=False)
    _reader: UnitReader | None = field(default=None, init=False)
    _ready: bool = field(default=False, init=False)  # every reader holds a step read ahead

    def __post_init__(self) -> None:
        self.check_cut()
        self.unit_map = UnitMap(self.source.num_shards, self.seed, self.shuffle != "none")

    @property
    def dealt(self) -> bool:
        """Every rank reads every item (fewer source shards than ranks)."""
        return self.source.num_shards < self.world_size

    def notice(self) -> str:
        """The start-up line: how this stream is read and what it guarantees."""
        k, w = self.source.num_shards, self.world_size
        what = {
            "protocol": f"a stream of {k} source shard(s) (num_shards, read_shard)",
            "datasets": f"a Hugging Face streaming dataset of {k} source shard(s)",
            "iterable": "an unsharded iterable dataset",
        }[self.source.kind]
        if not self.dealt:
            how = (
                f"each of the {w} ranks reads its own shards and every shard's position is "
                "checkpointed: each item once per pass, resumable at any world size"
            )
        else:
            how = (
                f"fewer shards than the {w} ranks: every rank reads every item and keeps its "
                "part of each batch; resume re-reads up to the position: each item once per "
                "pass, resumable at any world size"
            )
        if self.source.kind == "iterable":
            how += (
                ", provided every pass yields the same items in the same order (implement "
                "num_shards and read_shard(index, start) to read shards per rank)"
            )
        order = (
            "shards in stored order"
            if self.shuffle == "none"
            else "each pass's shard order seeded by run.seed, a shard's items in stored order"
        )
        return f"data: {what}: {how}; {order}"

    # -- position ------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The position of every unit in flight, and what identifies the stream. Plain data,
        the same on every rank; nothing per rank."""
        return {
            "kind": "stream",
            "consumed": self.consumed,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "num_shards": self.source.num_shards,
            "fingerprint": self.source.fingerprint,
            "skipped": [list(r) for r in sorted(self.skipped.items())],
            **self.units.to_plain(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("kind") != "stream":
            raise DataError(
                "cannot resume the data position: the checkpoint trained on a map-style "
                "dataset and this run's train_data is a stream; use the same data or start "
                "a new run"
            )
        checks = [
            ("seed", "run.seed", self.seed),
            ("num_shards", "the number of source shards", self.source.num_shards),
            ("fingerprint", "the stream (fingerprint)", self.source.fingerprint),
            ("shuffle", "data.shuffle", self.shuffle),
        ]
        self.check_same_stream(state, checks)
        self.consumed = int(state["consumed"])
        self.skipped = {int(a): int(b) for a, b in state.get("skipped", [])}
        self.units = UnitState.from_plain(state)
        self.reset()

    def reshared(self) -> None:
        self._ready = False  # the shares read ahead for are not the next step's

    def epoch(self) -> float:
        """Passes over the source shards finished, counted in shards."""
        return self.units.finished() / self.source.num_shards

    # -- iteration -----------------------------------------------------------------------

    def __next__(self) -> StepBatch:
        while self.consumed in self.skipped:
            end = self.skipped[self.consumed]
            while self.consumed < end:
                self._step()  # read and dropped, on every rank alike
        return self._step()

    def reset(self) -> None:
        self._reader = None

    def _step(self) -> StepBatch:
        shape = step_shape(
            self.global_batch_size,
            self.world_size,
            self.micro_batches,
            self.weights,
            self.max_micro_batch,
        )
        sizes = shape[self.rank]
        # Dealt: every rank runs the one reader alike and keeps its slice; no exchange.
        need = self.global_batch_size if self.dealt else sum(sizes)
        if self._reader is None:
            reader, readers = (0, 1) if self.dealt else (self.rank, self.world_size)
            self.units.deal(readers)
            self._reader = UnitReader(self.source, self.unit_map, self.units, reader)
            self._ready = False
        if not self._ready:  # after a start, a resume or new shares
            self._agree(need)
        items, ids = self._reader.deliver(need)
        if self.dealt:
            first = sum(sum(s) for s in shape[: self.rank])
            items, ids = items[first : first + sum(sizes)], ids[first : first + sum(sizes)]
        # The delivery reported (every rank then holds the position after this step) and the
        # next step's items read ahead, at this step's shares.
        self._agree(need)
        self._ready = True
        micro, mine, at = [], [], 0
        for size in sizes:
            micro.append(self.pinned(self.collate_fn(items[at : at + size])))
            mine.append(np.asarray(ids[at : at + size], dtype=np.int64))
            at += size
        start = self.consumed
        self.consumed += self.global_batch_size
        # A stream's plan knows this rank's ids only: the others' are read elsewhere.
        ranks_ids = [mine if r == self.rank else [] for r in range(self.world_size)]
        return StepBatch(StepPlan(start, self.consumed, ids=ranks_ids), micro, self.rank)

    def _agree(self, need: int) -> None:
        """Rounds of read-ahead and exchange until every reader holds ``need`` items: each
        round, a reader that ran short gets the next unit of the queue (the same decision on
        every rank, from the same reports). Collective in ``own`` mode."""
        assert self._reader is not None
        exchange = (lambda value: [value]) if self.dealt else self.exchange
        limit = 2 * (self.source.num_shards + self.world_size)
        for _ in range(limit):
            short = self._reader.fill(need)
            if not self.units.merge(exchange(self._reader.report(short))):
                return
        raise DataError(
            f"the training stream gave no item in {limit} source shards in a row: it is "
            "empty (or its read_shard yields nothing)"
        )
