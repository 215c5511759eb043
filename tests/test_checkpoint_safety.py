"""Checkpoints are data, never code. A crafted file in a checkpoint -- DCP's ``.metadata``, an
item in a DCP shard, a whole file such as ``optimizer.pt`` -- whose completion marker an attacker
re-sealed with dtrain's own digest functions (they are unkeyed), so that it verifies, is refused
with one line naming it at every entry point: ``dtrain export``, ``run.init_from`` of a run
folder and of a step folder, ``dtrain.load_weights``, resume under the strategy that saved it and
under another. The command it carries never runs: each crafted file is first shown to run it
when unpickled as torch's own readers would (so the test can fail), then never again.

Most entry points are called as functions in this process (the code path is the same); resume
runs once, in one launch of two ranks trying every crafted run folder in turn. A NaN rollback
loads its checkpoint through the same functions as resume (``checkpoint.state.load`` ->
``sharded_index`` / ``load_sharded`` / ``load_file``), which the unit-level cases call directly.
"""

from __future__ import annotations

import builtins
import io
import json
import os
import pickle
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

import dtrain
from dtrain.checkpoint import layout
from dtrain.checkpoint import read as ckread
from dtrain.checkpoint.stream import PieceHasher, file_entry
from dtrain.cli import main
from dtrain.errors import CheckpointError, UserError
from dtrain.models.gpt import GPT, GPTConfig
from dtrain.weights.init_from import init_model, read_weights
from tests.conftest import tiny_raw
from tests.hf_helpers import train_each
from tests.ranks import run_ranks

STEP = layout.step_dir_name(2)
# How torch.load(weights_only=True) names builtins.exec when it refuses it.
EXEC = "exec"
SECTIONS: dict[str, dict[str, object]] = {
    "data": {"global_batch_size": 8},
    "train": {"steps": 2, "log_every": 1},
    "checkpoint": {"every": 2},
}


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two genuine run folders, ``fsdp`` (DCP shards) and ``ddp`` (whole files), each with a
    checkpoint at step 2, trained in one launch of two ranks."""
    root = tmp_path_factory.mktemp("saved")
    raws = [tiny_raw(root / name, strategy={"name": name}, **SECTIONS) for name in ("fsdp", "ddp")]
    for result in run_ranks(train_each, 2, raws)[0]:
        assert "error" not in result, result
    return root


def tiny_model() -> torch.nn.Module:
    """The model of tests.tasks:tiny_gpt at its defaults (what the saved runs trained)."""
    return GPT(GPTConfig(vocab_size=64, seq_len=16, n_layer=2, n_head=2, d_model=32))


def copy_run(saved: Path, name: str, to: Path) -> tuple[Path, Path]:
    """A copy of the saved run ``name`` at ``to``: (the run folder, its step folder)."""
    shutil.copytree(saved / name, to)
    return to, to / "checkpoints" / STEP


# ---------------------------------------------------------------------------------------------
# Crafting


class RunsCommand:
    """Unpickled, runs ``touch PATH`` through the shell (``posix.system``)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (f"touch {self.path}",))


class RunsPython:
    """Unpickled, runs Python that creates ``PATH`` (``builtins.exec``)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, ...]:
        return (builtins.exec, (f"open({str(self.path)!r}, 'w').close()",))


def reseal(step_dir: Path) -> None:
    """What an attacker does after changing files: recompute every entry of the completion
    marker and its own digest with dtrain's functions, so that the folder verifies."""
    marker = json.loads((step_dir / layout.MARKER).read_text())
    for name in marker["files"]:
        hasher = PieceHasher()
        hasher.update((step_dir / name).read_bytes())
        marker["files"][name] = file_entry(hasher)
    marker["marker_sha256"] = layout.marker_digest(marker)
    (step_dir / layout.MARKER).write_text(json.dumps(marker))
    ckread.verify_checkpoint(step_dir)  # it passes: only the reader can stop it


