"""MLflow's own process (dtrain.metrics.trackers.process_sink, .sender): what it does when it
falls behind and when its training process dies -- real MLflow on a local SQLite store.

- A sink whose process is stopped (SIGSTOP) takes every record without blocking, keeps what
  its bounded buffer holds, drops the rest with one warning and a count; continued, the process
  logs exactly the records kept, and ends at the run's final line though its pipe is held open.
- A 1-rank run killed with SIGKILL at step 4, its tracker's pipe held open by another process,
  leaves no tracker process behind (its pid, which the sink records, is waited on through a
  pidfd: bounded, no sleeps); the process logs the records written before the kill and ends
  the MLflow run as FAILED.
"""

from __future__ import annotations

import json
import os
import select
import signal
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import tiny_raw
from tests.ranks import RankFailed, run_ranks

pytest.importorskip("mlflow")
pytestmark = pytest.mark.filterwarnings("ignore:The ``noload`` loader strategy")


def wait_gone(pid: int, timeout: float) -> bool:
    """Whether process ``pid`` ended within ``timeout`` seconds: a pidfd becomes readable
    when it ends, whoever its parent is (a process that was gone already counts)."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return True
    try:
        ready, _, _ = select.select([fd], [], [], timeout)
        return bool(ready)
    finally:
        os.close(fd)


@pytest.fixture(scope="module")
def store_uri(tmp_path_factory: pytest.TempPathFactory) -> str:
    """One SQLite store for the module's runs: its tables are made once."""
    return f"sqlite:///{tmp_path_factory.mktemp('mlflow-store')}/mlflow.db"


def mlflow_run(uri: str, ids_file: Path) -> tuple[Any, Any]:
    from mlflow.tracking import MlflowClient

    ids = json.loads(ids_file.read_text())["mlflow"]
    client = MlflowClient(tracking_uri=uri)
    return client, client.get_run(ids["run_id"])


