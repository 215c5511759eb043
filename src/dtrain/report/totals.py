"""A run's totals, for the report's table: steps, wall time, items, bytes sent, losses,
events."""

from __future__ import annotations

import math
from typing import Any

from dtrain.metrics.sinks import format_duration
from dtrain.report.read import Run, val_metrics


def _last(run: Run, kind: str, field: str) -> Any:
    return next((r[field] for r in reversed(run.of(kind)) if r.get(field) is not None), None)


def comm_bytes(run: Run) -> float | None:
    """Bytes rank 0 sent over the run, attempt by attempt: the count its summary record gives
    (what the console printed at its end), else -- an attempt that ended without one -- the
    per-step figures of its train records (each covering the steps since the one before, or
    since the attempt's start), which leave out what was sent outside the steps (the first
    step's warm-up all-reduce: 3.944 GB against the console's 3.950 for the default job);
    None where the strategy does not count its traffic."""
    attempts: list[list[float | None]] = []  # per attempt: [summed per step, summary's]
    previous: int | None = None
    for record in run.records:
        kind = record.get("kind")
        if kind == "start" or not attempts:
            attempts.append([None, None])
            previous = record.get("step") if kind == "start" else None
        if kind == "train":
            step, per_step = record.get("step"), record.get("comm_bytes_per_step")
            if isinstance(step, int) and isinstance(per_step, (int, float)):
                done = per_step * (step - (previous if previous is not None else 0))
                attempts[-1][0] = (attempts[-1][0] or 0.0) + done
            previous = step if isinstance(step, int) else previous
        elif kind == "summary" and isinstance(record.get("comm_bytes"), (int, float)):
            attempts[-1][1] = float(record["comm_bytes"])
    counts = [summed if said is None else said for summed, said in attempts]
    known = [count for count in counts if count is not None]
    return sum(known) if known else None


def totals(run: Run) -> dict[str, Any]:
    """Plain numbers (None where the run has no record of it)."""
    steps = [r["step"] for r in run.records if isinstance(r.get("step"), int)]
    times = [r["time"] for r in run.records if isinstance(r.get("time"), (int, float))]
    summaries = run.of("summary")
    return {
        "state": summaries[-1].get("state") if summaries else None,
        "steps": max(steps) if steps else None,
        "wall_s": max(times) - min(times) if times else None,
        "items": _last(run, "train", "items_seen"),
        "item_name": run.item_name,
        "comm_bytes": comm_bytes(run),
        "train_loss": _last(run, "train", "loss"),
        "val_loss": _last(run, "eval", "val_loss"),
        "checkpoints": len(run.events("checkpoint")),
        "restarts": len(run.events("restart")),
        "skipped_steps": len(run.events("step_skipped")),
        "rollbacks": len(run.events("rollback")),
        "membership_changes": len(run.events("membership")),
        "stragglers": len([r for r in run.of("straggler") if r.get("state") == "slow"]),
        "val_metrics": val_metrics(run.of("eval")[-1]) if run.of("eval") else {},
    }


def format_totals(values: dict[str, Any]) -> dict[str, str]:
    """The same, as the report's table shows them."""

    def number(value: Any, fmt: str) -> str:
        if value is None or (isinstance(value, float) and not math.isfinite(value)):
            return "-"
        return format(value, fmt)

    wall = values["wall_s"]
    state = values["state"] or "no summary (running, or stopped early)"
    return {
        "state": str(state),
        "steps": number(values["steps"], "d"),
        "wall time": format_duration(wall) if wall is not None else "-",
        f"{values['item_name']} seen": number(values["items"], ","),
        "GB sent (rank 0)": number(
            values["comm_bytes"] / 1e9 if values["comm_bytes"] is not None else None, ".3f"
        ),
        "train loss": number(values["train_loss"], ".4f"),
        "val loss": number(values["val_loss"], ".4f"),
        **{f"val {name}": number(value, ".4f") for name, value in values["val_metrics"].items()},
        "checkpoints": str(values["checkpoints"]),
        "restarts": str(values["restarts"]),
        "skipped steps": str(values["skipped_steps"]),
        "rollbacks": str(values["rollbacks"]),
        "membership changes (in place)": str(values.get("membership_changes", 0)),
        "stragglers named": str(values["stragglers"]),
    }
