"""Weights & Biases (``metrics.trackers = ["wandb"]``, the ``wandb`` extra): one W&B run per
dtrain run (what goes where, and W&B's environment variables: docs/observability.md).

The x-axis of every chart is dtrain's ``step``, a metric of its own (``define_metric``), not
W&B's internal row counter: W&B drops a row whose ``step=`` is below the last one, and a resumed
run logs again the steps after its checkpoint.
"""

from __future__ import annotations

import importlib.util
import os
from typing import Any

from dtrain.metrics.trackers.rows import Final, Row, Setup

STEP = "step"


class WandbTracker:
    name = "wandb"

    def __init__(self, setup: Setup) -> None:
        self.setup = setup
        self.run: Any = None
        self.where = f"project {setup.project or os.environ.get('WANDB_PROJECT') or '(default)'}"

    def start(self, stored: dict[str, Any] | None) -> dict[str, Any]:
        import wandb

        setup = self.setup
        env_tags = [t.strip() for t in os.environ.get("WANDB_TAGS", "").split(",") if t.strip()]
        self.run = wandb.init(
            project=setup.project or None,
            name=os.environ.get("WANDB_NAME") or setup.name,
            id=stored.get("id") if stored else None,
            # "allow": the stored run goes on where it exists (online), else one by its id.
            resume="allow" if stored else None,
            config=setup.params,
            tags=[*env_tags, *setup.tags] or None,
            dir=os.environ.get("WANDB_DIR") or str(setup.run_dir),
            # The worker's stdout is dtrain's progress line; W&B's console capture would copy
            # it, and its banner would interleave with it.
            settings=wandb.Settings(console="off", silent=True),
        )
        self.run.define_metric(STEP)
        for prefix in ("train", "eval", "ranks", "log"):
            self.run.define_metric(f"{prefix}/*", step_metric=STEP)
        if self.run.offline:
            self.where = f"run {self.run.id} offline, in {self.run.settings.sync_dir}"
        else:
            self.where = f"run {self.run.id}, {self.run.url}"
        return {
            "id": self.run.id,
            "project": self.run.project,
            "mode": "offline" if self.run.offline else "online",
        }

    def log(self, rows: list[Row]) -> None:
        for row in rows:
            self.run.log({STEP: row.step, **row.values})

    def finish(self, final: Final) -> None:
        summary: dict[str, Any] = {f"summary/{k}": v for k, v in final.summary.items()}
        if final.state:
            summary["summary/state"] = final.state
        if final.checkpoint:
            summary["checkpoint"] = final.checkpoint
        self.run.summary.update(summary)
        if final.checkpoint:
            self._log_checkpoint(final.checkpoint)
        if final.state == "preempted":
            # To be resumed: W&B shows a preempting run that exits non-zero as preempted.
            self.run.mark_preempting()
            self.run.finish(exit_code=1)
        else:
            self.run.finish(exit_code=0)

    def _log_checkpoint(self, path: str) -> None:
        """The final checkpoint as a reference artifact: its path and digest, not its bytes
        (a checkpoint can be many GB; the run folder keeps it). W&B references a store's
        (``s3://``) through boto3: without it, the summary's ``checkpoint`` alone names it."""
        import wandb

        if "://" in path and importlib.util.find_spec("boto3") is None:
            return
        artifact = wandb.Artifact(f"{self.run.id}-checkpoint", type="model")
        artifact.add_reference(path if "://" in path else f"file://{path}", checksum=False)
        self.run.log_artifact(artifact)
