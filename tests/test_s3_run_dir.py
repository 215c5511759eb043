"""A run folder in an object store (``run.dir = "s3://bucket/prefix"``, docs/multi-host.md),
against moto's S3 server started here; ``make test-s3`` runs the same tests against OpenStack
Swift's S3 API (``scripts/s3.sh up``), given to them as ``DTRAIN_TEST_S3_ENDPOINT`` (with
Swift's test account). The store's endpoint and the fake credentials are in the runs'
environment only; the test reads the bucket with a client of its own, given them explicitly.

The journey, made once per module: a local run, and the same run (2 ranks) in the store whose
rank 1 is killed (SIGKILL) at step 5 and which then resumes from the store; ``dtrain export``
of both, ``dtrain status`` and ``dtrain report`` of the store's. Its tests run on two forms of
it: the default suite's, whose ranks come from a forkserver that has imported torch (seconds),
and the launched one (``slow``, about a minute on 2 busy cores; ``make test-s3``): ``dtrain``
commands, the launcher restarting the killed job (``--max-restarts 1``). The default suite
also saves, prunes, verifies and loads checkpoints in the store in this process (whole files
and DCP's sharded state), and checks the refusals of bad stores."""

from __future__ import annotations

import contextlib
import copy
import io
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from dtrain.checkpoint import read as ckread
from dtrain.checkpoint.hold import take_hold
from dtrain.checkpoint.layout import committed_steps
from dtrain.checkpoint.rundir import check_scheme, check_store
from dtrain.checkpoint.write import Checkpointer
from dtrain.cli import main
from dtrain.errors import CheckpointError, UserError
from dtrain.storage.objects import ObjectPath
from tests.conftest import tiny_raw
from tests.ranks import RankFailed, run_ranks
from tests.s3_helpers import BUCKET, Store, dtrain, finish, open_store, s3fs, silent_store

# One pytest worker runs the module, so that its store and its journeys are made once.
pytestmark = pytest.mark.xdist_group("s3-run-dir")


@pytest.fixture(scope="module")
def store() -> Iterator[Store]:
    yield from open_store(BUCKET)


def write_config(path: Path, run_dir: str, local_dir: Path, **task: object) -> Path:
    options = {"samples": 64, "fail_rank": -1} | task
    lines = [
        "[run]",
        f'dir = "{run_dir}"',
        f'local_dir = "{local_dir}"',
        'task = "tests.tasks:failing_gpt"',
        "[data]",
        "global_batch_size = 8",
        "[train]",
        "steps = 8",
        "log_every = 1",
        "[eval]",
        "every = 0",
        "[checkpoint]",
        "every = 2",
        "keep_last = 2",
        "[optim]",
        'name = "adamw"',
        "[dist]",
        "timeout_s = 20",
        "[task]",
        *(f"{k} = {v}" for k, v in options.items()),
    ]
    path.write_text("\n".join(lines) + "\n")
    return path


@dataclass
class Journey:
    store: Store
    tmp: Path
    prefix: str  # the store's run folder: s3://BUCKET/prefix
    local_dir: Path  # its run.local_dir
    local_export: Path
    s3_export: Path
    status: str  # what `dtrain status` said of it

    def records(self) -> list[dict[str, Any]]:
        text = self.store.fs.cat_file(f"{BUCKET}/{self.prefix}/metrics.jsonl").decode()
        return [json.loads(line) for line in text.splitlines()]


