"""Whether a strategy can resume a checkpoint, as the launcher sees before any worker starts.

A replicated strategy (ddp, allreduce, localsgd, diloco) saves and loads whole files
(``model.pt``); a sharded one (fsdp, tensor, pipeline) DCP shards (``dcp/``), pipeline's
optimizer state keyed otherwise than fsdp's and tensor's. ``strategy.*`` may change between
runs, but not across these forms: the workers would each refuse the checkpoint (or fail in
DCP) after the whole start-up."""

from __future__ import annotations

from pathlib import Path

from dtrain.checkpoint import layout
from dtrain.checkpoint import read as ckread
from dtrain.errors import CheckpointError
from dtrain.parallel import strategy_class, strategy_names
from dtrain.parallel.base import ShardedState, Strategy


def check_state_form(cls: type[Strategy], step_dir: Path) -> None:
    """A one-line error where strategy ``cls`` cannot load the state in ``step_dir``."""
    sharded = (step_dir / layout.SHARDED_DIR).is_dir()
    whole = (step_dir / layout.MODEL_FILE).exists()
    saved_by = ckread.load_meta(step_dir).get("strategy", "another strategy")
    if sharded and issubclass(cls, ShardedState):
        check_optimizer_layout(cls, saved_by, step_dir)
    if issubclass(cls, ShardedState) == sharded or (sharded and whole):
        return
    forms = ("whole files (model.pt)", "DCP shards (dcp/)")
    held, wanted = (forms[1], forms[0]) if sharded else forms
    raise CheckpointError(
        f"{step_dir} holds {held}, saved by strategy {saved_by!r}; strategy.name = "
        f"{cls.name!r} resumes {wanted} only: resume with strategy.name = {saved_by!r} (or "
        f"another strategy that saves {held.split(' (')[0]}), or start a new run from its "
        f"weights with --run.init_from={step_dir}"
    )


def check_optimizer_layout(cls: type[Strategy], saved_by: str, step_dir: Path) -> None:
    """Shards of the same layout: pipeline keys its optimizer state parameter by parameter
    (a stage holds some of them), fsdp and tensor keep torch's list of groups; DCP reads
    neither as the other."""
    if saved_by not in strategy_names():
        return
    if flattened(strategy_class(saved_by)) == flattened(cls):
        return
    raise CheckpointError(
        f"{step_dir} holds the optimizer state of strategy {saved_by!r}, laid out as "
        f"strategy.name = {cls.name!r} cannot read it (pipeline keys it per parameter, fsdp "
        f"and tensor by group): resume with strategy.name = {saved_by!r}, or start a new run "
        f"from its weights with --run.init_from={step_dir}"
    )


def flattened(cls: type[Strategy]) -> bool:
    options = getattr(cls, "state_dict_options", None)
    return bool(options is not None and options.flatten_optimizer_state_dict)
