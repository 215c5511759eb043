"""Weights in: start a run from trained weights (``run.init_from``), or load them in Python
(``dtrain.load_weights``). The kinds of path (a weights file, a Hugging Face folder, a run
folder or ``step-N`` checkpoint of any strategy, locally or in an object store) and what is
checked: docs/models.md, "Weights in".

Whatever the path, it is read as tensors and plain data only
(:mod:`dtrain.checkpoint.safe_load`), and a checkpoint folder only once its completion marker
verifies (a ``.tmp-step-N`` a save left is refused). Only the weights come along: the optimizer,
schedule and data position start fresh (resuming a run is ``run.resume``).
"""

from __future__ import annotations

import pickle
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from dtrain.checkpoint.consolidate import (
    consolidate,
    find_checkpoint,
    is_checkpoint_folder,
    locate_checkpoint,
    skipped_words,
)
from dtrain.checkpoint.read import first_problems, state_dict_mismatches
from dtrain.checkpoint.safe_load import ONLY_DATA, first_line, torch_load, why_refused
from dtrain.errors import CheckpointError, UserError
from dtrain.parallel.frozen import is_peft_model
from dtrain.parallel.materialize import is_meta_model, materialize, require_init
from dtrain.parallel.skeleton import meta_copy
from dtrain.storage.objects import Location, ObjectPath, StoreError, location, store_refusal

TORCH_SUFFIXES = (".pt", ".pth", ".bin")
HF_WEIGHTS = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin")


def weights_kind(path: Location) -> str:
    """What ``path`` holds: 'safetensors', 'torch', 'hf', 'checkpoint' or 'run'; a
    :class:`UserError` when it is none of them."""
    if path.is_file():
        suffix = Path(path.name).suffix
        if suffix == ".safetensors":
            return "safetensors"
        if suffix in TORCH_SUFFIXES:
            return "torch"
        raise UserError(
            f"{path}: a weights file must be .safetensors or a torch file "
            f"({', '.join(TORCH_SUFFIXES)})"
        )
    if path.is_dir():
        if is_checkpoint_folder(path):
            return "checkpoint"
        if (path / "checkpoints").is_dir():
            return "run"
        if any((path / name).exists() for name in HF_WEIGHTS):
            return "hf"
        raise UserError(
            f"{path} is no weights folder: expected a Hugging Face folder (config.json, "
            "model.safetensors), a dtrain run folder (checkpoints/) or a step-N checkpoint"
        )
    raise UserError(f"{path} does not exist")


def read_weights(path: str | Location) -> dict[str, torch.Tensor]:
    """The state dict ``path`` holds (the kinds of path: docs/models.md, "Weights in"), on CPU."""
    path = location(str(path))
    kind = weights_kind(path)
    if kind == "safetensors":
        return read_safetensors(path)
    if kind == "torch":
        return _as_state_dict(_torch_load(path), path)
    if kind == "hf":
        return read_hf_folder(path)
    return consolidate(find_checkpoint(path)).state


def read_safetensors(path: Location) -> dict[str, torch.Tensor]:
    try:
        from safetensors.torch import load, load_file
    except ImportError:
        raise UserError(f"{path}: reading safetensors needs: pip install safetensors") from None
    try:
        if isinstance(path, ObjectPath):  # one request for the whole file
            return dict(load(path.read_bytes()))
        return dict(load_file(str(path)))
    except Exception as exc:  # a truncated or foreign file
        raise UserError(f"{path} cannot be read as safetensors: {exc}") from None


def read_hf_folder(folder: Location) -> dict[str, torch.Tensor]:
    """The weights of a ``save_pretrained`` folder (one file, or shards with an index)."""
    import json

    index = folder / "model.safetensors.index.json"
    if index.exists():
        try:
            files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise UserError(f"{index} cannot be read: {exc}") from None
        return {k: v for name in files for k, v in read_safetensors(folder / name).items()}
    if (folder / "model.safetensors").exists():
        return read_safetensors(folder / "model.safetensors")
    return _as_state_dict(_torch_load(folder / "pytorch_model.bin"), folder)


def _torch_load(path: Location) -> Any:
    try:
        return torch_load(path)
    except pickle.UnpicklingError as exc:
        raise UserError(
            f"{path} is not a torch file of tensors: {why_refused(exc)}; {ONLY_DATA}"
        ) from None
    except Exception as exc:
        why = first_line(exc)
        raise UserError(f"{path} cannot be loaded as a torch file of tensors: {why}") from None


def _as_state_dict(value: Any, path: Location) -> dict[str, torch.Tensor]:
    if isinstance(value, Mapping) and all(isinstance(v, torch.Tensor) for v in value.values()):
        return dict(value)
    raise UserError(f"{path} holds no state dict (a mapping of names to tensors)")


def tied_groups(named: Iterable[tuple[str, int]]) -> list[set[str]]:
    """Groups of names that are one tensor: ``named`` gives each name with what identifies its
    tensor."""
    groups: dict[int, set[str]] = {}
    for name, tensor in named:
        groups.setdefault(tensor, set()).add(name)
    return [names for names in groups.values() if len(names) > 1]