@pytest.fixture(scope="module")
def launched(store: Store, tmp_path_factory: pytest.TempPathFactory) -> Journey:
    """The journey as a user makes it: `dtrain train` launches, whose rank 1 the launcher
    restarts once (``--max-restarts 1``), and `dtrain export`, `status`, `report` commands."""
    tmp = tmp_path_factory.mktemp("s3-journey")
    local = write_config(tmp / "local.toml", str(tmp / "local-run"), tmp / "unused")
    remote = write_config(
        tmp / "s3.toml",
        f"s3://{BUCKET}/exp",
        tmp / "s3-local",
        fail_rank=1,
        kill_at_step=5,
        kill_attempts=1,
    )
    # Side by side: the two launches, then the two exports and the status.
    runs = [
        dtrain(store, "train", str(local), "--nproc", "2"),
        dtrain(store, "train", str(remote), "--nproc", "2", "--max-restarts", "1"),
    ]
    (code_local, said_local), (code, said) = map(finish, runs)
    assert code_local == 0, said_local[-3000:]
    assert code == 0, said[-3000:]
    assert said.count("dtrain: training ddp on 2 rank(s)") == 2, said  # killed once, restarted
    assert "resumed from step-" in said
    procs = [
        dtrain(store, "export", str(tmp / "local-run"), str(tmp / "local.safetensors")),
        dtrain(store, "export", f"s3://{BUCKET}/exp", str(tmp / "s3.safetensors")),
        dtrain(store, "status", f"s3://{BUCKET}/exp"),
        dtrain(store, "report", f"s3://{BUCKET}/exp", "--out", str(tmp / "report")),
    ]
    done = [finish(p) for p in procs]
    for code, text in done:
        assert code == 0, text[-3000:]
    assert store.fs.exists(f"{BUCKET}/exp/config.toml")  # the launcher's, beside the records
    return Journey(
        store,
        tmp,
        "exp",
        tmp / "s3-local",
        tmp / "local.safetensors",
        tmp / "s3.safetensors",
        done[2][1],
    )


# The same job as tests.conftest's fast config gives it, for the ranks' journey below.
RANKS_JOB = {
    "run": {"task": "tests.tasks:failing_gpt"},
    "train": {"steps": 8, "log_every": 1},
    "checkpoint": {"every": 2, "keep_last": 2},
    "optim": {"name": "adamw"},
    "task": {"samples": 64, "fail_rank": -1},
}


def train_once(raw: dict[str, Any]) -> int:
    """In each rank: the run, to its end (the step it started from) or to its death."""
    from tests.dist_helpers import make_trainer

    return make_trainer(raw).fit().start_step


def cli_here(store: Store, *args: str) -> str:
    """``dtrain ARGS`` in this process, with the store's endpoint and credentials in the
    environment as a user's shell has them; what it printed."""
    printed = io.StringIO()
    with pytest.MonkeyPatch.context() as env, contextlib.redirect_stdout(printed):
        for name, value in store.env.items():
            env.setenv(name, value)
        code = main(list(args))
    assert code == 0, (args, printed.getvalue())
    return printed.getvalue()


@pytest.fixture(scope="module")
def ranks(store: Store, tmp_path_factory: pytest.TempPathFactory) -> Journey:
    """The same journey in seconds, for the default suite: the ranks come from tests.ranks'
    forkserver, which has imported torch, instead of from `dtrain train`'s launcher; rank 1's
    SIGKILL ends the job's first attempt, and the second (a new pair of processes, as the
    launcher's restart) resumes from the store. The commands after it run in this process."""
    tmp = tmp_path_factory.mktemp("s3-ranks")
    url = f"s3://{BUCKET}/ranks"
    local = tiny_raw(tmp / "local-run", RANKS_JOB, run={"local_dir": str(tmp / "unused")})
    stored = tiny_raw(tmp / "unused", RANKS_JOB, run={"dir": url, "local_dir": str(tmp / "s3")})
    killed = copy.deepcopy(stored)
    killed["task"] |= {"fail_rank": 1, "kill_at_step": 5}
    (tmp / "local-run").mkdir()  # as the launcher makes it: tests.tasks counts attempts there
    assert run_ranks(train_once, 2, local, timeout=240) == [0, 0]
    first = run_ranks(train_once, 2, killed, env=store.env, timeout=240, raise_on_failure=False)
    assert "rank 1 died with exit code -9" in str(first[1]), first  # SIGKILL, mid-step 5
    assert isinstance(first[0], RankFailed), first  # rank 0 could not go on without it
    start = run_ranks(train_once, 2, stored, env=store.env, timeout=240)
    assert start[0] == start[1] and start[0] in (2, 4), start  # a checkpoint before the kill
    cli_here(store, "export", str(tmp / "local-run"), str(tmp / "local.safetensors"))
    cli_here(store, "export", url, str(tmp / "s3.safetensors"))
    status = cli_here(store, "status", url)
    cli_here(store, "report", url, "--out", str(tmp / "report"))
    return Journey(
        store, tmp, "ranks", tmp / "s3", tmp / "local.safetensors", tmp / "s3.safetensors", status
    )


