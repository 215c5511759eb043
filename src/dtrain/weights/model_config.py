"""The model's own config, saved with a run so that ``dtrain export --format hf`` can write a
folder ``from_pretrained`` loads: for a Hugging Face model (one with ``config.save_pretrained``
and its own ``save_pretrained``), ``RUN_DIR/hf_config/config.json``, with ``architectures``
naming the model's class, as ``save_pretrained`` writes it (a PEFT model: its base's class, and
the adapter's ``adapter_config.json`` beside it). Other models have no such config
and nothing is written.

Duck-typed: this module does not import ``transformers``.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from torch import nn

from dtrain.parallel.frozen import is_peft_model

HF_CONFIG_DIR = "hf_config"


def save_model_config(model: nn.Module, run_dir: Path) -> Path | None:
    """Rank 0, before training: the Hugging Face config of ``model`` into the run folder
    (replacing the one an earlier start wrote); None for another kind of model."""
    config: Any = getattr(model, "config", None)
    saves = (getattr(model, "save_pretrained", None), getattr(config, "save_pretrained", None))
    if not all(map(callable, saves)):
        return None
    peft = is_peft_model(model)
    # What save_pretrained records: the class from_pretrained must build (a PEFT model's base).
    base = getattr(model, "get_base_model")() if peft else model  # noqa: B009
    config.architectures = [type(base).__name__]
    target = run_dir / HF_CONFIG_DIR
    run_dir.mkdir(parents=True, exist_ok=True)
    partial = run_dir / f".tmp-{HF_CONFIG_DIR}"
    shutil.rmtree(partial, ignore_errors=True)
    config.save_pretrained(str(partial))
    if peft:  # beside it, adapter_config.json: what dtrain export builds the adapter from
        from dtrain.weights.adapters import adapter_config

        adapter_config(model).save_pretrained(str(partial))
    shutil.rmtree(target, ignore_errors=True)
    partial.rename(target)
    return target
