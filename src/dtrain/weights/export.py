"""``dtrain export RUN_DIR OUT [--step N] [--format safetensors|torch|hf]``: a run's trained
model as one file (or, for a Hugging Face model, a folder ``from_pretrained`` loads), from any
strategy's checkpoint at any world size, in one process (docs/models.md, "Weights out").

The names are the model's own; tensors keep their dtype. ``hf`` writes from the Hugging Face
config the run saved (:mod:`dtrain.weights.model_config`) with the model's own
``save_pretrained`` (:func:`write_pretrained`); a PEFT run's through
:mod:`dtrain.weights.adapters`. ``OUT`` is written whole or not at all (beside it, then
renamed), its modes as the user's umask makes them; the run folder is only read.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import torch

from dtrain.checkpoint.consolidate import (
    Consolidated,
    consolidate,
    locate_checkpoint,
    skipped_words,
)
from dtrain.checkpoint.store import local_copy
from dtrain.errors import UserError
from dtrain.fsutil import follow_umask, fsync_dir, require_output_folder
from dtrain.storage.objects import Location, location
from dtrain.weights.adapters import is_peft_run, load_adapters, require
from dtrain.weights.init_from import load_base_into, load_state_into, read_weights
from dtrain.weights.model_config import HF_CONFIG_DIR

FORMATS = ("safetensors", "torch", "hf")


def export(
    run_dir: str | Path,
    out: str | Path,
    step: int | None = None,
    fmt: str = "safetensors",
    merge: bool = False,
    base: str | None = None,
) -> Consolidated:
    """Write the model of ``run_dir``'s checkpoint to ``out`` in ``fmt``; returns what was
    exported. A PEFT run's ``hf`` folder is its adapter, or with ``merge`` the base (from
    ``base``, else the run's ``run.init_from``) with the adapter merged in
    (:mod:`dtrain.weights.adapters`)."""
    source, out = location(run_dir), Path(out)
    if fmt not in FORMATS:
        raise UserError(f"--format {fmt!r}: expected one of {', '.join(FORMATS)}")
    if (merge or base) and fmt != "hf":
        what = "--merge" if merge else "--base"
        raise UserError(f"{what} writes a Hugging Face folder: give --format hf with it")
    if base and not merge:
        raise UserError("--base names the weights --merge merges the adapter into: add --merge")
    if out.exists():
        raise UserError(f"{out} already exists: choose another output path, or remove it first")
    step_dir, skipped = locate_checkpoint(source, step)
    require_output_folder(out.parent, f"OUT {out}")
    config_dir = step_dir.parent.parent / HF_CONFIG_DIR  # RUN_DIR/hf_config
    peft_run = is_peft_run(config_dir)
    if merge and not peft_run:
        raise UserError(
            f"--merge: the model of {run_dir} is not a PEFT model (its run saved no "
            f"{config_dir / 'adapter_config.json'}): there is no adapter to merge; export it "
            "without --merge"
        )
    if fmt == "hf" and not (config_dir / "config.json").exists():
        raise UserError(
            f"--format hf needs the Hugging Face config a run saves with it "
            f"({config_dir / 'config.json'}), and this run has none: was its model a "
            "transformers model? Export --format safetensors instead"
        )
    model = consolidate(step_dir)
    # A fallback to an older checkpoint is said, with what was wrong with each newer one: the
    # user asked for the run's newest model and gets another step's.
    model.note = "; ".join(filter(None, [skipped_words(step_dir, skipped), model.note]))
    partial = out.with_name(f".tmp-{out.name}-{os.getpid()}")
    try:
        if fmt == "safetensors":
            write_safetensors(model.state, partial)
        elif fmt == "torch":
            # Through a file object: given a path, torch names the archive inside after the
            # file's name up to its first dot, and refuses ".tmp-NAME" (nothing before it).
            with open(partial, "wb") as fh:
                torch.save(model.state, fh)
        else:
            base_path = merge_base(step_dir, base) if peft_run and merge else None
            with local_copy(config_dir) as config_copy:  # transformers reads a local folder
                if peft_run:
                    write_adapter_folder(model.state, config_copy, partial, base_path)
                else:
                    write_pretrained(model.state, config_copy, partial)
        # Before the rename, so that OUT never shows the writer's own modes (safetensors:
        # 0600 whatever the umask; save_pretrained's folder holds such a file too).
        follow_umask(partial)
        os.replace(partial, out)
        fsync_dir(out.parent)
    finally:
        if partial.is_dir():
            shutil.rmtree(partial, ignore_errors=True)
        elif partial.exists():
            partial.unlink()
    return model


def write_safetensors(state: dict[str, torch.Tensor], path: Path) -> None:
    """A state dict as safetensors; tensors that share memory (tied parameters) are written
    once each under every name, as the format has no shared storage."""
    try:
        from safetensors.torch import save_file
    except ImportError:
        raise UserError(
            "--format safetensors needs: pip install safetensors (or pip install -e '.[hf]' in "
            "dtrain's clone); --format torch needs nothing more"
        ) from None
    seen: set[int] = set()
    tensors: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        storage = tensor.untyped_storage().data_ptr()
        tensors[name] = tensor.contiguous() if storage not in seen else tensor.clone()
        seen.add(storage)
    save_file(tensors, str(path), metadata={"format": "pt"})


# -- folders from_pretrained loads -------------------------------------------------------------


def write_pretrained(state: dict[str, torch.Tensor], config_dir: Path, out: Path) -> None:
    """Write ``state`` as a folder ``from_pretrained`` loads: the model class named in
    ``config_dir/config.json`` (``architectures``) is built from that config, given the
    weights (every key must fit), and saved with its own ``save_pretrained``."""
    model = build_pretrained_model(config_dir)
    load_state_into(model, state, f"the checkpoint ({config_dir.parent})")
    save_quietly(model, out)


def save_quietly(model: Any, out: Path) -> None:
    """``model.save_pretrained(out)`` without transformers' progress bar ("Writing model
    shards: 0%|...", a line of noise before the export's own line for a one-file model)."""
    from transformers.utils import logging as hf_logging

    shown = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        model.save_pretrained(str(out))
    finally:
        if shown:
            hf_logging.enable_progress_bar()


