"""The run folder's error log: the full traceback of every failure of a rank, one file per rank
(``RUN_DIR/logs/rankN.log``), appended attempt after attempt. The terminal gets one line per
failed rank that names this file (:mod:`dtrain.worker`), instead of the tracebacks of every
rank of every restart; and the worker's error file, where the launcher reads its failure."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import time
import traceback
from pathlib import Path

LOGS_DIR = "logs"


def record_error(message: str) -> None:
    """Leave ``message`` where the launcher (torch's agent, or dtrain's supervising in-place
    workers) reads a worker's failure: its error file. Never raises."""
    if error_file := os.environ.get("TORCHELASTIC_ERROR_FILE"):
        with contextlib.suppress(OSError), open(error_file, "w") as fh:
            json.dump({"message": message, "timestamp": int(time.time())}, fh)


def append_traceback(run_dir: str | Path, rank: int, error: BaseException) -> Path | None:
    """Append ``error``'s traceback (and those it was raised from) to this rank's log, under a
    header naming the attempt, host, pid and time; None when the log cannot be written."""
    path = Path(run_dir) / LOGS_DIR / f"rank{rank}.log"
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    header = (
        f"--- rank {rank}, attempt {attempt}, host {socket.gethostname()}, pid {os.getpid()}, "
        f"{time.strftime('%Y-%m-%d %H:%M:%S')} ---\n"
    )
    text = header + "".join(traceback.format_exception(error)) + "\n"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a") as fh:
            fh.write(text)
    except OSError:
        return None
    return path
