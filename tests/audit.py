"""Reading and checking the sample-id records of ``fault.audit_sample_ids``
(:mod:`dtrain.fault.audit` writes them): the final trajectory keeps, per rank, the last record of
each step; :func:`check_stream` verifies it against the stream's rules, without needing the
order itself: the positions are contiguous (apart from ranges skipped on purpose), and each
epoch's window of positions holds every sample id exactly once."""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dtrain.fault.audit import AUDIT_DIR


@dataclass
class StepRecord:
    step: int
    start: int
    end: int
    ids: list[int] = field(default_factory=list)  # all ranks together, sorted


def read_trajectory(run_dir: Path) -> dict[int, StepRecord]:
    """step -> what the final trajectory delivered at that step (all ranks).

    Each record carries its attempt: ``[start time of the attempt, chosen by rank 0, rollbacks
    so far]``. A step counts in an attempt where some rank committed it (a step dropped in
    flight does not); a step run again (after a restart, at any world size, or after a NaN
    rollback) is taken from its newest such attempt, with the records of every rank of that
    attempt -- so the stale records of a rank that is gone after a world-size change are left
    out, and those of a rank killed after its gradient was summed are kept."""
    folder = Path(run_dir) / AUDIT_DIR
    by_step: dict[int, dict[tuple[int, ...], list[dict[str, Any]]]] = {}
    committed: set[tuple[int, tuple[int, ...]]] = set()
    for path in sorted(folder.glob("rank*.jsonl")):
        for line in path.read_text().splitlines():
            if not line.strip():
                continue
            record = json.loads(line)
            attempt = tuple(int(a) for a in record.get("attempt", [0, 0]))
            if record.get("committed"):
                committed.add((int(record["step"]), attempt))
                continue
            record["_file"] = path.name
            by_step.setdefault(int(record["step"]), {}).setdefault(attempt, []).append(record)
    steps: dict[int, StepRecord] = {}
    for step, attempts in sorted(by_step.items()):
        done = [attempt for attempt in attempts if (step, attempt) in committed]
        if not done:
            continue  # dropped in flight, never trained
        records = attempts[max(done)]
        first = records[0]
        entry = StepRecord(step, int(first["start"]), int(first["end"]))
        seen_files: set[str] = set()
        for record in records:
            if (entry.start, entry.end) != (record["start"], record["end"]):
                raise ValueError(
                    f"ranks disagree on step {step}: {record['_file']} has positions "
                    f"{record['start']}-{record['end']}, another rank {entry.start}-{entry.end}"
                )
            if record["_file"] in seen_files:
                raise ValueError(f"{record['_file']} has step {step} twice in one attempt")
            seen_files.add(record["_file"])
            entry.ids.extend(int(i) for i in record["ids"])
        entry.ids.sort()
        steps[step] = entry
    return steps


@dataclass
class AuditResult:
    steps: int
    positions: int  # stream positions covered
    repeated: int  # deliveries of an id beyond what the covered positions allow
    missing: int  # deliveries an id is owed by the covered positions but did not get
    overlaps: int  # positions covered by two steps
    gaps: list[tuple[int, int]]  # position ranges not covered (skipped on purpose, or lost)

    @property
    def exactly_once(self) -> bool:
        return self.repeated == 0 and self.missing == 0 and self.overlaps == 0


def check_stream(trajectory: dict[int, StepRecord], num_samples: int) -> AuditResult:
    """Check a trajectory against the stream's rule: positions ``0 .. P-1`` visit epoch orders
    back to back, so every id is delivered ``P // N`` or ``P // N + 1`` times (``N`` samples),
    never more, never less, and no position is delivered by two steps."""
    records = sorted(trajectory.values(), key=lambda r: r.start)
    gaps: list[tuple[int, int]] = []
    overlaps = 0
    position = 0
    counts: Counter[int] = Counter()
    for record in records:
        if len(record.ids) != record.end - record.start:
            raise ValueError(
                f"step {record.step} delivered {len(record.ids)} ids for "
                f"{record.end - record.start} positions"
            )
        if record.start > position:
            gaps.append((position, record.start))
        overlaps += max(0, min(position, record.end) - record.start)
        counts.update(record.ids)
        position = max(position, record.end)
    covered = position - sum(b - a for a, b in gaps)
    low = covered // num_samples
    high = low + (1 if covered % num_samples else 0)
    repeated = sum(max(0, c - high) for c in counts.values())
    # With gaps, which ids the skipped positions held is unknown: only repeats are checked.
    missing = 0 if gaps else sum(max(0, low - counts.get(i, 0)) for i in range(num_samples))
    return AuditResult(
        steps=len(records),
        positions=covered,
        repeated=repeated,
        missing=missing,
        overlaps=overlaps,
        gaps=gaps,
    )
