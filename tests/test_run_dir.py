"""Where a run goes when its config names no folder: one rule for ``dtrain train`` and for plain
``torchrun -m dtrain.worker`` (the README shows both)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from dtrain.train.job import default_run_dir
from tests.conftest import REPO

CONFIG = """\
[run]
task = "tests.tasks:tiny_gpt"
[data]
global_batch_size = 8
[train]
steps = 4
log_every = 2
[eval]
every = 0
[task]
samples = 64
"""


def test_the_default_run_folder_is_named_by_the_job_id_or_the_time() -> None:
    assert default_run_dir("myjob") == os.path.join("runs", "myjob")
    # torchrun without --rdzv-id calls every job "none": that names no job.
    for no_id in ("", "none"):
        assert re.fullmatch(r"runs/\d{8}-\d{6}", default_run_dir(no_id)), default_run_dir(no_id)


def _run_folders(cwd: Path) -> list[Path]:
    runs = cwd / "runs"
    return sorted(runs.iterdir()) if runs.exists() else []


def _run_in(cwd: Path, *module_and_args: str) -> None:
    """``python -m ...`` in ``cwd`` (not the repository: the default folder is relative), with
    the repository on the path for the task ``tests.tasks:tiny_gpt``; it must succeed."""
    (cwd / "job.toml").write_text(CONFIG)
    proc = subprocess.run(
        [sys.executable, "-m", *module_and_args],
        cwd=cwd,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_plain_torchrun_without_a_run_dir_trains_into_one_folder(tmp_path: Path) -> None:
    # The bug: worker.py defined its default run folder after `sys.exit(main())`, so this
    # command died with "NameError: name 'default_run_dir' is not defined" on every rank.
    torchrun = ("torch.distributed.run", "--standalone", "--nproc-per-node", "2")
    _run_in(tmp_path, *torchrun, "-m", "dtrain.worker", "job.toml")
    # Both ranks wrote into one folder, named by the job's rendezvous id, and it holds the run.
    (run_dir,) = _run_folders(tmp_path)
    assert (run_dir / "metrics.jsonl").exists()
    assert (run_dir / "checkpoints" / "step-00000004" / "COMMITTED.json").exists()
    assert f'dir = "{run_dir.relative_to(tmp_path)}"' in (run_dir / "config.toml").read_text()


def test_dtrain_train_with_a_run_id_and_no_run_dir_uses_runs_slash_the_id(tmp_path: Path) -> None:
    _run_in(tmp_path, "dtrain", "train", "job.toml", "--nproc", "1", "--run-id", "myjob")
    assert _run_folders(tmp_path) == [tmp_path / "runs" / "myjob"]
    assert (tmp_path / "runs" / "myjob" / "checkpoints" / "step-00000004").is_dir()
