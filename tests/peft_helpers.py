"""LoRA runs for tests/test_peft.py: the example's LoRA GPT-2 (examples/hf_gpt2_lora.py) on a
small base, trained in the launch of the Hugging Face runs (tests/hf_helpers.py, which pays
for importing transformers once); importable by worker processes. They need ``transformers``
and ``peft``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from examples import hf_gpt2_lora

from dtrain.train.trainer import Trainer
from tests.hf_helpers import GPT2_TASK, gpt2_batches, hf_raw

LORA = {"lora_r": 4, "lora_alpha": 8, "lora_targets": ["c_attn", "c_proj"]}
STEPS = 6
LR = 0.5


def lora_options(**changes: Any) -> hf_gpt2_lora.LoraOptions:
    return hf_gpt2_lora.LoraOptions(**{**GPT2_TASK, **LORA, **changes})  # type: ignore[arg-type]


def lora_raw(run_dir: Path, base: Path, **sections: dict[str, Any]) -> dict[str, Any]:
    """The LoRA example from ``base``'s weights, SGD at a constant rate, checkpointed at the
    end (its adapters only)."""
    raw = hf_raw(run_dir, "gpt2")
    raw["run"].update(task="examples.hf_gpt2_lora:build", init_from=str(base))
    raw["task"].update(LORA)
    raw["train"]["steps"] = STEPS
    raw["optim"]["lr"] = LR
    for name, values in sections.items():
        raw.setdefault(name, {}).update(values)
    return raw


def lora_run_configs(root: Path) -> dict[str, dict[str, Any]]:
    """LoRA under ddp and fsdp from the base of :func:`prepare_lora_runs`; one step from that
    base plus the adapter PEFT saved there; a run resumed at another strategy."""
    base = root / "lora-base"
    adapter = {"init_adapter": str(root / "lora-adapter")}
    half = {"steps": STEPS // 2}
    return {
        "lora-ddp": lora_raw(root / "lora-ddp", base, strategy={"name": "ddp"}),
        "lora-fsdp": lora_raw(root / "lora-fsdp", base, strategy={"name": "fsdp"}),
        "lora-again": lora_raw(root / "lora-again", base, run=adapter, train={"steps": 1}),
        # Half the steps under ddp, then resumed from its adapters-only checkpoint under fsdp.
        "lora-half": lora_raw(root / "lora-resumed", base, strategy={"name": "ddp"}, train=half),
        "lora-resumed": lora_raw(root / "lora-resumed", base, strategy={"name": "fsdp"}),
    }


def prepare_lora_runs(root: Path) -> None:
    """Before the launch: the base GPT-2 as a Hugging Face folder (seeded apart from the runs'
    initial base) and a LoRA adapter of it, with B not zero, as PEFT itself saves one."""
    from dtrain.weights.init_from import load_base_into, read_weights

    torch.manual_seed(123)
    hf_gpt2_lora.build_model(lora_options()).save_pretrained(str(root / "lora-base"))  # type: ignore[operator]
    model: Any = hf_gpt2_lora.build_lora_model(lora_options())
    load_base_into(model, read_weights(root / "lora-base"), "base")
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0.0, 0.05)
    model.save_pretrained(str(root / "lora-adapter"))


def probe_inputs() -> torch.Tensor:
    """Inputs no run trained on."""
    return torch.arange(2 * 16).reshape(2, 16) * 7 % 64


def probe(trainer: Trainer) -> dict[str, Any]:
    """In a rank, after training (collective): rank 0's trained model's logits on the probe
    and its trainable parameters' names."""
    model = trainer.strategy.model_for_inference()
    if model is None:
        return {}
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=probe_inputs()).logits
    trainable = sorted(n for n, p in model.named_parameters() if p.requires_grad)
    return {"logits": logits, "trainable": trainable}


def one_process_losses(base: Path, steps: int = STEPS) -> list[float]:
    """The hand-written single-process loop over the same model (seeded as dtrain seeds
    before the task builds it, then the base's weights) and the same batches."""
    from dtrain.checkpoint.rng import seed_everything
    from dtrain.weights.init_from import load_base_into, read_weights

    seed_everything(0)
    model = hf_gpt2_lora.build_lora_model(lora_options())
    load_base_into(model, read_weights(base), "base")
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.SGD(trainable, lr=LR, momentum=0.9)
    losses = []
    for ids in gpt2_batches(steps):
        loss = model(input_ids=ids, labels=ids).loss
        losses.append(float(loss.detach()))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return losses
