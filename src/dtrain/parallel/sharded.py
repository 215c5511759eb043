"""Strategies whose model and optimizer state differ across ranks (FSDP shards, pipeline stages,
tensor-parallel slices): their checkpoints go through ``torch.distributed.checkpoint``, one file
set per rank, resharded on load when the world size or the layout changes.

The state moves through torch's distributed state-dict API, which knows every layout these
strategies make; a strategy may set its options (``state_dict_options``).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, ClassVar

import torch
import torch.distributed as dist

from dtrain.checkpoint import layout
from dtrain.checkpoint import read as ckread
from dtrain.checkpoint.state import CheckpointParts
from dtrain.comm.plain import all_gather_json
from dtrain.config.layout import strategy_dims
from dtrain.parallel.base import Strategy
from dtrain.parallel.cross_form import load_whole_into_shards, read_in_saved_groups, renamed
from dtrain.parallel.mesh import Mesh


def flattened_optimizer_state(cls: type[Strategy]) -> bool:
    """Whether ``cls`` keys its optimizer state parameter by parameter (pipeline: a stage
    holds some of them) rather than as torch's list of groups (fsdp, tensor)."""
    options = getattr(cls, "state_dict_options", None)
    return bool(options is not None and options.flatten_optimizer_state_dict)


class ShardedStrategy(Strategy):
    """A strategy whose ranks each hold part of the model and optimizer state."""

    state_dict_options: ClassVar[Any] = None  # torch's StateDictOptions, or None for its default
    # This rank's parameter names that the whole model gives otherwise (a pipeline stage's copy
    # of a tied parameter -> the parameter's first name), for reading other strategies' state.
    whole_names: Mapping[str, str] = {}

    def sharded_state_dict(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """``{"model": ..., "optimizer": ...}`` in a form DCP saves and loads in place."""
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_state, optim_state = get_state_dict(
            self.unwrapped, optimizer, options=self.state_dict_options
        )
        return {"model": model_state, "optimizer": optim_state}

    def load_sharded_state_dict(
        self, optimizer: torch.optim.Optimizer, state: dict[str, Any]
    ) -> None:
        """Apply a state filled by DCP (see :meth:`sharded_state_dict`)."""
        from torch.distributed.checkpoint.state_dict import set_state_dict

        set_state_dict(
            self.unwrapped,
            optimizer,
            model_state_dict=state["model"],
            optim_state_dict=state["optimizer"],
            options=self.state_dict_options,
        )

    def state_by_name(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """This rank's state in the form other strategies' checkpoints are read into
        (:mod:`.cross_form`): torch's default, each parameter by its name in the whole model
        (:attr:`whole_names`)."""
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_state, optim_state = get_state_dict(self.unwrapped, optimizer)
        return {"model": model_state, "optimizer": renamed(optim_state, self.whole_names)}

    def load_state_by_name(self, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
        """Apply a state filled in the form of :meth:`state_by_name`."""
        from torch.distributed.checkpoint.state_dict import set_state_dict

        ours = {whole: name for name, whole in self.whole_names.items()}
        set_state_dict(
            self.unwrapped,
            optimizer,
            model_state_dict=state["model"],
            optim_state_dict=renamed(state["optimizer"], ours),
        )

    def checkpoint_parts(self, optimizer: torch.optim.Optimizer) -> CheckpointParts:
        """Every rank writes its shards (collective)."""
        return CheckpointParts(sharded=self.sharded_state_dict(optimizer))

    def load_checkpoint_parts(self, optimizer: torch.optim.Optimizer, step_dir: Path) -> None:
        """Collective: every rank reads its part of the state, after checking that the
        checkpoint holds the model that all ranks together hold. Shards laid out as this
        strategy lays them out are read as they are; another strategy's whole files, or its
        shards keyed otherwise (pipeline's settings per parameter, fsdp's and tensor's list
        of groups), by parameter name (:mod:`.cross_form`)."""
        index = ckread.sharded_index(step_dir) if (step_dir / layout.SHARDED_DIR).is_dir() else None
        per_name = flattened_optimizer_state(type(self))
        own = index is not None and index.settings_per_name == per_name
        template = self.sharded_state_dict(optimizer) if own else self.state_by_name(optimizer)
        wanted = {key: tuple(value.shape) for key, value in template["model"].items()}
        if dist.is_initialized():
            # A rank may hold only part of the model (a pipeline stage): compare the
            # checkpoint with what all ranks together hold.
            every = all_gather_json({key: list(shape) for key, shape in wanted.items()})
            wanted = {key: tuple(shape) for part in every for key, shape in part.items()}
        if index is not None:
            ckread.check_model_fits(wanted, index.model_shapes, step_dir)
            read_in_saved_groups(template, step_dir, index)
        else:  # a replicated strategy's whole files
            load_whole_into_shards(template, step_dir, wanted)
        if own:
            self.load_sharded_state_dict(optimizer, template)
        else:
            self.load_state_by_name(optimizer, template)


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
