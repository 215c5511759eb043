"""Resuming with something that does not fit: each gets one clear line and exit code 2."""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

import pytest

from dtrain.cli import main
from dtrain.config import Config
from dtrain.config.resume import config_differences
from tests.test_cli import run_cli, write_tiny_config


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    tmp = tmp_path_factory.mktemp("resume")
    run_dir = tmp / "run"
    config = write_tiny_config(tmp / "tiny.toml", run_dir)
    result = run_cli("train", str(config), "--nproc", "1")
    assert result.returncode == 0, result.stderr[-2000:]
    return config, run_dir


def test_a_different_config_is_refused_with_the_differing_keys(
    finished_run: tuple[Path, Path],
) -> None:
    config, _ = finished_run
    result = run_cli("train", str(config), "--nproc", "1", "--task.d_model=48", "--optim.lr=0.5")
    assert result.returncode == 2
    assert "was made with a different config" in result.stderr
    assert "task.d_model: 32 -> 48" in result.stderr
    assert "optim.lr: 0.005 -> 0.5" in result.stderr
    assert "--force" in result.stderr and "Traceback" not in result.stderr


def test_a_key_only_one_config_has_is_a_difference() -> None:
    # Every config a run saves holds every key: one missing, or one this version does not
    # know, is a change like any other (no format before this one is read).
    current = Config().to_dict()
    older = copy.deepcopy(current)
    assert config_differences(older, current) == []
    del older["comm"]["local_start_step"]
    assert config_differences(older, current) == ["comm.local_start_step: '(unset)' -> 0"]
    older = copy.deepcopy(current)
    older["data"]["balance"] = older["data"].pop("split")
    assert config_differences(older, current) == [
        "data.balance: 'auto' -> '(unset)'",
        "data.split: '(unset)' -> 'auto'",
    ]


def test_ddp_resumes_under_pipeline_with_other_micro_batches_without_force(
    finished_run: tuple[Path, Path], tmp_path: Path
) -> None:
    """The data position is one count of samples, whatever the micro-batches: a change of
    data.micro_batches (which a pipeline needs) needs no --force, and the resumed run goes on
    from the checkpoint's position. (A copy: the other tests read the finished run.)"""
    config, run_dir = finished_run
    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy)
    result = run_cli(
        "train",
        str(config),
        "--nproc",
        "2",
        f"--run.dir={copy}",
        "--strategy.name=pipeline",
        "--data.micro_batches=2",
        "--train.steps=8",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    meta = json.loads((copy / "checkpoints" / "step-00000008" / "meta.json").read_text())
    assert meta["strategy"] == "pipeline" and meta["world_size"] == 2
    assert meta["data"]["consumed"] == 8 * 8  # 6 steps of 8 samples under ddp, then 2 more
    records = [json.loads(line) for line in (copy / "metrics.jsonl").read_text().splitlines()]
    resumed = [r for r in records if r["kind"] == "event" and r["name"] == "resumed"]
    assert [(r["step"], r["checkpoint"]) for r in resumed] == [(6, "step-00000006")]
    # What does change what is trained still needs --force.
    changed = Config()
    changed.data.micro_batches = 4
    assert config_differences(Config().to_dict(), changed.to_dict()) == []
    changed.data.global_batch_size = 32
    assert config_differences(Config().to_dict(), changed.to_dict()) == [
        "data.global_batch_size: 16 -> 32"
    ]


def test_forced_resume_of_a_different_model_lists_keys_and_shapes(
    finished_run: tuple[Path, Path],
) -> None:
    config, _ = finished_run
    result = run_cli("train", str(config), "--nproc", "1", "--task.d_model=48", "--force")
    assert result.returncode == 2
    assert "is from a different model" in result.stderr
    assert "blocks.0.ln2.weight: checkpoint (32,), model (48,)" in result.stderr
    assert "Traceback" not in result.stderr


def test_forced_resume_with_another_seed_says_which(finished_run: tuple[Path, Path]) -> None:
    config, _ = finished_run
    result = run_cli("train", str(config), "--nproc", "1", "--run.seed=7", "--force")
    assert result.returncode == 2
    assert "run.seed" in result.stderr and "0" in result.stderr and "7" in result.stderr


def test_a_checkpoint_folder_that_does_not_exist(
    finished_run: tuple[Path, Path], tmp_path: Path
) -> None:
    config, run_dir = finished_run
    missing = run_dir / "checkpoints" / "step-00000099"
    result = run_cli("train", str(config), "--nproc", "1", "--resume", str(missing))
    assert result.returncode == 2
    assert result.stderr.strip() == f"dtrain: error: checkpoint folder {missing} does not exist"
    # Into a new run folder: refused before the folder is made (it was left behind, empty).
    new = tmp_path / "new"
    args = ("train", str(config), "--nproc", "1", f"--run.dir={new}", "--resume", str(missing))
    result = run_cli(*args)
    assert result.returncode == 2
    assert result.stderr.strip() == f"dtrain: error: checkpoint folder {missing} does not exist"
    assert not new.exists()
    # A step folder's name alone is a path from the working folder: the one in the run's
    # checkpoints/ is named.
    held = sorted((run_dir / "checkpoints").glob("step-*"))[-1]
    result = run_cli("train", str(config), "--nproc", "1", "--resume", held.name)
    assert result.returncode == 2
    assert result.stderr.strip() == (
        f"dtrain: error: checkpoint folder {held.name} does not exist: did you mean {held}?"
    )


def test_starting_afresh_over_checkpoints_needs_force(finished_run: tuple[Path, Path]) -> None:
    config, _ = finished_run
    result = run_cli("train", str(config), "--nproc", "1", "--resume", "never")
    assert result.returncode == 2
    assert "already holds checkpoints" in result.stderr


def test_a_run_folder_given_as_the_checkpoint_names_its_step_folders(
    finished_run: tuple[Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    # It said "RUN_DIR has no COMMITTED.json: the save did not finish", as for a broken step.
    config, run_dir = finished_run
    newest = run_dir / "checkpoints" / "step-00000006"
    for given in (run_dir, run_dir / "checkpoints"):
        assert main(["train", str(config), "--nproc", "1", "--resume", str(given)]) == 2
        err = capsys.readouterr().err
        assert err == (
            f"dtrain: error: run.resume = '{given}' holds checkpoints but is none itself: give "
            f"one of its step folders ({newest}, its newest), or run.resume = 'auto' with that "
            "run's run.dir\n"
        )
