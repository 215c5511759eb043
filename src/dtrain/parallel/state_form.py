"""Whether a strategy can resume a checkpoint, as the launcher sees before any worker starts.

A replicated strategy (ddp, allreduce, localsgd, diloco) saves and loads whole files
(``model.pt``); a sharded one (fsdp, tensor, pipeline) DCP shards (``dcp/``). ``strategy.*``
may change between runs, but not across these two forms: the workers would each refuse the
checkpoint after the whole start-up."""

from __future__ import annotations

from pathlib import Path

from dtrain.checkpoint import layout
from dtrain.checkpoint import read as ckread
from dtrain.errors import CheckpointError
from dtrain.parallel.base import ShardedState, Strategy


def check_state_form(cls: type[Strategy], step_dir: Path) -> None:
    """A one-line error where strategy ``cls`` cannot load the state in ``step_dir``."""
    sharded = (step_dir / layout.SHARDED_DIR).is_dir()
    whole = (step_dir / layout.MODEL_FILE).exists()
    if issubclass(cls, ShardedState) == sharded or (sharded and whole):
        return
    saved_by = ckread.load_meta(step_dir).get("strategy", "another strategy")
    forms = ("whole files (model.pt)", "DCP shards (dcp/)")
    held, wanted = (forms[1], forms[0]) if sharded else forms
    raise CheckpointError(
        f"{step_dir} holds {held}, saved by strategy {saved_by!r}; strategy.name = "
        f"{cls.name!r} resumes {wanted} only: resume with strategy.name = {saved_by!r} (or "
        f"another strategy that saves {held.split(' (')[0]}), or start a new run from its "
        f"weights with --run.init_from={step_dir}"
    )