def test_a_stopped_tracker_process_never_blocks_the_step_and_drops_what_it_cannot_hold(
    tmp_path: Path,
    store_uri: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    from dtrain.metrics.trackers import process_sink
    from dtrain.metrics.trackers.rows import Setup

    # A one-page pipe and 64 KiB waiting here: a few hundred records fill both.
    monkeypatch.setattr(process_sink, "PIPE_BYTES", 4096)
    monkeypatch.setattr(process_sink, "PENDING_BYTES", 64 << 10)
    uri = store_uri
    setup = Setup(tmp_path, str(tmp_path), "run", {"train.lr": 0.5}, "", (), uri)
    sink = process_sink.ProcessSink("mlflow", setup, tmp_path, continuing=False)
    os.kill(sink.pid, signal.SIGSTOP)  # it reads nothing until continued
    try:
        values = {f"v{i:02d}": 1.0 + i for i in range(20)}  # ~500 bytes a line
        written = 0
        while sink.dropped < 10 and written < 5000:
            written += 1
            sink.write({"kind": "train", "step": written, "time": 1.0, **values})
        # The buffer's bound, not the loop's: a blocking write would have hung above.
        assert sink.dropped == 10 and written < 1000, (written, sink.dropped)
    finally:
        os.kill(sink.pid, signal.SIGCONT)
    sink.write({"kind": "summary", "state": "completed", "step": written, "wall_s": 1.0})
    # The pipe held open elsewhere too, as by a process the trainer forked: the final line,
    # not the end of input, ends the tracker's process.
    held = os.dup(sink._fd)
    try:
        sink.close()
    finally:
        os.close(held)
    err = capsys.readouterr().err
    assert err.count("warning: tracker mlflow falls behind the run") == 1, err
    assert err.count("warning:") == 1, err
    kept = written - sink.dropped
    assert sink._proc is not None and sink._proc.returncode == 0
    assert sink.done["rows"] == kept and not sink.failed.is_set()
    client, run = mlflow_run(uri, tmp_path / "trackers.json")
    assert run.info.status == "FINISHED" and run.data.tags["dtrain.state"] == "completed"
    history = client.get_metric_history(run.info.run_id, "train/v07")
    # The first records, in order, every one whole; the ones after the buffer filled, none.
    assert sorted(m.step for m in history) == list(range(1, kept + 1))
    assert {m.value for m in history} == {8.0}


def test_a_tracker_process_that_dies_is_one_warning_and_never_blocks_the_step(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from dtrain.metrics.trackers.process_sink import ProcessSink
    from dtrain.metrics.trackers.rows import Setup

    setup = Setup(tmp_path, str(tmp_path), "run", {}, "", (), f"sqlite:///{tmp_path}/m.db")
    sink = ProcessSink("mlflow", setup, tmp_path, continuing=False)
    os.kill(sink.pid, signal.SIGKILL)
    values = {f"v{i:02d}": 1.0 + i for i in range(20)}
    for step in range(1, 3001):  # 1.5 MB: more than the pipe holds, and its reader is gone
        sink.write({"kind": "train", "step": step, "time": 1.0, **values})
    sink.close()
    err = capsys.readouterr().err
    assert err.count("warning:") == 1, err
    assert f"tracker mlflow's process {sink.pid} ended (exit code -9)" in err, err
    assert sink.failed.is_set() and sink.dropped == 0  # refused by the pipe, not the buffer
    assert not (tmp_path / "trackers.json").exists()


JOB = {"train": {"steps": 6, "log_every": 1}, "eval": {"every": 0}, "checkpoint": {"every": 0}}


def train_until_killed(raw: dict[str, Any], pid_file: str) -> None:
    """In the rank: train; at step 4, once the tracker's process has opened its run, write its
    pid and die by SIGKILL (nothing of the rank's closes). A process of the rank's own holds
    the tracker's pipe open past the kill, as a forked DataLoader worker would: no end of input
    for the tracker's process, only its parent gone."""
    import subprocess

    from dtrain.fault.failpoints import failpoints
    from dtrain.metrics.trackers.process_sink import ProcessSink
    from tests.dist_helpers import make_trainer

    trainer = make_trainer(raw)

    def at(name: str, **args: Any) -> None:
        if name != "train.step" or args["step"] != 4:
            return
        assert trainer.run_log.metrics is not None
        (sink,) = [s for s in trainer.run_log.metrics.sinks if isinstance(s, ProcessSink)]
        assert sink.started.wait(180), "the tracker's process did not open its run"
        holder = subprocess.Popen(["sleep", "600"], pass_fds=[sink._fd])
        Path(pid_file).write_text(f"{sink.pid} {holder.pid}")
        os.kill(os.getpid(), signal.SIGKILL)

    with failpoints(at):
        trainer.fit()


def test_a_killed_worker_leaves_no_tracker_process_and_its_run_failed(
    tmp_path: Path, store_uri: str
) -> None:
    uri = store_uri
    run_dir = tmp_path / "run"
    raw = tiny_raw(run_dir, JOB, metrics={"trackers": ["mlflow"], "tracking_uri": uri})
    pid_file = tmp_path / "tracker.pid"
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(tmp_path)  # MLflow's ./mlruns
        with pytest.raises(RankFailed, match="exit code -9"):
            run_ranks(train_until_killed, 1, raw, str(pid_file), timeout=300)
    pid, holder = map(int, pid_file.read_text().split())
    try:
        assert wait_gone(pid, 60), f"tracker process {pid} outlived its worker"
    finally:
        os.kill(holder, signal.SIGKILL)
    client, run = mlflow_run(uri, run_dir / "trackers.json")
    assert run.info.status == "FAILED"  # ended by the process itself, its trainer gone
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    expected = [(r["step"], r["loss"]) for r in map(json.loads, lines) if r["kind"] == "train"]
    assert [step for step, _ in expected] == [1, 2, 3]
    logged = sorted(
        (m.step, m.value) for m in client.get_metric_history(run.info.run_id, "train/loss")
    )
    assert logged == expected  # what the trainer wrote before it died, every bit
