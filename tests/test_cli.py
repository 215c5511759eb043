"""The command line: bad input gets one line and exit code 2 before any worker starts; a good
config trains end to end through torch's elastic launcher."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dtrain.cli import main
from tests.conftest import REPO


def run_cli(*args: str, cwd: Path = REPO, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "dtrain", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def write_tiny_config(path: Path, run_dir: Path, **extra: str) -> Path:
    lines = [
        "[run]",
        f'dir = "{run_dir}"',
        'task = "tests.tasks:tiny_gpt"',
        "[data]",
        "global_batch_size = 8",
        "[train]",
        "steps = 6",
        "log_every = 2",
        "[eval]",
        "every = 3",
        "[checkpoint]",
        "every = 3",
        "[task]",
        "samples = 64",
    ]
    path.write_text("\n".join(lines) + "\n" + "".join(f"{v}\n" for v in extra.values()))
    return path


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["train", "--train.stepz=3"],
            "unknown config key train.stepz (did you mean train.steps?)",
        ),
        (["train", "--train.steps=abc"], "train.steps = 'abc' has the wrong type"),
        (["train", "--optim.lr=-1"], "optim.lr = -1.0 is out of range"),
        (["train", "missing.toml"], "config file missing.toml does not exist"),
        (
            ["train", "--nproc", "0"],
            "--nproc 0: the number of workers per machine must be at least 1",
        ),
        (["train", "--nproc", "-2"], "--nproc -2"),
        (["train", "--run.task=no_such_pkg.mod:build"], "cannot import module 'no_such_pkg.mod'"),
        (["train", "--run.task=dtrain.tasks.gpt:nope"], "has no attribute 'nope'"),
        (["train", "--run.task=dtrain.tasks.gpt"], "expected 'package.module:function'"),
        (
            ["train", "--task.d_modl=4"],
            "unknown config key task.d_modl (did you mean task.d_model?)",
        ),
        (["train", "--strategy.name=zero9"], "strategy.name = 'zero9' is not a strategy; valid:"),
        (["config", "--strategy.name=zero9"], "strategy.name = 'zero9' is not a strategy; valid:"),
        (["train", "--nnodes", "2"], "--nnodes > 1 needs --rdzv-endpoint"),
        (["train", "--nnodes", "3:1"], "need 1 <= MIN <= MAX"),
        (["train", "--node-rank", "1"], "--node-rank 1: must be below --nnodes 1 (0 .. 0)"),
        # The run id names runs/<run id>: '../x' made the run outside runs/.
        (["train", "--run-id", "../../x"], "--run-id '../../x': must be a plain name"),
        (["train", "--run-id", ".."], "--run-id '..': must be a plain name"),
        (
            ["train", "--nnodes", "1:2", "--node-rank", "2", "--rdzv-endpoint", "127.0.0.1:29400"],
            "--node-rank 2: must be below --nnodes 1:2 (0 .. 1)",
        ),
        (["train", "--nproc", "4", "--data.global_batch_size=2"], "smaller than 4 data-parallel"),
        (["train", "--train.steps", "3"], "has no value"),
        (["train", "stray", "extra"], "unrecognized argument 'extra'"),
        # A command without config keys does not speak of them.
        (["status", "run", "extra"], "unrecognized arguments: extra (see dtrain status --help)"),
        (["strategies", "--x"], "unrecognized arguments: --x (see dtrain strategies --help)"),
        # Found by the workers before (a traceback in each): checked with the config now.
        (["train", "--task.n_head=5"], "task.n_head = 5 does not divide task.d_model = 192"),
        (["train", "--task.seq_len=0"], "task.seq_len = 0 is out of range: it must be at least 1"),
        (["train", "--optim.lr=nan"], "optim.lr = nan is not a finite number"),
        (["train", "--optim.lr=inf"], "optim.lr = inf is not a finite number"),
        (["train", "--balance.max_change=inf"], "balance.max_change = inf is not a finite"),
        (["train", "--optim.momentum=nan"], "optim.momentum = nan is not a finite number"),
        (
            ["train", "--nproc", "2", "--fault.recovery=inplace", "--fault.min_replicas=3"],
            "fault.min_replicas = 3 is more than the job's 2 workers (--nproc 2)",
        ),
        (["train", "--fault.min_replicas=2"], "applies to fault.recovery = 'inplace' only"),
        (["train", '--fault.preempt_signals=["SIGKILL"]'], "SIGKILL cannot be caught"),
        (["train", '--fault.preempt_signals=["SIGSTOP"]'], "SIGSTOP cannot be caught"),
        (["train", '--fault.preempt_signals=["SIGCHLD"]'], "SIGCHLD does not mean 'stop'"),
        (["verify", "/no/such/dataset"], "does not exist"),
        (["prepare", "/no/such/source", "/tmp/x"], "source /no/such/source does not exist"),
    ],
)
def test_user_mistakes_exit_2_with_one_line(
    args: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(args) == 2
    err = capsys.readouterr().err
    assert message in err
    assert err.count("\n") == 1 and err.startswith("dtrain: error: ")
    assert "Traceback" not in err


def test_a_run_dir_that_is_a_file_is_one_line_before_any_worker_starts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder\n")
    for run_dir in (blocker, blocker / "below" / "it"):
        assert main(["train", f"--run.dir={run_dir}", "--train.steps=1"]) == 2
        err = capsys.readouterr().err
        said = f"run.dir {run_dir}: {blocker} is a file, not a folder; choose another run.dir"
        assert err == f"dtrain: error: {said}\n"


def test_import_error_inside_a_task_module_is_reported(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "broken_task.py").write_text("import math\nx = 1 / 0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert main(["train", "--run.task=broken_task:build"]) == 2
    err = capsys.readouterr().err
    assert "importing 'broken_task' raised ZeroDivisionError: division by zero" in err


def test_real_cli_process_gives_no_traceback() -> None:
    result = run_cli("train", "--train.stepz=3")
    assert result.returncode == 2
    assert result.stderr.strip() == (
        "dtrain: error: unknown config key train.stepz (did you mean train.steps?)"
    )


def test_train_end_to_end_through_the_launcher(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    config = write_tiny_config(tmp_path / "tiny.toml", run_dir)
    result = run_cli("train", str(config), "--nproc", "2")
    assert result.returncode == 0, result.stderr[-3000:]
    assert (run_dir / "config.toml").exists()
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["kind"] == "train"]
    assert [r["step"] for r in train] == [2, 4, 6]
    assert all(r["tokens_per_s"] > 0 for r in train)
    assert [r["step"] for r in records if r["kind"] == "eval"] == [3, 6]
    final = run_dir / "checkpoints" / "step-00000006"
    assert (final / "COMMITTED.json").exists()
    state = torch.load(final / "model.pt", weights_only=True)
    assert "blocks.0.attn.qkv.weight" in state
    meta = json.loads((final / "meta.json").read_text())
    assert meta["world_size"] == 2 and meta["step"] == 6
    assert "done: 6 steps" in result.stdout
    # Resumed for 2 more steps: its rate is this run's items over this run's time (it counted
    # all 8 steps' over the 2 steps' time: 4x too high).
    result = run_cli("train", str(config), "--nproc", "2", "--train.steps=8")
    assert result.returncode == 0, result.stderr[-3000:]
    took = re.search(r"done: 8 steps \(2 this run\) on 2 rank\(s\) in ([\d.]+)s", result.stdout)
    rate = re.search(r"([\d.]+)(k?) tokens/s overall", result.stdout)
    assert took and rate, result.stdout
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    seen = {r["step"]: r["items_seen"] for r in records if r["kind"] == "train"}
    said = float(rate[1]) * (1000 if rate[2] else 1) * float(took[1])
    assert 0.5 < said / (seen[8] - seen[6]) < 2, (said, seen)


def test_worker_side_user_error_is_one_line_and_exit_2(tmp_path: Path) -> None:
    # A dataset folder that does not exist is found by the workers, after launch. With
    # --node-rank 0 on one machine (no --rdzv-endpoint), which was a ValueError traceback in
    # the launcher before any worker started.
    result = run_cli(
        "train",
        "--nproc",
        "1",
        "--node-rank",
        "0",
        f"--run.dir={tmp_path / 'r'}",
        "--task.data_dir=/no/such/data",
    )
    assert result.returncode == 2, result.stderr[-2000:]
    assert "rank 0: dataset folder /no/such/data/train does not exist" in result.stderr
    assert "Traceback" not in result.stderr


def test_a_global_batch_larger_than_the_training_set_is_one_line(tmp_path: Path) -> None:
    # It passed every check and grew rank 0 (its plan of 16 batches of 10^8 ids, then the
    # batch) until the kernel killed it. The training set's size exists once the task is
    # built: each worker refuses it before the model is spread or a step is planned.
    config = write_tiny_config(tmp_path / "tiny.toml", tmp_path / "run")
    result = run_cli("train", str(config), "--nproc", "1", "--data.global_batch_size=100000000")
    assert result.returncode == 2, result.stderr[-2000:]
    assert (
        "rank 0: data.global_batch_size = 100000000 is more than the training set's 64 "
        "samples: one step would take some samples twice (and every rank hold its share of "
        "them at once); use at most 64"
    ) in result.stderr, result.stderr[-2000:]
    assert "Traceback" not in result.stderr
    from dtrain.data.build import check_batch_fits

    check_batch_fits(64, 64)  # the whole training set in one step is a batch like any other


def test_plain_torchrun_runs_the_worker_module(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    config = write_tiny_config(tmp_path / "tiny.toml", run_dir)
    torchrun = Path(sys.executable).parent / "torchrun"
    result = subprocess.run(
        [
            str(torchrun),
            "--standalone",
            "--nproc-per-node",
            "2",
            "-m",
            "dtrain.worker",
            str(config),
            "--train.steps=4",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert (run_dir / "checkpoints" / "step-00000004" / "COMMITTED.json").exists()
    meta = json.loads((run_dir / "checkpoints" / "step-00000004" / "meta.json").read_text())
    assert meta["world_size"] == 2


_QUIET = """
import datetime, logging, sys
from dtrain.cli import quiet_launcher_store_logs
quiet_launcher_store_logs()
import torch.distributed as dist
try:  # nothing listens there: torch's C++ client logs each failed try, with a stack trace
    dist.TCPStore("127.0.0.1", int(sys.argv[1]), is_master=False,
                  timeout=datetime.timedelta(seconds=1), wait_for_workers=False)