def armed(data: bytes, touched: Path, load: Any) -> bytes:
    """``data``, after checking that ``load`` (how torch's own reader reads it) runs its
    command: without that, a test that the command never runs could not fail."""
    load(io.BytesIO(data))
    assert touched.exists(), "the crafted file does not run its command"
    touched.unlink()
    return data


def metadata_path(step_dir: Path) -> Path:
    return step_dir / layout.SHARDED_DIR / ".metadata"


def genuine_metadata(step_dir: Path) -> Any:
    with open(metadata_path(step_dir), "rb") as fh:
        return pickle.load(fh)  # our own file, just written by the fixture's run


def craft_metadata(step_dir: Path, touched: Path) -> None:
    """``.metadata`` that runs ``touch`` and then is the real metadata (the command's exit
    status rides along as one more attribute, which DCP ignores)."""
    metadata = genuine_metadata(step_dir)
    metadata.__dict__["note"] = RunsCommand(touched)
    metadata_path(step_dir).write_bytes(armed(pickle.dumps(metadata), touched, pickle.load))
    reseal(step_dir)


def byte_items(step_dir: Path) -> list[str]:
    """The keys of the non-tensor items of the sharded state (the optimizer's settings)."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    items = genuine_metadata(step_dir).state_dict_metadata
    return sorted(key for key, item in items.items() if isinstance(item, BytesStorageMetadata))


def craft_item(step_dir: Path, key: str, touched: Path) -> str:
    """The item ``key`` replaced by one that runs Python: appended to the shard file that held
    it, and the (genuine) metadata pointed at it. Returns the shard file's name."""
    payload = io.BytesIO()
    torch.save(RunsPython(touched), payload)
    load = lambda f: torch.load(f, weights_only=False)  # noqa: E731  (torch's own planner's)
    data = armed(payload.getvalue(), touched, load)
    metadata = genuine_metadata(step_dir)
    index = next(i for i in metadata.storage_data if i.fqn == key)
    info = metadata.storage_data[index]
    shard = step_dir / layout.SHARDED_DIR / info.relative_path
    info.offset, info.length = shard.stat().st_size, len(data)
    with open(shard, "ab") as fh:
        fh.write(data)
    metadata_path(step_dir).write_bytes(pickle.dumps(metadata))
    reseal(step_dir)
    return str(info.relative_path)


def craft_whole_file(step_dir: Path, name: str, touched: Path) -> None:
    """A whole file (``model.pt``, ``optimizer.pt``) that runs Python when torch loads it."""
    buffer = io.BytesIO()
    torch.save({"state": RunsPython(touched)}, buffer)
    load = lambda f: torch.load(f, weights_only=False)  # noqa: E731
    (step_dir / name).write_bytes(armed(buffer.getvalue(), touched, load))
    reseal(step_dir)


def point_entry_at(step_dir: Path, relative_path: str) -> None:
    """The (genuine) metadata's first storage entry pointed at ``relative_path``."""
    metadata = genuine_metadata(step_dir)
    next(iter(metadata.storage_data.values())).relative_path = relative_path
    metadata_path(step_dir).write_bytes(pickle.dumps(metadata))
    reseal(step_dir)


def one_line_error(call: Any, *args: Any, kind: type[Exception] = CheckpointError) -> str:
    with pytest.raises(kind) as caught:
        call(*args)
    message = str(caught.value)
    assert "\n" not in message, message
    return message


# ---------------------------------------------------------------------------------------------
# In this process


