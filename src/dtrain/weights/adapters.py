"""PEFT adapters (LoRA and PEFT's other layer tuners) in and out of a run (what goes in and
out, and what is checked: docs/models.md, "Weights in" and "Weights out" of the LoRA section).

In: ``run.init_from`` into a PEFT model loads its *base*
(:func:`dtrain.weights.init_from.load_base_into`); ``run.init_adapter`` then loads an adapter
folder as PEFT saves it, after checking that it was made for this model. Out (``dtrain export
--format hf``): the checkpoint holds the adapters only (its base is frozen,
:mod:`dtrain.parallel.frozen`), so the export builds the PEFT model from the configs the run
saved (``RUN_DIR/hf_config``) and writes PEFT's own folder, or with ``--merge`` the base with
the adapters merged in.

The files are JSON and safetensors: nothing is unpickled. ``peft`` is an optional extra
(``pip install -e '.[peft]'``), imported only here and only when a function needs it.
"""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from dtrain.checkpoint.read import first_problems, state_dict_mismatches
from dtrain.errors import CheckpointError, UserError
from dtrain.parallel.frozen import frozen_names, is_peft_model
from dtrain.storage.objects import Location
from dtrain.weights.init_from import read_safetensors

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
# The settings an adapter must share with the model it is loaded into: any other value gives
# other outputs from the same tensors (alpha scales them) or tensors of other layers.
MATCHED = (
    "peft_type",
    "r",
    "lora_alpha",
    "target_modules",
    "use_rslora",
    "use_dora",
    "fan_in_fan_out",
    "bias",
    "modules_to_save",
    "rank_pattern",
    "alpha_pattern",
    "layers_to_transform",
)


def require(package: str, extra: str, what: str) -> Any:
    """The module ``package`` (of the optional extra ``extra``), or one line naming the extra
    to install."""
    if importlib.util.find_spec(package) is None:
        raise UserError(f"{what} needs {package}: pip install -e '.[{extra}]' in dtrain's clone")
    return importlib.import_module(package)


def adapter_config(model: nn.Module) -> Any:
    """The one adapter's config of a PEFT model (several adapters: one line)."""
    configs: dict[str, Any] = getattr(model, "peft_config")  # noqa: B009 (duck-typed)
    if len(configs) != 1:
        raise UserError(
            f"the PEFT model holds {len(configs)} adapters ({', '.join(sorted(configs))}); "
            "dtrain trains, saves and exports one: build the model with one adapter"
        )
    return next(iter(configs.values()))


# -- in ----------------------------------------------------------------------------------------


def read_adapter(folder: Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """An adapter folder's settings (``adapter_config.json``) and tensors (safetensors)."""
    config_path, weights_path = folder / ADAPTER_CONFIG, folder / ADAPTER_WEIGHTS
    for path in (config_path, weights_path):
        if not path.is_file():
            raise UserError(
                f"{folder} is no PEFT adapter folder: {path.name} is missing (expected "
                f"{ADAPTER_CONFIG} and {ADAPTER_WEIGHTS}, as save_pretrained and dtrain export "
                "write them)"
            )
    try:
        settings = json.loads(config_path.read_text())
    except (OSError, ValueError) as exc:
        raise UserError(f"{config_path} cannot be read as JSON: {exc}") from None
    if not isinstance(settings, dict):
        raise UserError(f"{config_path} holds no JSON object of adapter settings")
    return settings, read_safetensors(weights_path)


def load_adapter_into(model: nn.Module, folder: str | Path) -> None:
    """``run.init_adapter``: the adapter at ``folder`` into PEFT ``model``, after checking that
    it was made for this model (its settings, then its tensors' names and shapes). PEFT's own
    mapping puts the saved names (without the adapter's name) into the model's."""
    where = f"run.init_adapter = {str(folder)!r}"
    if not is_peft_model(model):
        raise UserError(
            f"{where}: the task's model ({type(model).__name__}) is not a PEFT model; wrap it "
            "with peft.get_peft_model(model, config) to load an adapter into it"
        )
    require("peft", "peft", "run.init_adapter")
    from peft.utils.save_and_load import get_peft_model_state_dict, set_peft_model_state_dict

    settings, state = read_adapter(Path(folder))
    ours = adapter_config(model).to_dict()
    differ = [
        f"{key} {_plain(settings.get(key))!r} (the model's: {_plain(ours.get(key))!r})"
        for key in MATCHED
        if key in ours and _plain(settings.get(key)) != _plain(ours.get(key))
    ]
    if differ:
        raise CheckpointError(
            f"{where} was made for another PEFT model: {'; '.join(differ)}; build the task's "
            "model with the adapter's settings (adapter_config.json), or start a new adapter"
        )
    expected = get_peft_model_state_dict(model)  # the names PEFT saves, with their shapes
    if problems := state_dict_mismatches(expected, state, "adapter"):
        raise CheckpointError(
            f"{where} does not fit the model's adapter layers: {first_problems(problems)}; "
            "its base model has other layers or sizes than the task's"
        )
    set_peft_model_state_dict(model, state)


def _plain(value: Any) -> Any:
    """A setting as JSON holds it (PEFT keeps target_modules as a set)."""
    if isinstance(value, (set, frozenset, tuple, list)):
        return sorted(value) if all(isinstance(v, str) for v in value) else list(value)
    return value


def check_init_adapter(path: str) -> None:
    """In the parent process, before any worker starts: ``run.init_adapter`` is an adapter
    folder and PEFT is installed (whether it fits the model is known once a worker built it)."""
    if not path:
        return
    require("peft", "peft", f"run.init_adapter = {path!r}")
    try:
        read_adapter(Path(path))
    except UserError as exc:
        raise UserError(f"run.init_adapter = {path!r}: {exc}") from None


# -- out ---------------------------------------------------------------------------------------


def load_adapters(model: nn.Module, state: Mapping[str, torch.Tensor], where: str) -> None:
    """A PEFT run's checkpoint (its trainable tensors, by the model's own names) into
    ``model``, after checking that it holds exactly those."""
    frozen = frozen_names(model)
    current = {k: v for k, v in model.state_dict().items() if k not in frozen}
    if problems := state_dict_mismatches(current, state):
        raise CheckpointError(
            f"{where} does not hold this PEFT model's adapters: {first_problems(problems)}"
        )
    model.load_state_dict(dict(state), strict=False)


def is_peft_run(config_dir: Location) -> bool:
    """Whether the run whose configs are in ``config_dir`` trained a PEFT model."""
    return (config_dir / ADAPTER_CONFIG).is_file()