except Exception as exc:
    print("raised", type(exc).__name__)
from dtrain.launch.reports import ExpectedAtExit
record = logging.LogRecord("r", logging.WARNING, "", 0,
    "The node 'x' has failed to shutdown the rendezvous 'job' due to an error", (), None)
print("kept" if ExpectedAtExit().filter(record) else "dropped")
"""


def test_the_launcher_prints_no_cpp_stack_trace_for_its_store() -> None:
    # At the end of a successful multi-machine run the machine that hosts the rendezvous may
    # exit first; the others' close of the rendezvous then failed with a C++ stack trace of
    # some 30 frames and torch's warning (4 of 14 two-node Slurm jobs).
    from dtrain.launch.agent import held_port

    with held_port() as port:  # nothing listens there, and no one else can
        result = subprocess.run(
            [sys.executable, "-c", _QUIET, str(port)],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert result.stdout.split() == ["raised", "DistNetworkError", "dropped"], result.stderr
    assert "frame #" not in result.stderr and "TCPStore" not in result.stderr, result.stderr


def test_an_output_path_through_a_file_is_one_line(
    observed_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # export, report and prepare each made their output folder with a bare mkdir: a path
    # through a file was a NotADirectoryError/FileExistsError traceback (after the work).
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder\n")
    source = tmp_path / "book.txt"
    source.write_text("some text\n")
    cases = [
        (["export", str(observed_run), str(blocker / "model.safetensors")], "OUT"),
        (["report", str(observed_run), "--out", str(blocker / "report")], "report folder"),
        (["prepare", str(source), str(blocker / "data")], "output folder"),
    ]
    for args, label in cases:
        assert main(args) == 2, args
        err = capsys.readouterr().err
        said = f"{label} {blocker}/"
        assert err.startswith(f"dtrain: error: {said}") and err.count("\n") == 1, err
        assert f"{blocker} is a file, not a folder; choose another path" in err
    assert blocker.read_text() == "not a folder\n"


def test_a_reader_that_leaves_early_gets_no_traceback() -> None:
    # `dtrain status RUN | head -3`: the pipe closed before dtrain wrote; it printed a
    # BrokenPipeError traceback.
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        result = subprocess.run(
            [sys.executable, "-m", "dtrain", "config", "--list"],
            cwd=REPO,
            stdout=write_end,
            stderr=subprocess.PIPE,
            text=True,
            timeout=120,
        )
    finally:
        os.close(write_end)
    assert result.returncode == 128 + signal.SIGPIPE, result.stderr
    assert result.stderr == ""
