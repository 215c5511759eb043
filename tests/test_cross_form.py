"""A replicated strategy's whole files (model.pt, optimizer.pt) resumed by a sharded one: the
same parameters as a run that never changed strategy, and a clear line where it cannot be."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dtrain.checkpoint import layout
from dtrain.checkpoint.cross_form import optimizer_state_by_name
from dtrain.checkpoint.forms import NAMES_KEY
from dtrain.errors import CheckpointError
from tests.conftest import tiny_raw
from tests.dist_helpers import crash_then_resume, train_params
from tests.matrix import OPTIMIZERS, STRATEGIES, WHOLE_FILES_TO_SHARDS, Resume, cases
from tests.ranks import run_ranks
from tests.test_cli import run_cli, write_tiny_config
from tests.test_ddp import assert_params_close

DATA = {"global_batch_size": 8, "micro_batches": 2}
SECTIONS: dict[str, dict[str, object]] = {
    "train": {"steps": 4, "log_every": 1},
    "checkpoint": {"every": 2},
}


def resume_equals_unchanged(tmp_path: Path, row: Resume) -> None:
    """Train 2 steps under ``row.saved_by``, crash, resume the 2 more under ``row.resumed_by``:
    the parameters are those of a ``resumed_by`` run that never changed strategy."""
    saved_by, resumed_by = STRATEGIES[row.saved_by], STRATEGIES[row.resumed_by]
    optim = OPTIMIZERS[row.optim]
    sections = {**SECTIONS, "optim": optim}
    reference = run_ranks(
        train_params,
        row.ranks,
        tiny_raw(tmp_path / "ref", data=DATA, strategy=resumed_by, **sections),
    )
    saved = tiny_raw(tmp_path / "run", data=DATA, strategy=saved_by, **sections)
    resumed = tiny_raw(tmp_path / "run", data=DATA, strategy=resumed_by, **sections)
    result = run_ranks(crash_then_resume, row.ranks, saved, 3, resumed)[0]
    assert result["start_step"] == 2
    # The optimizer's state carried over (lost, the parameters differ by ~lr, or ~lr x
    # momentum). Under AdamW within 1e-5 absolute: the attention's key bias has a
    # roundoff-only gradient, which AdamW's normalization turns into a step of up to lr in a
    # direction the last bit picks (the strategies round differently).
    assert_params_close(reference[0], result["params"], rtol=1e-5, atol=1e-5 if optim else 1e-6)
    if optim:  # each group kept its weight decay through the regrouping
        assert sorted({s["weight_decay"] for s in result["settings"]}) == [0.0, 0.1]


@pytest.mark.parametrize("row", cases(WHOLE_FILES_TO_SHARDS))
def test_whole_files_resume_under_a_sharded_strategy(tmp_path: Path, row: Resume) -> None:
    # It was refused before launch: optimizer.pt keyed its state by position only.
    resume_equals_unchanged(tmp_path, row)
    assert (tmp_path / "run" / "checkpoints" / "step-00000002" / layout.MODEL_FILE).exists()


def test_an_optimizer_file_without_names_is_one_clear_line(tmp_path: Path) -> None:
    # Saved by an earlier dtrain: positions only, nothing to key the shards by.
    param = torch.nn.Parameter(torch.ones(2, 2))
    optimizer = torch.optim.SGD([param], lr=0.1, momentum=0.9)
    param.grad = torch.ones(2, 2)
    optimizer.step()
    saved = optimizer.state_dict()
    with pytest.raises(CheckpointError, match=r"does not name its parameters .* resume it once"):
        optimizer_state_by_name(saved, tmp_path)
    state, groups = optimizer_state_by_name({**saved, NAMES_KEY: [["w"]]}, tmp_path)
    assert list(state) == ["w"] and groups[0]["params"] == ["w"]
    assert torch.equal(state["w"]["momentum_buffer"], torch.ones(2, 2))


def test_a_resume_under_another_strategy_says_so(tmp_path: Path) -> None:
    # Through the CLI: ddp saves at steps 3 and 6, fsdp goes on from step 6 and says whose
    # checkpoint it read (a strategy changed by mistake shows too).
    config = write_tiny_config(tmp_path / "tiny.toml", tmp_path / "run")
    assert run_cli("train", str(config), "--nproc", "1").returncode == 0
    result = run_cli(
        "train", str(config), "--nproc", "1", "--strategy.name=fsdp", "--train.steps=8"
    )
    assert result.returncode == 0, result.stderr[-2000:]
    said = result.stdout + result.stderr
    assert "training fsdp on 1 rank(s), cpu, resumed from step-00000006" in said
    assert (
        "step-00000006 was saved by strategy 'ddp'; fsdp read its model and optimizer state\n"
    ) in said
