"""A replicated strategy (ddp, allreduce, localsgd, diloco) resuming a checkpoint that fsdp or
tensor saved as DCP shards: every rank reads the whole model and optimizer state out of the
shards (DCP reshards into plain tensors), keyed by parameter name as torch's distributed
state-dict API keys it, and loads it into its replica.

The other way (whole files into shards) is refused before launch (:mod:`.state_form`): a
whole-file ``optimizer.pt`` keys its state by position in the saving optimizer's groups, not
by name."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from dtrain.checkpoint import read as ckread
from dtrain.errors import CheckpointError


def load_shards_into_replica(
    model: nn.Module, optimizer: torch.optim.Optimizer, step_dir: Path
) -> None:
    """Collective: every rank fills its whole replica and optimizer from the shards."""
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model_state, optim_state = get_state_dict(model, optimizer)  # plain tensors, whole
    template: dict[str, Any] = {"model": model_state, "optimizer": optim_state}
    saved = ckread.sharded_model_shapes(step_dir)
    wanted = {key: tuple(value.shape) for key, value in template["model"].items()}
    ckread.check_model_fits(wanted, saved, step_dir)
    read_in_saved_groups(template, step_dir)
    set_state_dict(
        model, optimizer, model_state_dict=template["model"], optim_state_dict=template["optimizer"]
    )


def read_in_saved_groups(template: dict[str, Any], step_dir: Path) -> None:
    """Fill ``template`` from the shards (collective), its optimizer groups laid out as this
    rank's afterwards, where another strategy grouped the parameters otherwise (tensor
    parallelism keeps plain tensors apart from DTensors)."""
    ours = template["optimizer"].get("param_groups", [])
    groups = ckread.sharded_param_groups(step_dir) if ours else 0
    if ours and groups != len(ours):
        # Read the saved groups as they are; their settings then go to this rank's groups
        # parameter by parameter (names).
        template["optimizer"]["param_groups"] = [dict(ours[0]) for _ in range(groups)]
    ckread.load_sharded(step_dir, template)
    if ours and groups != len(ours):
        saved_groups = template["optimizer"]["param_groups"]
        template["optimizer"]["param_groups"] = regroup(saved_groups, ours, step_dir)


def regroup(
    saved: list[dict[str, Any]], ours: list[dict[str, Any]], step_dir: Path
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
