"""Weights in and out: ``dtrain export`` consolidates any strategy's checkpoint into the model's
own state dict (and, for a Hugging Face model, a folder ``from_pretrained`` loads);
``run.init_from`` starts a run from such weights; ``dtrain.load_weights`` loads them in Python.
Bad input is one line and exit code 2, and the run folder is only read."""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from examples import hf_gpt2

import dtrain
from dtrain.cli import main
from dtrain.errors import UserError
from dtrain.weights.export import write_safetensors
from dtrain.weights.init_from import check_init_from, read_weights, read_weights_said
from tests.conftest import tiny_raw
from tests.hf_helpers import (
    GPT2_TASK,
    gpt2_batches,
    hf_raw,
    logged_losses,
    logged_val_loss,
    train_each,
)
from tests.ranks import run_ranks

OPTS = hf_gpt2.GPT2Options(**GPT2_TASK)  # type: ignore[arg-type]


def plain_gpt2(weights: Path | None = None) -> torch.nn.Module:
    model = hf_gpt2.build_model(OPTS)
    if weights is not None:
        dtrain.load_weights(model, weights)
    return model.eval()


def val_loss(model: torch.nn.Module) -> float:
    """The mean loss over the example's validation set, in one process (as the run's own
    evaluation counts it: every token of labels[:, 1:])."""
    ids = hf_gpt2.PatternTokens(OPTS.val_size, OPTS.seq_len, OPTS.vocab, seed=1).ids
    with torch.no_grad():
        return float(model(input_ids=ids, labels=ids).loss)


def export(run_dir: Path, out: Path, *args: str) -> None:
    assert main(["export", str(run_dir), str(out), *args]) == 0


def assert_close(a: float, b: float) -> None:
    assert abs(a - b) <= 1e-6, (a, b)


def check_round_trip(root: Path, out: Path, fsdp_dir: Path) -> None:
    """The done-when: fsdp and pipeline runs, exported and loaded into a plain model in one
    process, evaluate as the runs evaluated themselves; the HF export loads with
    from_pretrained."""
    export(fsdp_dir, out / "fsdp.safetensors")
    export(fsdp_dir, out / "fsdp-hf", "--format", "hf")
    exported = plain_gpt2(out / "fsdp.safetensors")
    assert_close(val_loss(exported), logged_val_loss(fsdp_dir))
    from transformers import GPT2LMHeadModel

    pretrained = GPT2LMHeadModel.from_pretrained(str(out / "fsdp-hf")).eval()
    ids = gpt2_batches(1)[0]
    with torch.no_grad():
        assert torch.equal(pretrained(ids).logits, exported(ids).logits)
    export(root / "gpt2-pipeline", out / "pipeline.safetensors")
    assert_close(
        val_loss(plain_gpt2(out / "pipeline.safetensors")), logged_val_loss(root / "gpt2-pipeline")
    )


