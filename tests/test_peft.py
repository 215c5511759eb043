"""LoRA through PEFT (examples/hf_gpt2_lora.py): a PEFT-wrapped GPT-2 trains under ddp and fsdp
as one process does; its checkpoints and optimizer state hold the adapters only; `dtrain
export` writes the adapter as PEFT loads it and, with --merge, the merged model, each giving
the run's logits; run.init_from + run.init_adapter continue at the same loss; adapters made for
another model and --merge on a plain model are one line each."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("peft")

import peft
from examples.hf_gpt2_lora import build_lora_model

from dtrain.checkpoint.consolidate import consolidate, find_checkpoint
from dtrain.checkpoint.read import load_file, sharded_index
from dtrain.cli import main
from dtrain.errors import UserError
from dtrain.weights.adapters import (
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    check_init_adapter,
    load_adapter_into,
)
from dtrain.weights.export import export
from dtrain.weights.init_from import init_model
from tests.hf_helpers import gpt2_batches
from tests.peft_helpers import lora_options, one_process_losses, probe_inputs


@pytest.fixture(scope="module")
def lora(hf_runs: tuple[Path, dict[str, Any]]) -> tuple[Path, dict[str, Any]]:
    """The LoRA runs of the Hugging Face launch (tests/peft_helpers.py), and the ddp run's
    adapter exported."""
    root, results = hf_runs
    runs = {
        name.removeprefix("lora-"): results[name] for name in results if name.startswith("lora-")
    }
    for name, run in runs.items():
        assert "error" not in run, (name, run)
    export(root / "lora-ddp", root / "lora-export", fmt="hf")
    return root, runs


def base_model(root: Path) -> Any:
    from transformers import GPT2LMHeadModel

    return GPT2LMHeadModel.from_pretrained(str(root / "lora-base")).eval()


def logits_of(model: Any) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=probe_inputs()).logits


def test_lora_trains_under_ddp_and_fsdp_as_one_process(lora: tuple[Path, dict[str, Any]]) -> None:
    root, runs = lora
    reference = one_process_losses(root / "lora-base")
    for name in ("ddp", "fsdp"):
        losses = runs[name]["losses"]
        assert len(losses) == len(reference) == 6
        for step, (got, want) in enumerate(zip(losses, reference)):
            assert abs(got - want) < 1e-5, (name, step, got, want)
    assert runs["ddp"]["trainable"] == runs["fsdp"]["trainable"]
    assert len(runs["ddp"]["trainable"]) == 12  # A and B of 3 layers in 2 blocks
    assert all(".lora_" in name for name in runs["ddp"]["trainable"])
    torch.testing.assert_close(runs["ddp"]["logits"], runs["fsdp"]["logits"], rtol=0, atol=1e-5)


def test_checkpoints_and_optimizer_state_hold_the_adapters_only(
    lora: tuple[Path, dict[str, Any]],
) -> None:
    root, runs = lora
    adapters = set(runs["ddp"]["trainable"])
    step_dir = find_checkpoint(root / "lora-ddp")
    assert set(load_file(step_dir, "model.pt")) == adapters
    optimizer = load_file(step_dir, "optimizer.pt")
    assert len(optimizer["state"]) == len(adapters)  # momentum of the adapters only
    shards = sharded_index(find_checkpoint(root / "lora-fsdp"))
    assert {k.removeprefix("model.") for k in shards.keys if k.startswith("model.")} == adapters
    for name in ("ddp", "fsdp"):  # either form, read whole
        assert set(consolidate(find_checkpoint(root / f"lora-{name}")).state) == adapters


def test_a_run_resumes_its_adapters_at_another_strategy(
    lora: tuple[Path, dict[str, Any]],
) -> None:
    """Half the steps under ddp, the rest resumed under fsdp from the adapters-only checkpoint
    (read by name into shards, the base built again): the uninterrupted run's losses."""
    _, runs = lora
    assert len(runs["half"]["losses"]) == 3
    resumed = runs["resumed"]["losses"]  # the folder's records: both attempts
    assert len(resumed) == 6
    for step, (got, want) in enumerate(zip(resumed, runs["ddp"]["losses"])):
        assert abs(got - want) < 1e-6, (step, got, want)


def test_the_exported_adapter_loads_in_peft_with_the_run_s_logits(
    lora: tuple[Path, dict[str, Any]],
) -> None:
    root, runs = lora
    export(root / "lora-fsdp", root / "fsdp-adapter", fmt="hf")
    for name, folder in (("ddp", root / "lora-export"), ("fsdp", root / "fsdp-adapter")):
        assert (folder / ADAPTER_CONFIG).is_file() and (folder / ADAPTER_WEIGHTS).is_file()
        model = peft.PeftModel.from_pretrained(base_model(root), str(folder)).eval()
        torch.testing.assert_close(logits_of(model), runs[name]["logits"], rtol=0, atol=1e-6)
        # Not the base's: the adapter changed them.
        assert (logits_of(base_model(root)) - runs[name]["logits"]).abs().max() > 1e-3