@pytest.fixture(scope="module", params=["ranks", pytest.param("launched", marks=pytest.mark.slow)])
def journey(request: pytest.FixtureRequest) -> Journey:
    """Each test of the journey runs on both: the ranks' (default suite) and the launched one
    (``slow``; ``make test-s3``)."""
    made: Journey = request.getfixturevalue(request.param)
    return made


def test_kill9_and_resume_in_the_store_exports_the_local_run_s_bits(journey: Journey) -> None:
    load_file = pytest.importorskip("safetensors.torch").load_file

    resumed = [r for r in journey.records() if r.get("name") == "resumed"]
    assert [r["checkpoint"] for r in resumed] in (["step-00000002"], ["step-00000004"]), resumed
    local, remote = load_file(journey.local_export), load_file(journey.s3_export)
    assert local.keys() == remote.keys() and len(local) > 0
    for name in local:
        assert torch.equal(local[name], remote[name]), name  # bit-identical
    assert "completed, step 8/8" in journey.status, journey.status
    assert f"s3://{BUCKET}/{journey.prefix}" in journey.status
    page = (journey.tmp / "report" / "report.html").read_text()
    assert journey.prefix in page and "8" in page  # the store's run, from its uploaded records


def test_retention_and_the_marker_in_the_store(journey: Journey) -> None:
    root = journey.store.path(f"{journey.prefix}/checkpoints")
    names = sorted(entry.name for entry in root.iterdir())
    assert names == ["step-00000006", "step-00000008"]  # keep_last = 2, nothing unfinished
    assert committed_steps(root) == [8, 6]
    newest, skipped = ckread.find_latest_valid(root)
    assert newest == root / "step-00000008" and not skipped


def test_no_credential_is_written_to_the_store_or_the_local_folder(journey: Journey) -> None:
    fs = journey.store.fs
    keys = fs.find(f"{BUCKET}/{journey.prefix}")
    assert f"{BUCKET}/{journey.prefix}/metrics.jsonl" in keys
    for key in keys:
        data = fs.cat_file(key)
        for secret in journey.store.secrets:
            assert secret.encode() not in data, key
    local = [p for p in journey.local_dir.rglob("*") if p.is_file()]
    assert any(p.name == "metrics.jsonl" for p in local)
    assert any(p.parent.name == "liveness" for p in local)  # per machine: stays local
    for path in local:
        data = path.read_bytes()
        for secret in journey.store.secrets:
            assert secret.encode() not in data, path


def test_the_resume_from_the_store_leaves_no_local_copies(journey: Journey) -> None:
    # The resumed ranks verified and loaded the store's checkpoint through local copies in
    # run.local_dir (dtrain.checkpoint.copies); the load's end removed them.
    assert any(journey.local_dir.rglob("metrics.jsonl"))
    assert sorted(journey.local_dir.rglob(".resume-copies-*")) == []


def test_checkpoints_in_the_store_commit_prune_verify_and_load(store: Store) -> None:
    root = store.path("inproc/checkpoints")
    saver = Checkpointer(root, rank=0, world_size=1, keep_last=2, keep_every=0, log=print)
    for step in (1, 2, 3):
        weights = {"w": torch.full((3, 4), float(step)), "b": torch.arange(5.0) * step}
        saver.save(
            step,
            {"model.pt": weights},
            {"step": step, "world_size": 1},
            blocking=True,
            sharded={"model": {"s": torch.full((6,), step + 0.5)}},
        )
    assert committed_steps(root) == [3, 2]  # keep_last = 2: step 1 pruned, marker first
    assert sorted(entry.name for entry in root.iterdir()) == ["step-00000002", "step-00000003"]
    newest, skipped = ckread.find_latest_valid(root)
    assert newest == root / "step-00000003" and not skipped
    loaded = ckread.load_file(root / "step-00000003", "model.pt")
    assert torch.equal(loaded["w"], torch.full((3, 4), 3.0))
    template = {"model": {"s": torch.zeros(6)}}
    ckread.load_sharded(root / "step-00000003", template)  # dtrain's safe reader, via fsspec
    assert torch.equal(template["model"]["s"], torch.full((6,), 3.5))
    # Damage one piece: named, and the newest that verifies is the one before.
    model = root / "step-00000003" / "model.pt"
    data = bytearray(model.read_bytes())
    data[len(data) // 2] ^= 0xFF
    model.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"step-00000003/model\.pt fails its SHA-256"):
        ckread.verify_checkpoint(root / "step-00000003")
    newest, skipped = ckread.find_latest_valid(root)
    assert newest == root / "step-00000002" and [p.name for p, _ in skipped] == ["step-00000003"]
    # No marker, no checkpoint: a save cut off before its marker never counts.
    (root / "step-00000002" / "COMMITTED.json").unlink()
    assert committed_steps(root) == [3]
    assert ckread.find_latest_valid(root)[0] is None


