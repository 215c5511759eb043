"""Whether a strategy can resume a checkpoint, as the launcher sees before any worker starts.

A replicated strategy (ddp, allreduce, localsgd, diloco) saves and loads whole files
(``model.pt``); a sharded one (fsdp, tensor, pipeline) DCP shards (``dcp/``), pipeline's
optimizer state keyed otherwise than fsdp's and tensor's. ``strategy.*`` may change between
runs within what can be read: shards of fsdp and tensor by each other and by a replicated
strategy (:mod:`.cross_form`), whole files by replicated strategies only, pipeline's shards by
pipeline only. Anything else the workers would each refuse (or fail in DCP) after the whole
start-up."""

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
    saved_by = ckread.load_meta(step_dir).get("strategy", "another strategy")
    if sharded:  # a replicated strategy reads fsdp's and tensor's shards whole (cross_form)
        check_optimizer_layout(cls, saved_by, step_dir)
        return
    if not issubclass(cls, ShardedState):
        return
    raise CheckpointError(
        f"{step_dir} holds whole files (model.pt), saved by strategy {saved_by!r}; "
        f"strategy.name = {cls.name!r} resumes DCP shards (dcp/) only: resume with "
        f"strategy.name = {saved_by!r} (or another strategy that saves whole files), or start "
        f"a new run from its weights with --run.init_from={step_dir}"
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
