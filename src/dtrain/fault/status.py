"""``RUN_DIR/status.json``: what state a run is in, written by rank 0 and read by the launcher
(and by anyone watching the run folder).

``state`` is ``running`` while training, ``completed`` at the end, ``preempted`` when a
signal stopped the run after it saved (``signal`` names it), or ``stopped`` when a failure
left fewer workers than ``fault.min_replicas`` and they saved (``signal`` says so), or
``failed`` when the launcher gave up on the job (its restarts spent: written by the launcher,
at the furthest step a rank was in: where it failed); ``step`` is the step it was at.
The file is replaced atomically, so a reader never sees half of it.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from dtrain.console import say_line
from dtrain.fsutil import write_atomic

STATUS_FILE = "status.json"


@dataclass(frozen=True)
class RunStatus:
    state: str  # running | completed | preempted | stopped | failed
    step: int
    # The signal that preempted the run, or "a peer's signal"; why it stopped (stopped).
    signal: str = ""


def write_status(run_dir: Path, status: RunStatus) -> None:
    """Replace the status; a disk that cannot take it (full, gone away) is a warning, never the
    end of a run (the launcher then cannot tell a preempted run that saved, and says so)."""
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        write_atomic(run_dir / STATUS_FILE, json.dumps(asdict(status)))
    except OSError as exc:
        say_line(
            f"dtrain: warning: cannot write {run_dir / STATUS_FILE} ({exc.strerror or exc}); "
            f"the run's state, {status.state} at step {status.step}, is not recorded there"
        )


def read_status(run_dir: Path) -> RunStatus | None:
    """The run's last status, or None when it has written none (or it cannot be read)."""
    try:
        record = json.loads((run_dir / STATUS_FILE).read_text())
        return RunStatus(str(record["state"]), int(record["step"]), str(record.get("signal", "")))
    except (OSError, ValueError, KeyError, TypeError):
        return None
