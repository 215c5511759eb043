"""Reading run folders: ``metrics.jsonl`` (whole, or only its tail) and ``config.toml``.

A crashed run must still be reportable: a line it was writing when it died is cut off (and a
later attempt may have appended after it). Such a line is skipped and said so, never fatal.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dtrain.errors import UserError

Record = dict[str, Any]
METRICS_FILE = "metrics.jsonl"
CONFIG_FILE = "config.toml"


@dataclass
class Run:
    """One run folder's records, in file order."""

    path: Path
    label: str
    records: list[Record]
    config_text: str = ""
    skipped: list[str] = field(default_factory=list)  # lines skipped, in words

    def of(self, kind: str) -> list[Record]:
        return [r for r in self.records if r.get("kind") == kind]

    def events(self, *names: str) -> list[Record]:
        return [r for r in self.of("event") if r.get("name") in names]

    def last(self, kind: str, *names: str) -> Record | None:
        """The newest record of ``kind`` (of an event: named one of ``names``)."""
        found = self.events(*names) if names else self.of(kind)
        return found[-1] if found else None

    @property
    def item_name(self) -> str:
        """The task's items (``tokens``, ``samples``), from the newest start record, else
        from the train records' ``<items>_per_s`` field."""
        for record in reversed(self.of("start")):
            if record.get("item_name"):
                return str(record["item_name"])
        for record in self.of("train"):
            for key in record:
                if key.endswith("_per_s") and key != "samples_per_s":
                    return key[: -len("_per_s")]
        return "samples"

    @property
    def first_time(self) -> float | None:
        times = [r["time"] for r in self.records if isinstance(r.get("time"), (int, float))]
        return min(times) if times else None


def val_metrics(record: Record) -> dict[str, Any]:
    """The task's metrics (``Task.metrics``) of an eval record: its numeric ``val_<name>``
    fields other than the loss and the item count, by name."""
    return {
        key[len("val_") :]: value
        for key, value in record.items()
        if key.startswith("val_")
        and key not in ("val_loss", "val_items")
        and isinstance(value, (int, float))
    }


def check_run_folder(run_dir: Path) -> None:
    if not run_dir.exists():
        raise UserError(f"run folder {run_dir} does not exist")
    if not run_dir.is_dir():
        raise UserError(f"{run_dir} is not a folder; give a run folder (run.dir)")


def parse_lines(lines: list[bytes], where: str) -> tuple[list[Record], list[str]]:
    """Records of JSON lines, and what was skipped: a cut-off last line (the run stopped while
    writing it) or a line that is not a JSON object."""
    records: list[Record] = []
    skipped: list[str] = []
    for number, raw in enumerate(lines, 1):
        text = raw.strip()
        if not text:
            continue
        try:
            record = json.loads(text)
        except ValueError:
            record = None
        if isinstance(record, dict):
            wrong = malformed_field(record)
            if wrong is None:
                records.append(record)
            else:
                skipped.append(f"{where}: line {number} has {wrong}; skipped it")
            continue
        if number == len(lines) and not raw.endswith(b"\n"):
            skipped.append(
                f"{where}: the last line ({number}) is cut off after {len(raw)} bytes (the run "
                "stopped while writing it); skipped it"
            )
        else:
            skipped.append(f"{where}: line {number} is not a JSON record; skipped it")
    return records, skipped


def malformed_field(record: Record) -> str | None:
    """What makes a JSON object no metrics record (a hand-edited line): the fields every
    reader relies on -- ``kind`` text, ``step`` a whole number, ``time`` a number -- of
    another type. None: it is one."""
    checks = (("kind", (str,)), ("step", (int,)), ("time", (int, float)))
    for key, types in checks:
        value = record.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, types)):
            return f"{key} = {value!r}, not {'text' if types == (str,) else 'a number'}"
    return None


def read_metrics(path: Path) -> tuple[list[Record], list[str]]:
    """Every record of a metrics file, and what was skipped (see :func:`parse_lines`)."""
    return parse_lines(path.read_bytes().splitlines(keepends=True), str(path))


def read_tail(path: Path, max_bytes: int = 1 << 20) -> list[Record]:
    """The records in the last ``max_bytes`` of a metrics file, without reading it whole (a
    long run's file is large); a cut-off line is left out."""
    with path.open("rb") as fh:
        start = max(0, fh.seek(0, os.SEEK_END) - max_bytes)
        fh.seek(start)
        data = fh.read()
    lines = data.splitlines(keepends=True)
    if start > 0 and lines:
        lines = lines[1:]  # begins inside a line
    records, _ = parse_lines(lines, str(path))
    return records


def read_run(run_dir: Path, label: str = "") -> Run:
    """A run folder's records; a folder that is not a run, or holds no metrics, is a user
    error naming it."""
    check_run_folder(run_dir)
    path = run_dir / METRICS_FILE
    if not path.exists():
        raise UserError(
            f"{run_dir} has no {METRICS_FILE}: not a run folder, or its run has not started "
            "training yet"
        )
    records, skipped = read_metrics(path)
    if not records:
        why = f" ({skipped[0]})" if skipped else ""
        raise UserError(f"{path} holds no metrics records{why}")
    config = run_dir / CONFIG_FILE
    text = config.read_text(errors="replace") if config.exists() else ""
    return Run(run_dir, label or run_dir.name, records, text, skipped)


def read_runs(run_dirs: list[Path]) -> list[Run]:
    """Several run folders, labelled by their folder names (with their parents' names where
    two share a name)."""
    full = [Path(os.path.abspath(d)) for d in run_dirs]
    names = [f.name for f in full]
    labels = [f"{f.parent.name}/{f.name}" if names.count(f.name) > 1 else f.name for f in full]
    if len(set(labels)) < len(labels):
        labels = [f"{label} ({i + 1})" for i, label in enumerate(labels)]
    return [read_run(d, label) for d, label in zip(run_dirs, labels)]
