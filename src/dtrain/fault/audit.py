"""The record of the samples a run trained on, for an exactly-once audit.

With ``fault.audit_sample_ids = true`` one rank of each data-parallel replica, the one that
counts its items (``Strategy.counts_items``), appends to ``RUN_DIR/sample_ids/rankNNNNN.jsonl``
two JSON lines a step: its positions and sample ids once the batch is fetched, before the step's
first collective (:meth:`AuditWriter.record`), and that it committed once the update is applied
(:meth:`AuditWriter.commit`). Which steps count, and the checker (``tests/audit.py``):
docs/fault-tolerance.md, "Auditing exactly-once delivery".
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from pathlib import Path
from typing import IO

import numpy as np
import torch.distributed as dist

from dtrain.comm.plain import broadcast_json

AUDIT_DIR = "sample_ids"


class AuditWriter:
    """This rank's audit file, opened for appending. Each record carries its attempt: an id
    every rank of this attempt shares and that grows from one attempt to the next (rank 0's
    clock, agreed at :meth:`open`), and the rollbacks so far, so that :func:`read_trajectory`
    can tell a re-run step from its first run."""

    def __init__(self, file: IO[str] | None, attempt: int) -> None:
        self._file = file  # None: another rank of this replica records its samples
        self.attempt = attempt

    @classmethod
    def open(cls, run_dir: Path, rank: int, records: bool = True) -> AuditWriter:
        """Collective: every rank opens its writer at the same point; one that does not
        ``records`` (its samples are another rank's record) writes nothing."""
        token = time.time_ns()
        if dist.is_initialized():
            token = broadcast_json(token, src=0)
        if not records:
            return cls(None, int(token))
        folder = Path(run_dir) / AUDIT_DIR
        folder.mkdir(parents=True, exist_ok=True)
        return cls((folder / f"rank{rank:05d}.jsonl").open("a"), int(token))

    def record(
        self,
        step: int,
        start: int,
        end: int,
        ids: Sequence[np.ndarray],
        *,
        rollbacks: int,
    ) -> None:
        """One step: its stream positions ``start .. end-1`` and this rank's sample ids (one
        array per micro-batch)."""
        self._write(
            {
                "step": step,
                "start": start,
                "end": end,
                "attempt": [self.attempt, rollbacks],
                "ids": [int(i) for micro in ids for i in micro],
            }
        )

    def commit(self, step: int, *, rollbacks: int) -> None:
        """Step ``step``'s update is applied on this rank."""
        self._write({"step": step, "attempt": [self.attempt, rollbacks], "committed": True})

    def _write(self, record: dict[str, object]) -> None:
        if self._file is None:
            return
        # Flushed each time: a rank killed outright leaves every line it wrote on record.
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
