"""Strategies whose model and optimizer state differ across ranks (FSDP shards, pipeline stages,
tensor-parallel slices): they give and take their state in the sharded form, which a checkpoint
writes through ``torch.distributed.checkpoint``, one file set per rank, resharded on load when
the world size or the layout changes (:mod:`dtrain.checkpoint.model_state`).

The state moves through torch's distributed state-dict API, which knows every layout these
strategies make; a strategy may set its options (``state_dict_options``).
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
import torch.distributed as dist

from dtrain.checkpoint.forms import Form, Part
from dtrain.config.layout import strategy_dims
from dtrain.parallel.base import Strategy
from dtrain.parallel.mesh import Mesh


class ShardedStrategy(Strategy):
    """A strategy whose ranks each hold part of the model and optimizer state."""

    state_form = Form.SHARDED
    state_dict_options: ClassVar[Any] = None  # torch's StateDictOptions, or None for its default

    @property
    def settings_per_name(self) -> bool:
        """Whether its optimizer state is keyed parameter by parameter (pipeline: a stage holds
        some of them) rather than as torch's list of groups (fsdp, tensor)."""
        options = self.state_dict_options
        return bool(options is not None and options.flatten_optimizer_state_dict)

    def state_dicts(self, optimizer: torch.optim.Optimizer) -> dict[str, Part]:
        """Every rank gives its part of the model and optimizer state, in a form DCP saves and
        loads in place."""
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_state, optim_state = get_state_dict(
            self.unwrapped, optimizer, options=self.state_dict_options
        )
        return {
            "model": Part(Form.SHARDED, model_state),
            "optimizer": Part(Form.SHARDED, optim_state),
        }

    def load_state_dicts(self, optimizer: torch.optim.Optimizer, states: dict[str, Any]) -> None:
        """Apply a state filled by DCP (see :meth:`state_dicts`)."""
        from torch.distributed.checkpoint.state_dict import set_state_dict

        set_state_dict(
            self.unwrapped,
            optimizer,
            model_state_dict=states["model"],
            optim_state_dict=states["optimizer"],
            options=self.state_dict_options,
        )


class MeshStrategy(ShardedStrategy):
    """A sharded strategy on one mesh of named dimensions (:mod:`dtrain.parallel.mesh`): which
    point of it a subclass trains on follows from its config
    (:func:`dtrain.config.layout.strategy_dims`); the mesh's process groups are built in
    ``setup``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.dims = strategy_dims(self.options, self.runtime.world_size)
        self.mesh: Mesh | None = None

    @property
    def coords(self) -> dict[str, int]:
        return self.dims.coords(self.runtime.rank)

    @property
    def counts_items(self) -> bool:
        # The ranks of one model-parallel group (tp, pp) hold the same items: its first
        # counts them.
        coords = self.coords
        return coords["tp"] == 0 and coords["pp"] == 0

    @property
    def data_parallel_rank(self) -> int:
        return self.dims.dp_rank(self.runtime.rank)

    @property
    def data_parallel_size(self) -> int:
        return self.dims.dp

    @property
    def data_parallel_group(self) -> dist.ProcessGroup | None:
        return None if self.mesh is None else self.mesh.dp_group
