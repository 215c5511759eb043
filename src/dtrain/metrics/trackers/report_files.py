"""``dtrain report RUN_DIR --to-trackers``: the report's plots and page as an artifact of the
tracker runs the run logged to (``RUN_DIR/trackers.json``), after training, from the machine that
makes the report. The trackers' environment variables work as during training (W&B's mode: the
run's own, offline where it trained offline, unless ``WANDB_MODE`` says otherwise)."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from dtrain.errors import UserError
from dtrain.metrics.trackers import check_available
from dtrain.metrics.trackers.rows import first_line
from dtrain.metrics.trackers.sink import RUN_IDS, read_run_ids

ARTIFACT_FOLDER = "report"  # MLflow's artifact path; W&B's artifact type


def send_report(run_dir: Path, files: list[Path]) -> tuple[list[str], list[str]]:
    """``files`` to each tracker run of ``run_dir``: (what was sent where, what failed), a line
    each. A run that logged to no tracker is a user error."""
    ids = read_run_ids(run_dir)
    if not ids:
        raise UserError(
            f"--to-trackers: {run_dir} has no {RUN_IDS}: its run logged to no tracker "
            "(metrics.trackers)"
        )
    check_available([name for name in ids if name in SENDERS])
    sent, failed = [], []
    for name, stored in sorted(ids.items()):
        if name not in SENDERS:
            continue
        try:
            where = SENDERS[name](run_dir, stored, files)
            sent.append(f"sent the report ({len(files)} files) to {name} {where}")
        except Exception as exc:  # the tracker's own failure: said, and the others still get it
            failed.append(f"could not send the report to {name}: {type(exc).__name__}: "
                          f"{first_line(exc)}")  # fmt: skip
    return sent, failed


def _to_mlflow(run_dir: Path, stored: dict[str, Any], files: list[Path]) -> str:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=stored.get("tracking_uri") or None)
    run_id = str(stored["run_id"])
    for path in files:
        client.log_artifact(run_id, str(path), artifact_path=ARTIFACT_FOLDER)
    return f"run {run_id}, artifacts {ARTIFACT_FOLDER}/"


def _to_wandb(run_dir: Path, stored: dict[str, Any], files: list[Path]) -> str:
    import wandb

    offline = stored.get("mode") == "offline" and "WANDB_MODE" not in os.environ
    run = wandb.init(
        id=str(stored["id"]),
        project=stored.get("project") or None,
        resume="allow",
        dir=os.environ.get("WANDB_DIR") or str(run_dir),
        mode="offline" if offline else None,
        settings=wandb.Settings(console="off", silent=True),
    )
    try:
        artifact = wandb.Artifact(f"{run.id}-{ARTIFACT_FOLDER}", type=ARTIFACT_FOLDER)
        for path in files:
            artifact.add_file(str(path))
        run.log_artifact(artifact)
    finally:
        run.finish()
    return f"run {run.id}, artifact {artifact.name}"


SENDERS: dict[str, Callable[[Path, dict[str, Any], list[Path]], str]] = {
    "mlflow": _to_mlflow,
    "wandb": _to_wandb,
}