def test_a_crafted_metadata_is_refused_at_every_entry_point(
    saved: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    touched = tmp_path / "RAN"
    run, step = copy_run(saved, "fsdp", tmp_path / "run")
    model = dtrain.load_weights(tiny_model(), run)  # genuine: read as data, the same model
    assert torch.equal(model.state_dict()["tok_emb.weight"], read_weights(step)["tok_emb.weight"])
    craft_metadata(step, touched)
    refusal = (
        f"dcp/.metadata in {step} is not a checkpoint's metadata: it tries to load "
        "posix.system; dtrain loads only tensors and plain data"
    )
    assert main(["export", str(run), str(tmp_path / "out.safetensors")]) == 2
    assert capsys.readouterr().err == f"dtrain: error: {refusal}\n"
    for path in (run, step):  # run.init_from of the run folder and of the step folder
        assert refusal in one_line_error(init_model, tiny_model(), str(path))
    assert refusal in one_line_error(dtrain.load_weights, tiny_model(), run)
    # What resume (and a NaN rollback) reads first, under any strategy: fsdp's, tensor's,
    # pipeline's own load and a replica's read of shards all start here.
    assert refusal in one_line_error(ckread.sharded_index, step)
    assert not touched.exists()
    assert not (tmp_path / "out.safetensors").exists()


# load_sharded here runs without a process group, as DCP warns (the ranks' run is below).
@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_crafted_item_in_a_shard_is_refused(saved: Path, tmp_path: Path) -> None:
    touched = tmp_path / "RAN"
    run, step = copy_run(saved, "fsdp", tmp_path / "run")
    key = next(k for k in byte_items(step) if k.startswith("optimizer.param_groups.0."))
    shard = craft_item(step, key, touched)
    # What resume and a rollback read the optimizer's settings with (the replica's read of
    # shards too): the non-tensor items, loaded as plain data or refused.
    template: dict[str, Any] = {key: None for key in byte_items(step)}
    message = one_line_error(ckread.load_sharded, step, template)
    assert message == (
        f"dcp/{shard} in {step} is not a checkpoint's data: its item {key} tries to load "
        f"{EXEC}; dtrain loads only tensors and plain data"
    )
    # Export reads the model's tensors only: it never loads the item.
    dtrain.load_weights(tiny_model(), run)
    assert not touched.exists()


def test_a_storage_entry_may_name_only_a_listed_file_of_the_folder(
    saved: Path, tmp_path: Path
) -> None:
    _, step = copy_run(saved, "fsdp", tmp_path / "run")
    for where in ("../meta.json", "/etc/hostname", "sub/__0_0.distcp", ".."):
        point_entry_at(step, where)
        message = one_line_error(ckread.sharded_index, step)
        assert f"points at {where!r}, not a file in dcp/" in message, message
    # A plain name, but of a file the marker does not list (so nothing verified it).
    shutil.copy(step / "dcp" / "__0_0.distcp", step / "dcp" / "__7_0.distcp")
    point_entry_at(step, "__7_0.distcp")
    message = one_line_error(ckread.sharded_index, step)
    assert "points at '__7_0.distcp', a file the completion marker does not list" in message


def test_a_crafted_whole_file_is_refused_in_one_line(
    saved: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    touched = tmp_path / "RAN"
    run, step = copy_run(saved, "ddp", tmp_path / "run")
    # optimizer.pt: what a replica's resume and a sharded strategy's read of whole files
    # (checkpoint.model_state, checkpoint.cross_form) load it with, and a rollback the same way.
    craft_whole_file(step, layout.OPTIMIZER_FILE, touched)
    assert one_line_error(ckread.load_file, step, layout.OPTIMIZER_FILE) == (
        f"optimizer.pt in {step} is not a checkpoint's data: it tries to load {EXEC}; "
        "dtrain loads only tensors and plain data"
    )
    craft_whole_file(step, layout.MODEL_FILE, touched)
    refusal = f"model.pt in {step} is not a checkpoint's data: it tries to load {EXEC}"
    assert main(["export", str(run), str(tmp_path / "out.pt"), "--format", "torch"]) == 2
    err = capsys.readouterr().err
    assert refusal in err and err.count("\n") == 1, err
    for path in (run, step):
        assert refusal in one_line_error(init_model, tiny_model(), str(path))
    assert refusal in one_line_error(dtrain.load_weights, tiny_model(), step)
    # run.init_from of a weights file (not a checkpoint) is read the same way.
    weights = tmp_path / "weights.pt"
    shutil.copy(step / layout.MODEL_FILE, weights)
    message = one_line_error(read_weights, weights, kind=UserError)
    assert f"{weights} is not a torch file of tensors: it tries to load {EXEC}" in message
    assert not touched.exists()


def test_init_from_reads_only_a_committed_checkpoint_and_the_files_its_marker_lists(
    saved: Path, tmp_path: Path
) -> None:
    _, step = copy_run(saved, "ddp", tmp_path / "run")
    # A half-written save (here even with a marker that verifies: a copy) never counts.
    tmp = step.with_name(f".tmp-{STEP}")
    shutil.copytree(step, tmp)
    message = one_line_error(init_model, tiny_model(), str(tmp))
    assert f"{tmp} is a checkpoint whose save did not finish" in message
    # A checkpoint folder without its marker, under its own name or another.
    for name in (layout.step_dir_name(3), "best"):
        bare = shutil.copytree(step, tmp_path / name)
        (bare / layout.MARKER).unlink()
        message = one_line_error(init_model, tiny_model(), str(bare))
        assert f"{bare} has no COMMITTED.json: the save did not finish" in message
    # A marker that does not verify its own digest.
    marker = json.loads((step / layout.MARKER).read_text())
    (step / layout.MARKER).write_text(json.dumps({**marker, "world_size": 5}))
    assert "fails its own SHA-256 checksum" in one_line_error(init_model, tiny_model(), str(step))
    (step / layout.MARKER).write_text(json.dumps(marker))
    # A file the marker does not list is no part of the checkpoint: a replica dropped beside
    # model.pt is not averaged into the weights.
    saved_model = ckread.load_file(step, layout.MODEL_FILE)
    zeros = {key: torch.zeros_like(value) for key, value in saved_model.items()}
    torch.save(zeros, step / "model-rank00001.pt")
    assert torch.equal(read_weights(step)["tok_emb.weight"], saved_model["tok_emb.weight"])


# ---------------------------------------------------------------------------------------------
# Resume, in the ranks


def test_resume_refuses_crafted_files_under_the_same_and_another_strategy(
    saved: Path, tmp_path: Path
) -> None:
    touched = tmp_path / "RAN"
    cases: list[tuple[str, str, str]] = []  # (run folder, strategy resuming it, the refusal)
    for strategy in ("fsdp", "ddp"):  # the same strategy, and a replica reading fsdp's shards
        run, step = copy_run(saved, "fsdp", tmp_path / f"metadata-{strategy}")
        craft_metadata(step, touched)
        cases.append((str(run), strategy, f"dcp/.metadata in {step} is not a checkpoint's"))
        run, step = copy_run(saved, "fsdp", tmp_path / f"item-{strategy}")
        key = next(k for k in byte_items(step) if k.startswith("optimizer.param_groups.0."))
        shard = craft_item(step, key, touched)
        cases.append((str(run), strategy, f"dcp/{shard} in {step} is not a checkpoint's data"))
    for strategy in ("ddp", "fsdp"):  # whole files: the same strategy, and shards cut from them
        run, step = copy_run(saved, "ddp", tmp_path / f"optimizer-{strategy}")
        craft_whole_file(step, layout.OPTIMIZER_FILE, touched)
        cases.append((str(run), strategy, f"optimizer.pt in {step} is not a checkpoint's data"))
    raws = [
        tiny_raw(Path(run), strategy={"name": strategy}, **{**SECTIONS, "train": {"steps": 4}})
        for run, strategy, _ in cases
    ]
    for rank, results in enumerate(run_ranks(train_each, 2, raws)):
        for (run, strategy, refusal), result in zip(cases, results, strict=True):
            error = result.get("error", "")
            assert refusal in error and "\n" not in error, (rank, run, strategy, result)
    assert not touched.exists()
