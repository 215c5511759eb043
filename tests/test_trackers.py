"""Experiment trackers (``metrics.trackers``, dtrain.metrics.trackers): real W&B in offline mode
and real MLflow on a local SQLite store, read back through each library's own formats.

One 2-rank run of 6 steps with both trackers, then its resume to 9 steps, feed most assertions:
the config as parameters, the same losses as ``metrics.jsonl`` at the same steps, the per-rank
records, the same tracker run continued by the resume. A run whose MLflow store cannot be
written trains the same losses with one warning.
"""

from __future__ import annotations

import json
import struct
import sys
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from dtrain.cli import main
from tests.conftest import tiny_raw
from tests.dist_helpers import train_losses
from tests.ranks import run_ranks
from tests.test_cli import write_tiny_config

pytest.importorskip("wandb")
pytest.importorskip("mlflow")
# MLflow's SQL store asks SQLAlchemy for a loader it deprecated: theirs, not ours.
pytestmark = pytest.mark.filterwarnings("ignore:The ``noload`` loader strategy")

JOB = {
    "train": {"steps": 6, "log_every": 1},
    "eval": {"every": 3},
    "checkpoint": {"every": 3},
    "balance": {"every": 3, "window_s": 0},  # per-rank records at steps 3, 6, 9
}


@dataclass
class Tracked:
    run_dir: Path
    wandb_dir: Path
    ids: list[dict[str, Any]]  # RUN_DIR/trackers.json after each of the two runs
    losses: list[float]  # the first run's, from metrics.jsonl


def trackers_env(root: Path) -> dict[str, str]:
    return {"WANDB_MODE": "offline", "WANDB_DIR": str(root / "wandb"), "WANDB_TAGS": "from-env"}


@pytest.fixture(scope="module")
def tracked(tmp_path_factory: pytest.TempPathFactory) -> Tracked:
    root = tmp_path_factory.mktemp("trackers")
    run_dir = root / "run"
    metrics = {
        "trackers": ["wandb", "mlflow"],
        "project": "dtrain-tests",
        "tags": ["suite", "kind=test"],
        "tracking_uri": f"sqlite:///{root}/mlflow.db",
    }
    env = trackers_env(root)
    ids = []
    with pytest.MonkeyPatch.context() as patch:
        # The ranks start here (MLflow keeps a local store's artifacts in ./mlruns).
        patch.chdir(root)
        raw = tiny_raw(run_dir, JOB, metrics=metrics)
        losses = run_ranks(train_losses, 2, raw, env=env)[0]
        ids.append(json.loads((run_dir / "trackers.json").read_text()))
        # Resumed from its step-6 checkpoint, three steps further.
        resumed = tiny_raw(run_dir, JOB, train={"steps": 9}, metrics=metrics)
        run_ranks(train_losses, 2, resumed, env=env)
        ids.append(json.loads((run_dir / "trackers.json").read_text()))
    return Tracked(run_dir, root / "wandb", ids, losses)


def jsonl_losses(run_dir: Path) -> list[tuple[int, float]]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [(r["step"], r["loss"]) for r in map(json.loads, lines) if r.get("kind") == "train"]


# -- MLflow ------------------------------------------------------------------------------


