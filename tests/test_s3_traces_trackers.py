"""A run folder in an object store keeps what the run's tools leave (docs/observability.md):
``train.profile``'s traces, written to each machine's ``run.local_dir`` during the run, are
uploaded into the store's run folder (each rank its own, at checkpoints and at the end) and
listed from there by ``dtrain report``; ``trackers.json`` lives in the store's folder, so a
resume on another machine (another ``run.local_dir``) goes on in the same tracker run.

A launch of 2 ranks against moto's S3 server (the fixture of ``tests/test_s3_run_dir.py``)
trains 4 steps profiled at steps 2-3 with W&B offline; a second resumes the same run folder from
another local folder to step 6."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from dtrain.metrics.traces import list_traces
from dtrain.report.stored import readable_runs
from dtrain.storage.objects import ObjectPath
from tests.conftest import tiny_raw
from tests.ranks import run_ranks
from tests.test_s3_run_dir import BUCKET, Store
from tests.test_s3_run_dir import store as store  # the module-scoped fixture
from tests.test_trackers import history_of

pytest.importorskip("wandb")

URL = f"s3://{BUCKET}/observed"
JOB = {
    "train": {"steps": 4, "log_every": 1, "profile": "steps:2-3"},
    "checkpoint": {"every": 2},
    "metrics": {"trackers": ["wandb"], "project": "dtrain-tests"},
}


def train_once(raw: dict[str, Any]) -> dict[str, Any]:
    """In each rank: the run; what it left in its local folder."""
    from tests.dist_helpers import make_trainer

    make_trainer(raw).fit()
    local = Path(raw["run"]["local_dir"])
    return {
        "local": sorted(p.name for p in (local / "traces").glob("*.json")),
        "local_ids": (local / "trackers.json").is_file(),
    }


@dataclass
class Observed:
    store: Store
    root: Path
    env: dict[str, str]
    ids: dict[str, Any]  # the store's trackers.json after the run
    ranks: list[dict[str, Any]]  # by rank


@pytest.fixture(scope="module")
def observed(store: Store, tmp_path_factory: pytest.TempPathFactory) -> Observed:
    root = tmp_path_factory.mktemp("s3-observed")
    raw = tiny_raw(root / "unused", JOB, run={"dir": URL, "local_dir": str(root / "a")})
    env = {**store.env, "WANDB_MODE": "offline", "WANDB_DIR": str(root / "wandb")}
    ranks = run_ranks(train_once, 2, raw, env=env, timeout=240)
    ids = json.loads(store.fs.cat_file(f"{BUCKET}/observed/trackers.json"))
    return Observed(store, root, env, ids, ranks)


def test_traces_are_written_locally_and_uploaded_into_the_store_s_run_folder(
    observed: Observed, monkeypatch: pytest.MonkeyPatch
) -> None:
    names = ["rank0-steps2-3.json", "rank1-steps2-3.json"]
    assert [r["local"] for r in observed.ranks] == [names] * 2  # where they ran (one machine)
    keys = sorted(observed.store.fs.ls(f"{BUCKET}/observed/traces", detail=False))
    assert keys == [f"{BUCKET}/observed/traces/{name}" for name in names]
    for name in names:
        local = observed.root / "a" / "traces" / name
        stored = observed.store.fs.cat_file(f"{BUCKET}/observed/traces/{name}")
        assert stored == local.read_bytes()  # whole
        events = {e.get("name") for e in json.loads(stored)["traceEvents"]}
        assert {"dtrain step 2", "dtrain step 3"} <= events
    # dtrain report reads a store's run folder through a local copy of its records: the
    # traces are listed where they are, in the store.
    for name, value in observed.store.env.items():
        monkeypatch.setenv(name, value)
    with readable_runs([URL]) as (copy,):
        traces = list_traces(copy)
    assert [(t.rank, t.steps) for t in traces] == [(0, "2-3"), (1, "2-3")]
    assert [str(t.path) for t in traces] == [f"{URL}/traces/{name}" for name in names]
    assert all(isinstance(t.path, ObjectPath) and t.size > 1000 for t in traces)


def test_trackers_json_lives_in_the_store_s_run_folder(observed: Observed) -> None:
    assert observed.ids["wandb"]["mode"] == "offline"
    assert observed.ids["wandb"]["project"] == "dtrain-tests"
    assert not any(r["local_ids"] for r in observed.ranks)  # never in the local folder


@pytest.mark.slow  # a second launch: ~10 s
def test_a_resume_on_another_machine_goes_on_in_the_same_tracker_run(observed: Observed) -> None:
    # The same run folder from another local folder (another machine's), to step 6.
    raw = tiny_raw(
        observed.root / "unused",
        JOB,
        run={"dir": URL, "local_dir": str(observed.root / "b")},
        train={**JOB["train"], "steps": 6},
    )
    ranks = run_ranks(train_once, 2, raw, env=observed.env, timeout=240)
    assert [r["local"] for r in ranks] == [[]] * 2  # past the window: nothing profiled
    assert not any(r["local_ids"] for r in ranks)
    ids = json.loads(observed.store.fs.cat_file(f"{BUCKET}/observed/trackers.json"))
    assert ids == observed.ids  # the same W&B run, found in the store
    run_id = ids["wandb"]["id"]
    # Offline, each launch writes its own file of the same W&B run.
    files = sorted((observed.root / "wandb").glob(f"wandb/offline-run-*-{run_id}/run-*.wandb"))
    assert len(files) == 2, files
    steps = [[row["step"] for row in history_of(f) if "train/loss" in row] for f in files]
    assert steps == [[1, 2, 3, 4], [5, 6]]