def test_fsdp_and_pipeline_export_round_trip(
    hf_runs: tuple[Path, dict[str, Any]], tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    root = hf_runs[0]
    capfd.readouterr()
    check_round_trip(root, tmp_path, root / "gpt2-fsdp")
    # One line per export; transformers' progress bar ("Writing model shards: 0%|") is not.
    assert "Writing model shards" not in capfd.readouterr().err


def test_a_tensor_parallel_gpt2_exports_and_starts_a_ddp_run_in_its_own_layout(
    hf_runs: tuple[Path, dict[str, Any]], tmp_path: Path
) -> None:
    """GPT-2 trained under tensor parallelism (c_attn cut by head: no box of the global
    tensor) checkpoints the model's own layout: its HF export loads with from_pretrained and
    evaluates as the run evaluated itself, and a ddp run started from its folder begins at
    that model's loss."""
    root = hf_runs[0]
    export(root / "gpt2-tensor", tmp_path / "tensor-hf", "--format", "hf")
    from transformers import GPT2LMHeadModel

    pretrained = GPT2LMHeadModel.from_pretrained(str(tmp_path / "tensor-hf")).eval()
    assert_close(val_loss(pretrained), logged_val_loss(root / "gpt2-tensor"))
    ids = gpt2_batches(1)[0]
    with torch.no_grad():
        first = float(pretrained(input_ids=ids, labels=ids).loss)
    assert_close(logged_losses(root / "init-tensor")[0], first)


@pytest.mark.slow
def test_fsdp_on_4_ranks_export_round_trip(
    hf_runs: tuple[Path, dict[str, Any]], tmp_path: Path
) -> None:
    fsdp_dir = tmp_path / "fsdp4"
    run_ranks(train_each, 4, [hf_raw(fsdp_dir, "gpt2", strategy={"name": "fsdp"})])
    check_round_trip(hf_runs[0], tmp_path, fsdp_dir)


def test_a_run_from_init_from_continues_from_the_same_loss(
    hf_runs: tuple[Path, dict[str, Any]],
) -> None:
    """A run started from the fsdp run's folder: its first step's loss is that model's on the
    batch (a fresh optimizer, the same weights); weights of another shape are one line."""
    root, results = hf_runs
    model = plain_gpt2(root / "gpt2-fsdp")
    ids = gpt2_batches(1)[0]
    with torch.no_grad():
        first = float(model(input_ids=ids, labels=ids).loss)
    assert_close(logged_losses(root / "init")[0], first)
    error = results["bad-init"]["error"]
    assert "run.init_from" in error and "does not fit GPT2LMHeadModel" in error
    assert "lm_head.weight: weights (64, 32), model (64, 16)" in error
    assert results["bad-init"]["step"] == 0 or results["bad-init"]["step"] is None


def test_export_of_every_replicated_and_tensor_layout(tmp_path: Path) -> None:
    """tensor DTensors, and localsgd replicas: equal at the final (synced) step, their mean
    between syncs; --format torch; --step N."""
    tensor = tiny_raw(
        tmp_path / "tensor",
        strategy={"name": "tensor", "tensor_parallel": 2},
        train={"steps": 4},
    )
    local = tiny_raw(
        tmp_path / "local",
        strategy={"name": "localsgd"},
        comm={"sync_every": 4},
        train={"steps": 6},
        checkpoint={"every": 3, "keep_last": 3},
    )
    diloco = tiny_raw(
        tmp_path / "diloco",
        strategy={"name": "diloco"},
        comm={"sync_every": 4},
        train={"steps": 6},
        checkpoint={"every": 3, "keep_last": 3},
    )
    results = run_ranks(train_each, 2, [tensor, local, diloco])[0]
    # An output name without a dot (torch's own writer refused the temporary ".tmp-tensor-PID").
    export(tmp_path / "tensor", tmp_path / "tensor-weights", "--format", "torch")
    state = torch.load(tmp_path / "tensor-weights", weights_only=True)
    assert state.keys() == results[0]["params"].keys()
    for key, value in results[0]["params"].items():
        assert np.array_equal(state[key].numpy(), value), key

    step3 = tmp_path / "local/checkpoints/step-00000003"
    replicas = [
        torch.load(step3 / name, weights_only=True) for name in ("model.pt", "model-rank00001.pt")
    ]
    assert not torch.equal(
        replicas[0]["blocks.0.attn.qkv.weight"], replicas[1]["blocks.0.attn.qkv.weight"]
    )
    export(tmp_path / "local", tmp_path / "local-3.safetensors", "--step", "3")
    mean = read_weights(tmp_path / "local-3.safetensors")
    torch.testing.assert_close(
        mean["blocks.0.attn.qkv.weight"],
        (replicas[0]["blocks.0.attn.qkv.weight"] + replicas[1]["blocks.0.attn.qkv.weight"]) / 2,
    )
    # diloco between outer steps: the anchor, the global model of the last outer step.
    export(tmp_path / "diloco", tmp_path / "diloco-3.safetensors", "--step", "3")
    outer = torch.load(tmp_path / "diloco/checkpoints/step-00000003/outer.pt", weights_only=True)
    anchor = read_weights(tmp_path / "diloco-3.safetensors")
    for key, value in outer["anchor"].items():
        assert torch.equal(anchor[key], value), key
    export(tmp_path / "local", tmp_path / "local.safetensors")
    final = torch.load(tmp_path / "local/checkpoints/step-00000006/model.pt", weights_only=True)
    for key, value in read_weights(tmp_path / "local.safetensors").items():
        assert torch.equal(value, final[key]), key


def test_bad_exports_are_one_line_and_leave_the_run_folder_alone(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run_dir = tmp_path / "run"
    unfinished = run_dir / "checkpoints" / "step-00000004"
    unfinished.mkdir(parents=True)
    (unfinished / "model.pt").write_bytes(b"half")
    before = sorted(p.relative_to(run_dir) for p in run_dir.rglob("*"))
    cases: list[tuple[list[str], str]] = [
        ([str(run_dir), str(tmp_path / "out")], "holds no committed checkpoint"),
        ([str(run_dir), str(tmp_path / "out"), "--step", "3"], "has no checkpoint of step 3"),
        ([str(tmp_path / "nothing"), str(tmp_path / "out")], "does not exist"),
    ]
    for args, message in cases:
        assert main(["export", *args]) == 2
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1, err
    assert sorted(p.relative_to(run_dir) for p in run_dir.rglob("*")) == before
    assert not (tmp_path / "out").exists()
    with pytest.raises(UserError, match="is no weights folder"):
        read_weights(tmp_path)
    # run.init_from that holds no weights: one line before any worker starts.
    train = ["train", f"--run.dir={tmp_path / 'new'}", f"--run.init_from={run_dir}"]
    assert main(train) == 2
    err = capsys.readouterr().err
    assert "run.init_from" in err and "holds no committed checkpoint" in err, err
    # A weights file of other bytes (it was each rank's error after launch, and the launcher's:
    # three lines); a real one passes the parent's check.
    for name, said in [("w.pt", "is not a torch file"), ("w.safetensors", "no header")]:
        (tmp_path / name).write_bytes(bytes(range(7, 250)))
        train = ["train", f"--run.dir={tmp_path / 'new'}", f"--run.init_from={tmp_path / name}"]
        assert main(train) == 2
        err = capsys.readouterr().err
        assert f"run.init_from = '{tmp_path / name}'" in err and said in err, err
        assert err.count("\n") == 1, err
    torch.save({"w": torch.ones(2)}, tmp_path / "w.pt")
    write_safetensors({"w": torch.ones(2)}, tmp_path / "w.safetensors")
    for name in ("w.pt", "w.safetensors"):
        check_init_from(str(tmp_path / name))
    assert not (tmp_path / "new").exists()
    with pytest.raises(SystemExit):
        main(["export", str(run_dir), str(tmp_path / "o"), "--format", "onnx"])
    assert "invalid choice" in capsys.readouterr().err


def test_a_fallback_to_an_older_checkpoint_names_the_one_skipped_and_why(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The newest checkpoint damaged (one byte of its model.pt): the export takes the one
    before, and one line says which was skipped, what was wrong with it and which was taken."""
    from dtrain.checkpoint.write import Checkpointer

    root = tmp_path / "run" / "checkpoints"
    saver = Checkpointer(root, rank=0, world_size=1, keep_last=2, keep_every=0, log=print)
    states = {step: {"w": torch.full((64,), float(step))} for step in (1, 2)}
    for step, state in states.items():
        meta = {"step": step, "world_size": 1, "strategy": "ddp"}
        saver.save(step, {"model.pt": state}, meta, blocking=True)
    damaged = root / "step-00000002" / "model.pt"
    good = damaged.read_bytes()
    data = bytearray(good)
    data[-100] ^= 0xFF  # one byte flipped: the size stays, the checksum fails
    damaged.write_bytes(bytes(data))
    capsys.readouterr()
    export(tmp_path / "run", tmp_path / "out.pt", "--format", "torch")
    notes = [line for line in capsys.readouterr().out.splitlines() if line.startswith("note:")]
    assert len(notes) == 1, notes
    assert notes[0].startswith(
        f"note: skipped step-00000002 ({damaged} fails its SHA-256 checksum"
    ), notes
    assert notes[0].endswith("): took step-00000001, the newest checkpoint that verifies")
    assert torch.equal(torch.load(tmp_path / "out.pt", weights_only=True)["w"], states[1]["w"])
    # run.init_from of the run folder falls back alike, and its start line says so (it said
    # only "from the weights in RUN_DIR").
    weights, said = read_weights_said(str(tmp_path / "run"))
    assert torch.equal(weights["w"], states[1]["w"])
    assert said.startswith(
        f"{tmp_path / 'run'}, checkpoint step-00000001 (skipped step-00000002 ({damaged} fails"
    ), said
    assert said.endswith("): took step-00000001, the newest checkpoint that verifies)"), said
    # An export of the newest checkpoint when it verifies says nothing of the kind.
    damaged.write_bytes(good)
    export(tmp_path / "run", tmp_path / "newest.pt", "--format", "torch")
    assert "note:" not in capsys.readouterr().out
    assert torch.equal(torch.load(tmp_path / "newest.pt", weights_only=True)["w"], states[2]["w"])
    said = read_weights_said(str(tmp_path / "run"))[1]
    assert said == f"{tmp_path / 'run'}, checkpoint step-00000002"


@pytest.fixture(params=[0o022, 0o077], ids=["umask022", "umask077"])
def umask(request: pytest.FixtureRequest) -> Iterator[int]:
    old = os.umask(request.param)
    try:
        yield request.param
    finally:
        os.umask(old)


def modes_under(path: Path) -> dict[str, int]:
    """Every entry's permission bits, by its path under ``path`` ("." for ``path`` itself)."""
    entries = [path, *path.rglob("*")] if path.is_dir() else [path]
    return {str(p.relative_to(path)): stat.S_IMODE(p.stat().st_mode) for p in entries}


def test_exports_follow_the_umask_as_the_run_folder_does(tmp_path: Path, umask: int) -> None:
    """safetensors' save_file makes 0600 whatever the umask (and save_pretrained calls it):
    every file of every format is 0666 less the umask, every folder 0777 less it."""
    from dtrain.checkpoint.write import Checkpointer
    from dtrain.weights.model_config import save_model_config

    model = plain_gpt2()
    run_dir = tmp_path / "run"
    save_model_config(model, run_dir)
    saver = Checkpointer(
        run_dir / "checkpoints", rank=0, world_size=1, keep_last=1, keep_every=0, log=print
    )
    meta = {"step": 1, "world_size": 1, "strategy": "ddp"}
    saver.save(1, {"model.pt": model.state_dict()}, meta, blocking=True)
    for fmt, name in (("safetensors", "out.safetensors"), ("torch", "out.pt"), ("hf", "out-hf")):
        out = tmp_path / name
        export(run_dir, out, "--format", fmt)
        modes = modes_under(out)
        want = {name: (0o777 if (out / name).is_dir() else 0o666) & ~umask for name in modes}
        assert modes == want, fmt
    assert "model.safetensors" in modes  # the hf folder holds what safetensors wrote