def test_bad_stores_are_one_line_each(
    store: Store, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    with pytest.raises(UserError, match="unknown scheme nosuch://"):
        check_scheme("nosuch://bucket/run")
    with pytest.raises(UserError, match="the bucket 'no-such-bucket' does not exist"):
        check_store(ObjectPath("s3://no-such-bucket/run", store.fs))
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    anonymous = s3fs.S3FileSystem(endpoint_url=store.endpoint, skip_instance_cache=True)
    with pytest.raises(UserError, match=f"no credentials for the object store s3://{BUCKET}"):
        check_store(ObjectPath(f"s3://{BUCKET}/run", anonymous))


def test_a_store_that_does_not_answer_fails_the_save_naming_it(store: Store) -> None:
    gone = silent_store()
    saver = Checkpointer(
        ObjectPath(f"s3://{BUCKET}/gone/checkpoints", gone),
        rank=0,
        world_size=1,
        keep_last=2,
        keep_every=0,
        log=lambda _: None,
    )
    with pytest.raises(CheckpointError) as caught:
        saver.save(1, {"model.pt": {"w": torch.zeros(2)}}, {"step": 1}, blocking=True)
    said = str(caught.value)
    assert "checkpoint step-00000001 was not committed" in said
    assert f"object store s3://{BUCKET}" in said and "attempts per request" in said
    assert f"s3://{BUCKET}/gone/checkpoints/step-00000001/" in said  # the key


def test_the_hold_keeps_a_second_job_out_of_the_store_s_folder(store: Store) -> None:
    folder = store.path("held")
    first = take_hold(folder, "job-a", "")
    try:
        with pytest.raises(UserError, match=r"is in use by job 'job-a'"):
            take_hold(folder, "job-b", "")
    finally:
        first.release()
    assert not (folder / "hold.json").exists()


@pytest.mark.slow
def test_the_store_s_run_goes_on_under_fsdp_on_one_rank_and_exports(launched: Journey) -> None:
    # Last in this file: it extends the journey's run. ddp on 2 ranks saved step 8 (whole
    # files); fsdp on 1 rank resumes it from the store and saves step 10 as DCP shards there.
    config = launched.tmp / "s3.toml"
    args = ("--nproc", "1", "--strategy.name=fsdp", "--train.steps=10")
    code, said = finish(dtrain(launched.store, "train", str(config), *args))
    assert code == 0, said[-3000:]
    assert "training fsdp on 1 rank(s), cpu, resumed from step-00000008" in said
    assert "step-00000008 was saved by strategy 'ddp'; fsdp read its model" in said
    step10 = launched.store.path("exp/checkpoints/step-00000010")
    assert (step10 / "dcp" / ".metadata").exists()
    ckread.verify_checkpoint(step10)
    out = launched.tmp / "fsdp.safetensors"
    code, said = finish(dtrain(launched.store, "export", f"s3://{BUCKET}/exp", str(out)))
    assert code == 0 and "from s3://runs/exp/checkpoints/step-00000010" in said, said[-2000:]
    load_file = pytest.importorskip("safetensors.torch").load_file
    exported, before = load_file(out), load_file(launched.s3_export)
    assert exported.keys() == before.keys()
    assert any(not torch.equal(exported[k], before[k]) for k in before)  # two more steps
