"""Finding the repeated blocks of a model (the units FSDP shards one by one)."""

from __future__ import annotations

from torch import nn

from dtrain.errors import ConfigError

BLOCK_ATTRIBUTES = ("blocks", "layers", "h", "layer")


def find_blocks(model: nn.Module) -> list[nn.Module]:
    """The model's transformer blocks: ``model.blocks`` / ``layers`` / ``h`` when it is a
    ``ModuleList``, else the largest ``ModuleList`` anywhere in the model."""
    for name in BLOCK_ATTRIBUTES:
        candidate = getattr(model, name, None)
        if isinstance(candidate, (nn.ModuleList, nn.Sequential)) and len(candidate) > 0:
            return list(candidate)
    lists: list[nn.ModuleList] = [
        m for m in model.modules() if isinstance(m, nn.ModuleList) and len(m) > 0
    ]
    if lists:
        longest = lists[0]
        for candidate_list in lists[1:]:
            if len(candidate_list) > len(longest):
                longest = candidate_list
        return list(longest)
    raise ConfigError(
        f"cannot find the repeated blocks of {type(model).__name__} (the units it applies "
        "to, one by one): "
        "expected an nn.ModuleList attribute named blocks, layers or h (or give "
        "Task.shard_units)"
    )
