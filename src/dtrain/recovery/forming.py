"""A generation the in-place coordinator decided, written to the store over one poll or
several: ``PROOFS`` of its members' proofs a poll (:mod:`dtrain.recovery.membership`'s
``member/<id>/gen``), its record with the last of them, then its number, ``stopped`` where it
is the last, and the news that wakes the waiting members. Written all in one poll, the 4,096
proofs of a regroup at 4,096 members took 25-35 ms of it, and the store's other callers
waited behind the one ``multi_set``."""

from __future__ import annotations

from typing import Any

from dtrain.recovery.changes import PROOFS
from dtrain.recovery.membership import (
    Generation,
    announce,
    proof,
    spans_of,
    write_value,
    write_values,
)


class Forming:
    """Generation ``generation`` being written; ``nonces``: the incarnation of each member."""

    def __init__(self, store: Any, generation: Generation, nonces: dict[int, str]) -> None:
        self.store = store
        self.generation = generation
        self.nonces = nonces
        self.written = 0  # members whose proofs are written

    def write(self) -> bool:
        """The next ``PROOFS`` proofs (one call); with the last of them the record, so that a
        member that reads the number finds both. Whether the generation is now written whole.
        A member of the generation before whose proof is overwritten meanwhile waits for this
        one's news. (Built a batch at a time, as text: a thousand dicts held until one write
        made the garbage collector sweep the launcher's whole heap inside a poll.)"""
        gen = self.generation
        batch = gen.members[self.written : self.written + PROOFS]
        self.written += len(batch)
        values: dict[str, Any] = {
            f"member/{m}/gen": proof(gen.number, self.nonces[m]) for m in batch
        }
        last = self.written == len(gen.members)
        if last:
            values[f"gen/{gen.number}"] = {
                "spans": spans_of(gen.members),
                "left": list(gen.left),
                "joined": list(gen.joined),
                "asked_at": gen.asked_at,
                "stop": gen.stop,
            }
        write_values(self.store, values)
        if not last:
            return False
        write_value(self.store, "gen/latest", str(gen.number))
        if gen.stop:  # after the generation: a member of it must see the generation first
            write_value(self.store, "stopped", gen.stop)
        announce(self.store)  # the members waiting for a generation wake
        return True
