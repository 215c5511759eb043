"""MLflow (``metrics.trackers = ["mlflow"]``, the ``mlflow`` extra): one MLflow run per dtrain
run (what goes where, and MLflow's environment variables: docs/observability.md).

Through ``MlflowClient`` with an explicit run id, never MLflow's process-global active run (a
user's own code in the same process may hold one). Its calls are synchronous, so they are made
in a process of its own (:mod:`~dtrain.metrics.trackers.sender`), one ``log_batch`` per
interval. Its context tags (user, source, git commit) are added as ``mlflow.start_run`` adds
them.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

from dtrain.metrics.trackers.rows import Final, Row, Setup

# MLflow's limits per log_batch call.
MAX_METRICS, MAX_PARAMS = 1000, 100


class MlflowTracker:
    name = "mlflow"

    def __init__(self, setup: Setup) -> None:
        self.setup = setup
        self.client: Any = None
        self.run_id = ""
        uri = setup.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI") or "(default)"
        self.where = f"tracking URI {uri}"

    def start(self, stored: dict[str, Any] | None) -> dict[str, Any]:
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient
        from mlflow.tracking.context.registry import resolve_tags

        setup = self.setup
        uri = setup.tracking_uri or (stored or {}).get("tracking_uri") or None
        # Its store's set-up lines ("Creating initial MLflow database tables...") would cut
        # into the progress line; its warnings still show.
        logging.getLogger("mlflow.store.db.utils").setLevel(logging.WARNING)
        logging.getLogger("alembic").setLevel(logging.WARNING)
        self.client = MlflowClient(tracking_uri=uri)
        run_id = (stored or {}).get("run_id") or os.environ.get("MLFLOW_RUN_ID")
        if run_id:
            self.run_id = str(run_id)
            self.client.update_run(self.run_id, status="RUNNING")
        else:
            tags = resolve_tags({**_tags(setup.tags), "dtrain.run_dir": str(setup.folder)})
            run = self.client.create_run(self._experiment_id(), run_name=setup.name, tags=tags)
            self.run_id = run.info.run_id
            # Parameters are write-once in MLflow: logged when the run is made, never again (a
            # resumed run's config may differ in keys resuming allows to change).
            params = [Param(k, str(v)) for k, v in sorted(setup.params.items())]
            for i in range(0, len(params), MAX_PARAMS):
                self.client.log_batch(self.run_id, params=params[i : i + MAX_PARAMS])
        self.where = f"run {self.run_id} at {self.client.tracking_uri}"
        return {
            "run_id": self.run_id,
            "tracking_uri": self.client.tracking_uri,
            "experiment_id": self.client.get_run(self.run_id).info.experiment_id,
        }

    def _experiment_id(self) -> str:
        name = self.setup.project or os.environ.get("MLFLOW_EXPERIMENT_NAME")
        if not name:
            return os.environ.get("MLFLOW_EXPERIMENT_ID") or "0"  # MLflow's Default
        found = self.client.get_experiment_by_name(name)
        return str(found.experiment_id if found else self.client.create_experiment(name))

    def log(self, rows: list[Row]) -> None:
        from mlflow.entities import Metric

        metrics = [
            Metric(key, value, int(row.time * 1000), row.step)
            for row in rows
            for key, value in row.values.items()
        ]
        for i in range(0, len(metrics), MAX_METRICS):
            self.client.log_batch(self.run_id, metrics=metrics[i : i + MAX_METRICS])

    def finish(self, final: Final) -> None:
        from mlflow.entities import RunTag

        tags = [RunTag(f"dtrain.summary.{k}", str(v)) for k, v in final.summary.items()]
        if final.state:
            tags.append(RunTag("dtrain.state", final.state))
        if final.checkpoint:
            # The path, not the bytes: a checkpoint can be many GB, and the run folder keeps it.
            tags.append(RunTag("dtrain.checkpoint", final.checkpoint))
        if tags:
            self.client.log_batch(self.run_id, tags=tags)
        # A preempted run is to be resumed: KILLED until then (resuming sets RUNNING again);
        # one whose training process died before closing its sinks ("failed"): FAILED.
        status = {"preempted": "KILLED", "failed": "FAILED"}.get(final.state, "FINISHED")
        self.client.set_terminated(self.run_id, status, end_time=int(time.time() * 1000))


def _tags(tags: tuple[str, ...]) -> dict[str, str]:
    """``metrics.tags`` as MLflow's key-value tags: ``key=value``, or ``name`` with an empty
    value."""
    pairs = (tag.partition("=") for tag in tags)
    return {key.strip(): value.strip() for key, _, value in pairs}
