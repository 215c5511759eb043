"""Exactly-once audit of the samples a run trained on.

With ``fault.audit_sample_ids = true`` every rank appends, after every step, a JSON line with
the step, the stream positions it covered and this rank's sample ids to
``RUN_DIR/sample_ids/rankNNNNN.jsonl``. Restarts and rollbacks re-run steps and append again;
the final trajectory keeps, per rank, the last record of each step. :func:`check_stream` then
verifies that trajectory against the stream's rules, without needing the order itself: the
positions are contiguous (apart from ranges skipped on purpose), and each epoch's window of
positions holds every sample id exactly once.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class StepRecord:
    step: int
    start: int
    end: int
    ids: list[int] = field(default_factory=list)  # all ranks together, sorted


def read_trajectory(run_dir: Path) -> dict[int, StepRecord]:
    """step -> what the final trajectory delivered at that step (all ranks)."""
    folder = Path(run_dir) / "sample_ids"
    steps: dict[int, StepRecord] = {}
    for path in sorted(folder.glob("rank*.jsonl")):
        last: dict[int, dict[str, object]] = {}
        for line in path.read_text().splitlines():
            if line.strip():
                record = json.loads(line)
                last[int(record["step"])] = record
        for step, record in last.items():
            entry = steps.setdefault(
                step,
                StepRecord(step, int(record["start"]), int(record["end"])),  # type: ignore[call-overload]
            )
            if (entry.start, entry.end) != (record["start"], record["end"]):
                raise ValueError(
                    f"ranks disagree on step {step}: {path.name} has positions "
                    f"{record['start']}-{record['end']}, another rank "
                    f"{entry.start}-{entry.end}"
                )
            entry.ids.extend(record["ids"])  # type: ignore[arg-type]
    for entry in steps.values():
        entry.ids.sort()
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