def test_mlflow_holds_the_config_and_every_loss_in_one_run_across_the_resume(
    tracked: Tracked,
) -> None:
    from mlflow.tracking import MlflowClient

    first, second = (ids["mlflow"] for ids in tracked.ids)
    assert second["run_id"] == first["run_id"]  # the resume went on in the same run
    client = MlflowClient(tracking_uri=second["tracking_uri"])
    run = client.get_run(second["run_id"])
    assert run.info.status == "FINISHED"
    assert run.info.run_name == "run"  # the run folder's name
    experiment = client.get_experiment(run.info.experiment_id)
    assert experiment.name == "dtrain-tests"  # metrics.project
    params = run.data.params
    assert params["optim.lr"] == "0.5" and params["train.steps"] == "6"  # as it was made
    assert params["metrics.trackers"] == "['wandb', 'mlflow']"
    assert run.data.tags["kind"] == "test" and run.data.tags["suite"] == ""
    assert run.data.tags["dtrain.state"] == "completed"
    assert run.data.tags["dtrain.checkpoint"] == str(
        (tracked.run_dir / "checkpoints" / "step-00000009").resolve()
    )
    history = client.get_metric_history(run.info.run_id, "train/loss")
    logged = sorted((m.step, m.value) for m in history)
    expected = jsonl_losses(tracked.run_dir)
    assert [step for step, _ in expected] == list(range(1, 10))
    assert logged == expected  # the same floats, bit for bit, at the same steps
    # Every number of every train record, as metrics.jsonl has it (it crossed to MLflow's
    # process as a JSON line: floats round-trip exactly).
    lines = (tracked.run_dir / "metrics.jsonl").read_text().splitlines()
    records = [r for r in map(json.loads, lines) if r.get("kind") == "train"]
    fields = {k for r in records for k, v in r.items() if isinstance(v, float) and k != "time"}
    assert {"loss", "lr", "grad_norm", "step_time_s"} <= fields
    for name in sorted(fields - {"epoch"}):
        history = client.get_metric_history(run.info.run_id, f"train/{name}")
        got = sorted((m.step, m.value) for m in history)
        assert got == [(r["step"], r[name]) for r in records if r.get(name) is not None], name
    per_rank = client.get_metric_history(run.info.run_id, "ranks/step_s/rank1")
    assert sorted(m.step for m in per_rank) == [3, 6, 9]
    val = client.get_metric_history(run.info.run_id, "eval/val_loss")
    assert sorted(m.step for m in val) == [3, 6, 9]


# -- W&B, offline --------------------------------------------------------------------------