def build_pretrained_model(config_dir: Path) -> Any:
    """The model class named in ``config_dir/config.json`` (``architectures``), built from
    that config (initial weights)."""
    transformers = require("transformers", "hf", "--format hf")
    config = transformers.AutoConfig.from_pretrained(str(config_dir))
    names = list(getattr(config, "architectures", None) or [])
    cls = getattr(transformers, names[0], None) if names else None
    if cls is None:
        raise UserError(
            f"{config_dir / 'config.json'} names no model class transformers has "
            f"(architectures = {names}); export --format safetensors instead"
        )
    return cls(config)


def write_adapter_folder(
    state: dict[str, torch.Tensor], config_dir: Path, out: Path, base: str | None
) -> None:
    """A PEFT run's adapters (``state``) as PEFT saves them; with ``base`` (the path of the
    base's weights), the base with them merged in, as the plain model saves itself."""
    model: Any = build_peft_model(config_dir, read_weights(base) if base is not None else None)
    load_adapters(model, state, f"the checkpoint ({config_dir.parent})")
    if base is not None:
        model = model.merge_and_unload()
    save_quietly(model, out)


def build_peft_model(config_dir: Path, base: dict[str, torch.Tensor] | None) -> Any:
    """The run's PEFT model from the configs it saved: the base's class from ``config.json``
    (its weights ``base`` where given), the adapter from ``adapter_config.json``."""
    peft = require("peft", "peft", "exporting a PEFT run")
    model = build_pretrained_model(config_dir)
    peft_model = peft.get_peft_model(model, peft.PeftConfig.from_pretrained(str(config_dir)))
    if base is not None:
        load_base_into(peft_model, base, "--base")
    return peft_model


def merge_base(step_dir: Location, base: str | None) -> str:
    """The base weights ``--merge`` merges into: ``--base``, else the run's ``run.init_from``
    (the checkpoint holds the adapters only: its base is frozen and not saved)."""
    if base:
        return base
    from dtrain.checkpoint.read import load_meta
    from dtrain.config.load import tomllib

    config = tomllib.loads(str(load_meta(step_dir).get("config", "")))
    init_from = str(config.get("run", {}).get("init_from", ""))
    if not init_from:
        raise UserError(
            f"--merge needs the base model's weights, and {step_dir} holds the adapters only "
            "(a PEFT run's base is frozen and not checkpointed) and its run had no "
            "run.init_from: give --base PATH (the base's Hugging Face folder or weights file)"
        )
    return init_from