def load_state_into(model: nn.Module, state: Mapping[str, torch.Tensor], where: str) -> None:
    """Copy ``state`` into ``model``'s tensors (each to its own dtype and device), after
    checking that it fits: a :class:`CheckpointError` listing what does not."""
    params = model.named_parameters(remove_duplicate=False)
    current, tied = model.state_dict(), tied_groups((n, id(p)) for n, p in params)
    if problems := state_dict_mismatches(current, state, "weights", tied):
        raise CheckpointError(
            f"{where} does not fit {type(model).__name__}: {first_problems(problems)}; load "
            "weights made for this model (the same architecture and sizes)"
        )
    given = {key: value for key, value in state.items() if key in current}
    with torch.no_grad():
        # Tied parameters: one tensor, loaded once (from whichever name the weights hold).
        for group in tied:
            present = sorted(group & set(given))
            for name in present[1:]:
                given.pop(name)
        model.load_state_dict(given, strict=False)


def load_weights(model: nn.Module, path: str | Path) -> nn.Module:
    """Load the weights at ``path`` (a run folder, a checkpoint, an export, a Hugging Face
    folder) into ``model``; returns ``model``. Raises one line naming every key that does not
    fit."""
    load_state_into(model, read_weights(path), str(path))
    return model


def init_model(
    model: nn.Module,
    path: str,
    init_weights: Callable[[nn.Module], None] | None = None,
    seed: int = 0,
) -> str:
    """``run.init_from``: the task's model takes the weights at ``path`` before the strategy
    spreads it (every rank reads them). A meta-built model is made whole on the CPU first
    (its ``init_weights`` give what the weights do not hold, such as non-persistent
    buffers): the weights come whole, so every rank holds the whole model once. Returns
    what was loaded, for the start line (:func:`loaded_words`)."""
    if is_meta_model(model):
        init = require_init(model, init_weights)
        materialize(meta_copy(model), model, init, torch.device("cpu"), seed)
    where = f"run.init_from = {path!r}"
    weights, loaded = read_weights_said(path)
    if is_peft_model(model):  # the weights of its base, by the base's own names
        load_base_into(model, weights, where)
    else:
        load_state_into(model, weights, where)
    return loaded


def read_weights_said(path: str) -> tuple[dict[str, torch.Tensor], str]:
    """:func:`read_weights`, and what they are in words: a run folder's checkpoint is named,
    with the newer ones passed over and why (a run folder's newest checkpoint that does not
    verify is skipped: the weights then come from an older step)."""
    where = location(path)  # a local path or a store's (s3://)
    if weights_kind(where) != "run":
        return read_weights(where), path
    step_dir, skipped = locate_checkpoint(where)
    said = f"{path}, checkpoint {step_dir.name}"
    if skipped:
        said += f" ({skipped_words(step_dir, skipped)})"
    return consolidate(step_dir).state, said


def load_base_into(model: nn.Module, weights: Mapping[str, torch.Tensor], where: str) -> None:
    """The base model's weights (its own names) into PEFT ``model``'s frozen base, after
    checking that they fit key by key (tied names given under either)."""
    from peft.utils.save_and_load import get_base_model_state_dict

    current = get_base_model_state_dict(model)  # the base's own names -> the model's tensors
    tied = tied_groups((n, t.untyped_storage().data_ptr()) for n, t in current.items())
    if problems := state_dict_mismatches(current, weights, "weights", tied):
        base = type(getattr(model, "get_base_model")()).__name__  # noqa: B009
        raise CheckpointError(
            f"{where} does not fit the PEFT model's base ({base}): {first_problems(problems)}; "
            "give the weights of the base model the adapters were added to"
        )
    with torch.no_grad():
        # The state dict's tensors share the parameters' storage. A tied name the weights lack
        # (save_pretrained keeps one of GPT-2's head and token embedding) is filled through the
        # other name of its group.
        for name, tensor in current.items():
            if name in weights:
                tensor.copy_(weights[name])


def check_init_from(path: str) -> None:
    """In the parent process, before any worker starts: the path exists and holds weights
    (whether they fit the model is known once a worker has built it); in a store, the
    credentials and the endpoint answer."""
    if not path:
        return
    label = f"run.init_from = {path!r}"
    try:
        where = location(path)
        kind = weights_kind(where)
        if kind in ("checkpoint", "run"):
            find_checkpoint(where)
        elif kind in ("torch", "safetensors") and isinstance(where, Path):
            # A local file's first bytes; a store's object is read whole by the workers only.
            check_file_header(where, kind)
    except StoreError as exc:
        assert isinstance(where, ObjectPath)  # only a store's requests raise it
        raise store_refusal(label, where, exc, "cannot read it: ") from None
    except UserError as exc:
        raise UserError(f"{label}: {exc}") from None


def check_file_header(path: Path, kind: str) -> None:
    """A weights file's first bytes are its format's (read in the parent, before any worker
    starts; the tensors are read by every worker): a file of something else (a download that
    failed, random bytes) was each rank's error after launch, three times over."""
    with open(path, "rb") as fh:
        head = fh.read(9)
    if kind == "torch":
        # torch.save's zip archive, or its legacy format: a pickle (protocol 2+ opens 0x80).
        if head[:4] == b"PK\x03\x04" or head[:1] == b"\x80":
            return
        raise UserError(f"{path} is not a torch file: neither torch.save's archive nor a pickle")
    # safetensors: an 8-byte little-endian length of the JSON header that follows.
    size = int.from_bytes(head[:8], "little") if len(head) == 9 else 0
    if head[8:9] != b"{" or not 0 < size < path.stat().st_size:
        raise UserError(f"{path} is not a safetensors file: its first bytes are no header")
