"""Resuming with something that does not fit: each gets one clear line and exit code 2."""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

import pytest
import torch

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


def test_a_strategy_that_cannot_load_the_checkpoint_is_refused_before_the_workers(
    finished_run: tuple[Path, Path], tmp_path: Path
) -> None:
    # strategy.* may change on resume, but whole files from before optimizer.pt named its
    # parameters (an earlier dtrain: positions only) load into a replica only: each worker
    # refused the checkpoint only after the whole start-up.
    _, run_dir = finished_run
    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy)
    step_dir = max((copy / "checkpoints").glob("step-*"))
    optimizer = torch.load(step_dir / "optimizer.pt", weights_only=True)
    del optimizer["param_names"]
    torch.save(optimizer, step_dir / "optimizer.pt")
    config = write_tiny_config(tmp_path / "tiny.toml", copy)
    pipeline = ("--strategy.name=pipeline", "--strategy.pipeline_schedule=gpipe")
    result = run_cli("train", str(config), "--nproc", "2", *pipeline)
    assert result.returncode == 2
    assert "optimizer.pt does not name its parameters (saved by an earlier dtrain)" in (
        result.stderr
    )
    assert "resume it once with strategy.name = 'ddp'" in result.stderr
    assert "training pipeline" not in result.stdout + result.stderr  # no worker started
    assert "Traceback" not in result.stderr


SAVED_FORMS = ["ddp", "fsdp", "tensor", "pipeline"]


@pytest.mark.parametrize("saved", SAVED_FORMS)
def test_every_strategy_loads_every_form_of_checkpoint(tmp_path: Path, saved: str) -> None:
    # Whole files (ddp), torch's list of groups in shards (fsdp, tensor), settings per
    # parameter in shards (pipeline): each read by name by every other strategy (cross_form;
    # pipeline's were refused before launch, and pipeline loaded nothing else).
    from dtrain.checkpoint.state_form import check_state_form
    from dtrain.parallel import strategy_class, strategy_names

    step_dir = fake_checkpoint(tmp_path, saved, names=True)
    for resumed in strategy_names():
        check_state_form(resumed, strategy_class(resumed).state_form, step_dir)


def test_whole_files_without_parameter_names_load_into_a_replica_only(tmp_path: Path) -> None:
    from dtrain.checkpoint.state_form import check_state_form
    from dtrain.errors import CheckpointError
    from dtrain.parallel import strategy_class

    step_dir = fake_checkpoint(tmp_path, "ddp", names=False)
    for replicated in ("ddp", "allreduce", "localsgd", "diloco"):
        check_state_form(replicated, strategy_class(replicated).state_form, step_dir)
    for sharded in ("fsdp", "tensor", "pipeline"):
        with pytest.raises(CheckpointError, match=r"does not name its parameters .* 'ddp'"):
            check_state_form(sharded, strategy_class(sharded).state_form, step_dir)


def fake_checkpoint(tmp_path: Path, saved: str, *, names: bool) -> Path:
    """A checkpoint folder of ``saved``'s form, with what the launcher reads of it."""
    from dtrain.checkpoint import layout
    from dtrain.checkpoint.forms import NAMES_KEY

    step_dir = tmp_path / "step-00000004"
    step_dir.mkdir()
    if saved == "ddp":
        (step_dir / layout.MODEL_FILE).write_bytes(b"")
        state: dict[str, object] = {"state": {}, "param_groups": [{"params": [0]}]}
        torch.save({**state, NAMES_KEY: [["w"]]} if names else state, step_dir / "optimizer.pt")
    else:
        (step_dir / layout.SHARDED_DIR).mkdir()
    (step_dir / "meta.json").write_text(json.dumps({"step": 4, "strategy": saved}))
    return step_dir


def test_a_key_added_after_the_checkpoint_counts_as_its_default() -> None:
    # A checkpoint made before comm.local_start_step existed trained with its default (0):
    # resuming with the default is no change; with another value it is.
    current = Config().to_dict()
    older = copy.deepcopy(current)
    del older["comm"]["local_start_step"]
    assert config_differences(older, current) == []
    current["comm"]["local_start_step"] = 5
    assert config_differences(older, current) == ["comm.local_start_step: 0 -> 5"]


def test_a_renamed_key_is_compared_under_its_new_name() -> None:
    # A checkpoint made when data.split was data.balance resumes with the same value.
    current = Config().to_dict()
    older = copy.deepcopy(current)
    older["data"]["balance"] = older["data"].pop("split")
    assert config_differences(older, current) == []
    current["data"]["split"] = "samples"
    assert config_differences(older, current) == ["data.split: 'auto' -> 'samples'"]


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
