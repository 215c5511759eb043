"""``RUN_DIR/heartbeats/rankN.json``: each rank's last heartbeat, where anyone can read it.

The watchdog's beats live in the job's key-value store (:mod:`dtrain.fault.watchdog`), which a
process outside the job cannot easily reach. So the watchdog's thread (never the training
thread) also writes this rank's beat to a small file every ``fault.heartbeat_s`` seconds (at
most once a second), replaced atomically so a reader never sees half of it; ``dtrain status``
reads them. Not fsynced: it is a live view, and a file lost in a power cut is rewritten by
the next beat.

A beat holds the rank, its host and pid, the step and phase it is in, the wall-clock time of
the beat, the restart attempt and world size it belongs to, and this rank's own speed from its
last step (``step_s``; ``items_per_s``: the items it held over its data + compute time, what
the straggler report compares).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

BEATS_DIR = "heartbeats"


def beat_path(run_dir: Path, rank: int) -> Path:
    return run_dir / BEATS_DIR / f"rank{rank}.json"


def write_beat(run_dir: Path, rank: int, record: dict[str, Any]) -> None:
    path = beat_path(run_dir, rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(record))
    os.replace(tmp, path)


def read_beats(run_dir: Path) -> dict[int, dict[str, Any]]:
    """Every rank's last beat in the run folder, by rank (unreadable files are left out)."""
    out: dict[int, dict[str, Any]] = {}
    folder = run_dir / BEATS_DIR
    if not folder.is_dir():
        return out
    for path in folder.glob("rank*.json"):
        try:
            rank = int(path.stem[len("rank") :])
            record = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(record, dict):
            out[rank] = record
    return dict(sorted(out.items()))
