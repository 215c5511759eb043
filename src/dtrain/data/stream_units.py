"""Pure functions of a stream's position: which source shard each rank reads, from which item
(the queue of units: docs/data.md, "Streams").

Unit ``u`` is pass ``u // K`` over one of ``K`` source shards (:meth:`UnitMap.locate`). The
position is one number per unit *in flight*, never one per rank:

* ``next_unit``: the first unit of the queue no reader has been given; every unit below it is
  either finished or in ``open``;
* ``open``: unit -> items delivered, for the units given out and not finished;
* ``owner``: unit -> the reader that holds it, meaningful at ``readers`` readers only.

Every rank takes the same decision from the same reports (:meth:`UnitState.merge`); at another
number of readers the open units are dealt out again (:meth:`UnitState.deal`), so every unit's
items are delivered once, in their order.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

import numpy as np

ID_BITS = 32  # an item's sample id: its unit << ID_BITS | its index in the unit's shard


def sample_id(unit: int, index: int) -> int:
    """The id of item ``index`` of unit ``unit`` in the audit and the plan: unique per delivery
    (the same item read in another pass has another unit)."""
    return (unit << ID_BITS) | index


@lru_cache(maxsize=8)
def _pass_order(num_shards: int, seed: int, shuffled: bool, epoch: int) -> tuple[int, ...]:
    if not shuffled:
        return tuple(range(num_shards))
    rng = np.random.default_rng([seed, epoch, 0x5EED5])
    return tuple(int(i) for i in rng.permutation(num_shards))


@dataclass(frozen=True)
class UnitMap:
    """Unit -> (pass, source shard)."""

    num_shards: int
    seed: int
    shuffled: bool  # each pass's shard order permuted by (seed, pass)

    def locate(self, unit: int) -> tuple[int, int]:
        epoch, slot = divmod(unit, self.num_shards)
        return epoch, _pass_order(self.num_shards, self.seed, self.shuffled, epoch)[slot]


@dataclass
class UnitState:
    """Where every unit stands; the same on every rank (see the module's docstring)."""

    next_unit: int = 0
    open: dict[int, int] = field(default_factory=dict)  # unit -> items delivered
    owner: dict[int, int] = field(default_factory=dict)  # unit -> reader
    readers: int = 1  # what ``owner`` counts in

    def owned(self, reader: int) -> list[int]:
        """``reader``'s units, ascending (the order it reads them in)."""
        return sorted(u for u, r in self.owner.items() if r == reader)

    def deal(self, readers: int) -> None:
        """The open units dealt to ``readers`` readers in turn, when they are not already
        theirs: after a change of the world size (or of the way the stream is read)."""
        if readers == self.readers and set(self.owner) == set(self.open):
            return
        self.owner = {u: i % readers for i, u in enumerate(sorted(self.open))}
        self.readers = readers

    def merge(self, reports: Iterable[Mapping[str, Any]]) -> list[int]:
        """Apply every reader's report (:meth:`UnitReader.report`): units delivered to a
        position, units finished; then give each reader that is short the next unit of the
        queue, in reader order. Returns the readers that were short. Equal reports of one
        reader count once (the ranks of a pipeline's stages read the same)."""
        short: set[int] = set()
        for report in reports:
            for unit, position in report["open"]:
                if int(unit) in self.open:
                    self.open[int(unit)] = int(position)
            for unit in report["done"]:
                self.open.pop(int(unit), None)
                self.owner.pop(int(unit), None)
            if report["short"]:
                short.add(int(report["reader"]))
        for reader in sorted(short):
            self.open[self.next_unit] = 0
            self.owner[self.next_unit] = reader
            self.next_unit += 1
        return sorted(short)

    def finished(self) -> int:
        """Units finished so far."""
        return self.next_unit - len(self.open)

    def to_plain(self) -> dict[str, Any]:
        return {
            "next_unit": self.next_unit,
            "open": [[u, p, self.owner.get(u, -1)] for u, p in sorted(self.open.items())],
            "readers": self.readers,
        }

    @classmethod
    def from_plain(cls, state: Mapping[str, Any]) -> UnitState:
        opened = [(int(u), int(p), int(r)) for u, p, r in state["open"]]
        return cls(
            next_unit=int(state["next_unit"]),
            open={u: p for u, p, _ in opened},
            owner={u: r for u, _, r in opened if r >= 0},
            readers=int(state["readers"]),
        )
