"""``dtrain status RUN_DIR``: where a run is, read from its folder while it runs (or after).

It reads ``status.json``, the tail of ``metrics.jsonl`` (the last MiB, never the whole file) and
every rank's liveness record (:mod:`dtrain.fault.liveness`), none of which the job waits for;
the total number of steps comes from the run's ``config.toml``. What each column means:
docs/observability.md, "dtrain status".
"""

from __future__ import annotations

import contextlib
import math
import time
from pathlib import Path
from typing import Any

from dtrain.config.load import read_toml
from dtrain.errors import ConfigError, UserError
from dtrain.fault.liveness import LIVENESS_DIR, Liveness, read_run_liveness
from dtrain.fault.status import read_status
from dtrain.fsutil import format_size
from dtrain.metrics.sinks import format_duration, format_rate
from dtrain.report.read import (
    CONFIG_FILE,
    METRICS_FILE,
    Run,
    check_run_folder,
    read_tail,
    val_metrics,
)

# A beat older than this is called stale: the watchdog's thread stamps one several times a
# second (on shared storage, other machines see it every second or so).
STALE_S = 10.0


def _total_steps(run: Run) -> int | None:
    with contextlib.suppress(ConfigError, OSError, ValueError, KeyError, TypeError):
        return int(read_toml(run.path / CONFIG_FILE)["train"]["steps"])
    start = run.last("start")
    return int(start["steps"]) if start else None


def _ago(seconds: float) -> str:
    if seconds < 60:
        return f"{max(0.0, seconds):.1f}s ago"
    return f"{format_duration(seconds)} ago"


def run_status(run_dir: Path, now: float | None = None) -> str:
    """The status, as lines of text; a folder with nothing to read is a user error."""
    now = time.time() if now is None else now
    check_run_folder(run_dir)
    status = read_status(run_dir)
    metrics = run_dir / METRICS_FILE
    run = Run(run_dir, run_dir.name, read_tail(metrics) if metrics.exists() else [])
    beats = read_run_liveness(run_dir)
    if status is None and not run.records and not beats:
        raise UserError(
            f"{run_dir} has no status.json, {METRICS_FILE} or heartbeats ({LIVENESS_DIR}/rankN): "
            "not a run folder, or its run has not started yet"
        )
    total = _total_steps(run)
    train, evaluation, item = run.last("train"), run.last("eval"), run.item_name
    newest_attempt = max((b.attempt for b in beats.values()), default=0)
    current = [b for b in beats.values() if b.attempt == newest_attempt]
    steps = [b.step for b in current]
    if train is not None:
        steps.append(int(train["step"]))
    if status is not None:
        steps.append(status.step)
    step = max(steps) if steps else 0
    state = status.state if status is not None else "unknown (no status.json)"
    lines = []
    head = f"{run_dir}: {state}, step {step}"
    if total:
        head += f"/{total} ({100 * step / total:.1f}%)"
    if state == "running" and train is not None and total:
        per_step = train.get("step_time_s")
        if isinstance(per_step, (int, float)) and per_step > 0:
            head += f", ETA {format_duration((total - step) * per_step)}"
    if status is not None and status.signal:
        head += f" (stopped by {status.signal})"
    lines.append(head)
    if train is not None:
        loss = train.get("loss")
        shown = f"{loss:.4f}" if isinstance(loss, (int, float)) else "n/a (non-finite)"
        text = f"  last loss {shown} at step {train['step']} ({_ago(now - train['time'])})"
        rate = train.get(f"{item}_per_s")
        if isinstance(rate, (int, float)):
            text += f", {format_rate(rate)} {item}/s"
        if isinstance(train.get("step_time_s"), (int, float)):
            text += f", {train['step_time_s'] * 1e3:.0f} ms/step"
        lines.append(text)
    else:
        lines.append("  no train record yet")
    if evaluation is not None and isinstance(evaluation.get("val_loss"), (int, float)):
        shown = "".join(f", {key} {value:.4f}" for key, value in val_metrics(evaluation).items())
        lines.append(f"  val loss {evaluation['val_loss']:.4f}{shown} at step {evaluation['step']}")
    if state == "running" and current and all(now - b.seen_at > STALE_S for b in current):
        newest = min(now - b.seen_at for b in current)
        lines.append(
            f"  no heartbeat for {format_duration(newest)}: the job may have stopped (killed, "
            "or its machine lost) without updating status.json"
        )
    if (change := run.last("event", "membership")) is not None:  # fault.recovery = 'inplace'
        lines.append(
            f"  in place: generation {change['generation']}, {change['world_size']} worker(s) "
            f"(members {change['members']}); at step {change['step']} ({_ago(now - change['time'])}"
            f"): left {change['left']}, joined {change['joined']}, took {change['seconds']:.2f} s"
        )
    lines += _rank_table(beats, newest_attempt, item, now, state == "running")
    return "\n".join(lines)


def _rank_table(
    beats: dict[int, Liveness], attempt: int, item: str, now: float, running: bool
) -> list[str]:
    if not beats:
        return [f"  no liveness records ({LIVENESS_DIR}/rankN): a run from before them"]
    header = ("rank", "host", "pid", "last beat", "step", "phase", "own speed", "step", "memory")
    rows = [header]
    for rank, beat in beats.items():
        age = now - beat.seen_at
        when = _ago(age) + (" (stale)" if running and age > STALE_S else "")
        if beat.attempt != attempt:
            when += f" (attempt {beat.attempt})"
        speed = _number(beat.items_per_s)
        step_s = _number(beat.step_s)
        memory = _number(beat.memory_bytes)
        rows.append(
            (
                str(rank),
                beat.host,
                str(beat.pid),
                when,
                str(beat.step),
                beat.phase,
                f"{format_rate(speed)} {beat.item_name or item}/s" if speed is not None else "-",
                f"{step_s * 1e3:.0f} ms" if step_s is not None else "-",
                format_size(memory) if memory is not None else "-",
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    return ["  " + "  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows]


def _number(value: Any) -> float | None:
    """A finite number, else None."""
    return float(value) if isinstance(value, (int, float)) and math.isfinite(value) else None