def test_the_merged_export_is_a_plain_model_with_the_run_s_logits(
    lora: tuple[Path, dict[str, Any]],
) -> None:
    from transformers import GPT2LMHeadModel

    root, runs = lora
    assert (
        main(["export", str(root / "lora-ddp"), str(root / "merged"), "--format", "hf", "--merge"])
        == 0
    )
    merged = GPT2LMHeadModel.from_pretrained(str(root / "merged")).eval()
    assert not any("lora" in name for name in merged.state_dict())
    torch.testing.assert_close(logits_of(merged), runs["ddp"]["logits"], rtol=0, atol=1e-6)
    # --base names the base explicitly: the same folder.
    base = str(root / "lora-base")
    export(root / "lora-ddp", root / "merged-base", fmt="hf", merge=True, base=base)
    again = GPT2LMHeadModel.from_pretrained(str(root / "merged-base")).eval()
    assert torch.equal(logits_of(again), logits_of(merged))


def test_init_from_a_base_and_an_adapter_continues_at_the_same_loss(
    lora: tuple[Path, dict[str, Any]],
) -> None:
    root, runs = lora
    adapter = str(root / "lora-adapter")  # as PEFT saved it (tests/peft_helpers.py)
    model = peft.PeftModel.from_pretrained(base_model(root), adapter).eval()
    ids = gpt2_batches(1)[0]
    with torch.no_grad():
        expected = float(model(input_ids=ids, labels=ids).loss)
    assert abs(runs["again"]["losses"][0] - expected) < 1e-6


@pytest.mark.parametrize(
    ("changes", "base", "message"),
    [
        ({"lora_r": 2}, False, "was made for another PEFT model: r 4 (the model's: 2)"),
        ({"lora_alpha": 4}, False, "lora_alpha 8 (the model's: 4)"),
        (
            {"n_embd": 16},
            False,
            "does not fit the model's adapter layers: base_model.model.transformer.h.0.attn."
            "c_attn.lora_A.weight: adapter (4, 32), model (4, 16)",
        ),
        ({"n_embd": 16}, True, "does not fit the PEFT model's base (GPT2LMHeadModel)"),
    ],
)
def test_an_adapter_or_base_made_for_another_model_is_one_line(
    lora: tuple[Path, dict[str, Any]], changes: dict[str, Any], base: bool, message: str
) -> None:
    """What a worker's wiring calls (dtrain.train.job.wire_task), on the task's model."""
    root, _ = lora
    model = build_lora_model(lora_options(**changes))
    with pytest.raises(UserError) as caught:
        if base:
            init_model(model, str(root / "lora-base"))
        else:
            load_adapter_into(model, root / "lora-export")
    assert message in str(caught.value) and "\n" not in str(caught.value), caught.value


def test_an_adapter_for_a_model_without_adapters_is_one_line(
    lora: tuple[Path, dict[str, Any]],
) -> None:
    with pytest.raises(UserError, match=r"the task's model \(GPT2LMHeadModel\) is not a PEFT"):
        load_adapter_into(build_lora_model(lora_options(lora=False)), lora[0] / "lora-export")


def test_merge_on_a_plain_model_and_other_mistakes_are_one_line(
    lora: tuple[Path, dict[str, Any]],
    observed_run: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    root, _ = lora
    out = str(tmp_path / "out")
    cases = [
        ([str(observed_run), out, "--format", "hf", "--merge"], "--merge: the model of"),
        ([str(root / "lora-ddp"), out, "--merge"], "--merge writes a Hugging Face folder"),
        ([str(root / "lora-ddp"), out, "--format", "hf", "--base", "x"], "add --merge"),
    ]
    for args, message in cases:
        assert main(["export", *args]) == 2
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1, err
    assert "is not a PEFT model" in main_error(capsys, observed_run, out)
    assert not (tmp_path / "out").exists()
    with pytest.raises(UserError, match=r"adapter_model\.safetensors is missing"):
        (tmp_path / "half").mkdir()
        (tmp_path / "half" / ADAPTER_CONFIG).write_text("{}")
        check_init_adapter(str(tmp_path / "half"))


def main_error(capsys: pytest.CaptureFixture[str], run_dir: Path, out: str) -> str:
    main(["export", str(run_dir), out, "--format", "hf", "--merge"])
    return capsys.readouterr().err