def wandb_records(path: Path) -> Iterator[Any]:
    """The records of a W&B ``.wandb`` file, as W&B's own protobuf messages. The file is
    W&B's transaction log: a 7-byte header, then LevelDB's log format (blocks of 32 KiB; each
    chunk a CRC-32, a length, a type: full, first, middle, last)."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B", path
    pos, block, pending = 7, 32 * 1024, b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        body = data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind == 0:  # zero padding
            continue
        assert zlib.crc32(bytes([kind]) + body) == crc, f"{path}: bad chunk at {pos}"
        pending += body
        if kind in (1, 4):  # full, or the last of several
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            yield record


def history_of(path: Path) -> list[dict[str, Any]]:
    rows = []
    for record in wandb_records(path):
        if record.WhichOneof("record_type") == "history":
            rows.append(
                {"/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item}
            )
    return rows


def test_wandb_offline_holds_the_config_and_every_loss_in_one_run_across_the_resume(
    tracked: Tracked,
) -> None:
    first, second = (ids["wandb"] for ids in tracked.ids)
    assert second["id"] == first["id"] and first["mode"] == "offline"
    # Offline, each attempt writes its own file of the same run (`wandb sync` joins them).
    files = sorted(tracked.wandb_dir.glob(f"wandb/offline-run-*-{first['id']}/run-*.wandb"))
    assert len(files) == 2, files
    runs = [r.run for f in files for r in wandb_records(f) if r.WhichOneof("record_type") == "run"]
    assert [run.run_id for run in runs] == [first["id"]] * 2
    assert {run.project for run in runs} == {"dtrain-tests"}
    assert {run.display_name for run in runs} == {"run"}
    assert set(runs[0].tags) == {"from-env", "suite", "kind=test"}
    config = {item.key: json.loads(item.value_json) for item in runs[0].config.update}
    assert config["optim.lr"] == 0.5 and config["train.steps"] == 6
    assert config["metrics.tags"] == ["suite", "kind=test"]
    histories = [history_of(f) for f in files]
    losses = [
        (row["step"], row["train/loss"]) for h in histories for row in h if "train/loss" in row
    ]
    assert losses == jsonl_losses(tracked.run_dir)  # the same floats, in order
    assert min(row["step"] for row in histories[1]) == 7  # the resume goes on after step 6
    ranks = [row["step"] for h in histories for row in h if "ranks/step_s/rank1" in row]
    assert ranks == [3, 6, 9]
    # Each attempt's last checkpoint, as a reference artifact (its path, not its bytes).
    checkpoints = [
        [c.ref for c in r.artifact.manifest.contents]
        for f in files
        for r in wandb_records(f)
        if r.WhichOneof("record_type") == "artifact"
    ]
    folder = (tracked.run_dir / "checkpoints").resolve()
    for refs, step in zip(checkpoints, ("step-00000006", "step-00000009"), strict=True):
        assert f"file://{folder}/{step}/meta.json" in refs  # W&B lists the folder's files
        assert {ref.rsplit("/", 1)[0] for ref in refs} == {f"file://{folder}/{step}"}


@pytest.mark.slow  # matplotlib's plots and a third W&B start: ~10 s the default suite keeps
def test_the_report_goes_to_the_runs_trackers(
    tracked: Tracked, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("matplotlib")
    from mlflow.tracking import MlflowClient

    assert main(["report", str(tracked.run_dir), "--to-trackers"]) == 0
    out = capsys.readouterr().out
    assert "sent the report (" in out and "to mlflow" in out and "to wandb" in out, out
    ids = tracked.ids[-1]
    client = MlflowClient(tracking_uri=ids["mlflow"]["tracking_uri"])
    sent = {Path(a.path).name for a in client.list_artifacts(ids["mlflow"]["run_id"], "report")}
    assert {"loss_by_step.png", "time_breakdown.png", "report.html"} <= sent
    # W&B offline: one more file of the same run, beside the run's (no WANDB_DIR here).
    (report,) = tracked.run_dir.glob(f"wandb/offline-run-*-{ids['wandb']['id']}/run-*.wandb")
    artifacts = [r.artifact for r in wandb_records(report) if r.artifact.type == "report"]
    assert [a.type for a in artifacts] == ["report"]
    assert {"loss_by_step.png", "report.html"} <= {c.path for c in artifacts[0].manifest.contents}


# -- a tracker that fails ------------------------------------------------------------------


def train_losses_and_warnings(raw: dict[str, Any]) -> tuple[list[float], str]:
    """:func:`train_losses` on a rank, with what it wrote to ``sys.stderr`` (a rank's own
    output goes to the test session's, not to the test's)."""
    import contextlib
    import io

    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        losses = train_losses(raw)
    return losses, err.getvalue()


def test_a_tracker_that_cannot_write_costs_one_warning_and_no_loss(
    tracked: Tracked, tmp_path: Path
) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder\n")
    # The store's folder is a file: every call of MLflow's fails.
    metrics = {"trackers": ["mlflow"], "tracking_uri": f"sqlite:///{blocker}/mlflow.db"}
    raw = tiny_raw(tmp_path / "run", JOB, metrics=metrics)
    losses, err = run_ranks(train_losses_and_warnings, 2, raw)[0]
    assert losses == tracked.losses  # the same bits as the run whose trackers worked
    warnings = [line for line in err.splitlines() if "tracker mlflow" in line]
    assert len(warnings) == 1, err
    assert "failed" in warnings[0] and str(blocker) in warnings[0]
    assert not (tmp_path / "run" / "trackers.json").exists()


# -- bad input, before any worker starts -----------------------------------------------------


def test_an_unknown_tracker_is_a_config_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = write_tiny_config(tmp_path / "c.toml", tmp_path / "run")
    assert main(["train", str(config), "--metrics.trackers=['neptune']"]) == 2
    err = capsys.readouterr().err
    assert "metrics.trackers[0] = 'neptune' is not allowed" in err and err.count("\n") == 1
    assert not (tmp_path / "run").exists()


def test_a_tracker_without_its_package_names_the_extra(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    config = write_tiny_config(tmp_path / "c.toml", tmp_path / "run")
    # As on a machine without mlflow: Python finds no module that sys.modules maps to None.
    monkeypatch.setitem(sys.modules, "mlflow", None)
    assert main(["train", str(config), '--metrics.trackers=["wandb", "mlflow"]']) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "pip install -e '.[mlflow]'" in err, err
    assert not (tmp_path / "run").exists()
