"""A checkpoint read by a strategy that lays the state out otherwise (which conversion a load
takes: :mod:`dtrain.checkpoint.model_state`; what each strategy saves and reads:
docs/fault-tolerance.md, "Checkpoints").

Every conversion goes through one form, the one torch's distributed state-dict API gives by
default: the model by parameter name, the optimizer ``{"state": {name: {...}}, "param_groups":
[{..., "params": [names]}]}`` (this rank's part of each tensor; a name is the whole model's).
Each of this rank's groups then takes the settings of the saved group that held its
parameters, however the saving strategy grouped them (:func:`regroup`). A whole
``optimizer.pt`` is keyed by position; the names written beside it
(:data:`~dtrain.checkpoint.forms.NAMES_KEY`) turn it into that form."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from dtrain.checkpoint import layout
from dtrain.checkpoint import read as ckread
from dtrain.checkpoint.forms import NAMES_KEY
from dtrain.errors import CheckpointError
from dtrain.storage.objects import Location


def read_in_saved_groups(
    template: dict[str, Any], step_dir: Location, index: ckread.ShardedIndex
) -> None:
    """Fill ``template`` from the shards (collective). Where it is in the by-name form (a list
    of groups), its groups are laid out as this rank's afterwards, whichever way the saving
    strategy grouped the parameters (tensor parallelism keeps plain tensors apart from
    DTensors; a pipeline stage holds some of them; pipeline keeps settings per parameter)."""
    ours = template["optimizer"].get("param_groups")
    if not isinstance(ours, list) or not ours:  # pipeline's own form: settings per parameter
        ckread.load_sharded(step_dir, template)
        return
    if index.settings_per_name:
        saved = read_settings_per_name(template, step_dir, index.keys)
    else:  # read the saved groups as they are
        template["optimizer"]["param_groups"] = [dict(ours[0]) for _ in range(index.param_groups)]
        ckread.load_sharded(step_dir, template)
        saved = template["optimizer"]["param_groups"]
    template["optimizer"]["param_groups"] = regroup(saved, ours, step_dir)


def read_settings_per_name(
    template: dict[str, Any], step_dir: Location, keys: frozenset[str]
) -> list[dict[str, Any]]:
    """Fill ``template`` (by name, list of groups) from shards that keep their optimizer
    settings per parameter (pipeline's; collective); returns the saved settings as one group
    per parameter. A setting the checkpoint lacks keeps this rank's value."""
    ours = template["optimizer"]["param_groups"]
    wanted: dict[str, dict[str, Any]] = {}
    for group in ours:
        for name in group["params"]:
            wanted[name] = {
                key: value
                for key, value in group.items()
                if key != "params" and f"optimizer.param_groups.{name}.{key}" in keys
            }
            if not wanted[name]:
                raise CheckpointError(
                    f"{step_dir}: the optimizer state holds no settings for parameter {name} "
                    "(saved per parameter, by a pipeline that named it otherwise): resume with "
                    "the strategy that saved it"
                )
    template["optimizer"]["param_groups"] = wanted
    ckread.load_sharded(step_dir, template)
    read = template["optimizer"]["param_groups"]
    return [
        {**{k: v for k, v in group.items() if k != "params"}, **read[name], "params": [name]}
        for group in ours
        for name in group["params"]
    ]


def regroup(
    saved: list[dict[str, Any]], ours: list[dict[str, Any]], step_dir: Location
) -> list[dict[str, Any]]:
    """The saved parameter groups laid out as this rank's (``ours``, parameters by name): each
    of ours takes the settings of the saved group that held its parameters, which must be one
    setting for all of them."""
    settings = {
        name: {key: value for key, value in group.items() if key != "params"}
        for group in saved
        for name in group["params"]
    }
    fitted = []
    for group in ours:
        found = [settings.get(name) for name in group["params"]]
        if not found or any(each is None or each != found[0] for each in found):
            raise CheckpointError(
                f"{step_dir}: the optimizer's parameter groups were saved in another layout "
                f"({len(saved)} groups, {len(ours)} here) that does not map onto this one; "
                "resume with the strategy that saved it"
            )
        fitted.append({**found[0], "params": list(group["params"])})  # type: ignore[dict-item]
    return fitted


def load_whole_into_shards(
    template: dict[str, Any], step_dir: Location, wanted: Mapping[str, tuple[int, ...]]
) -> None:
    """Fill ``template`` (this rank's sharded state: ``{"model": ..., "optimizer": ...}``
    keyed by name, DTensors where it holds a part) in place from a replicated strategy's
    whole files, after checking that they hold the model of shapes ``wanted`` (what all
    ranks together hold); each of its groups takes the settings of the saved group that
    held its parameters."""
    whole_model = ckread.load_file(step_dir, layout.MODEL_FILE)
    ckread.check_model_fits(wanted, whole_model, step_dir)
    fill_parts(template["model"], whole_model)
    state, groups = optimizer_state_by_name(
        ckread.load_file(step_dir, layout.OPTIMIZER_FILE), step_dir
    )
    ours = template["optimizer"]
    missing = sorted(set(ours["state"]) - set(state))
    if missing:
        raise CheckpointError(
            f"{step_dir}/{layout.OPTIMIZER_FILE} holds no optimizer state for "
            f"{len(missing)} parameter(s) this run trains (the first: {missing[0]}): resume "
            "with the strategy that saved it"
        )
    for name, entries in ours["state"].items():
        fill_parts(entries, state[name])
    ours["param_groups"] = regroup(groups, ours["param_groups"], step_dir)


def optimizer_state_by_name(
    saved: dict[str, Any], step_dir: Location
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """A whole optimizer state keyed by parameter name (state, groups), from the names the
    saving strategy wrote beside it."""
    names = saved.get(NAMES_KEY)
    groups = saved.get("param_groups", [])
    if names is None or [len(n) for n in names] != [len(g["params"]) for g in groups]:
        raise CheckpointError(
            f"{step_dir}/{layout.OPTIMIZER_FILE} does not name its parameters (saved by an "
            "earlier dtrain): resume it once with the strategy that saved it and let it write "
            "a checkpoint, which a sharded strategy then reads"
        )
    named_groups, state = [], {}
    for group, group_names in zip(groups, names):
        for index, name in zip(group["params"], group_names):
            state[name] = saved["state"].get(index, {})
        named_groups.append({**group, "params": list(group_names)})
    return state, named_groups


def fill_parts(template: dict[str, Any], whole: dict[str, Any]) -> None:
    """Each tensor of ``template`` replaced by its value in ``whole``: where the template holds
    a DTensor, this rank's part of the whole tensor, laid out as the template's (cut locally,
    no communication: every rank holds the whole)."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    for key, like in template.items():
        value = whole[key]
        if isinstance(like, DTensor):
            template[key] = distribute_tensor(
                value.to(like.dtype), like.device_mesh, like.placements, src_data_rank=None
            )
        elif isinstance(like, torch.Tensor):
            template[key] = value.to(device=like.device, dtype=like.dtype)
        else:
            template[key] = value
