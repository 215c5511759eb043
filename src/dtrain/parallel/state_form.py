"""Whether a strategy can resume a checkpoint, as the launcher sees before any worker starts.

A replicated strategy (ddp, allreduce, localsgd, diloco) saves and loads whole files
(``model.pt``); a sharded one (fsdp, tensor, pipeline) DCP shards (``dcp/``), pipeline's
optimizer state keyed otherwise than fsdp's and tensor's. ``strategy.*`` may change between
runs within what can be read (:mod:`.cross_form`): fsdp's and tensor's shards by each other
and by a replicated strategy; whole files by every strategy but pipeline; pipeline's shards by
pipeline only. Anything else the workers would each refuse (or fail in DCP) after the whole
start-up."""

from __future__ import annotations

from pathlib import Path

from dtrain.checkpoint import layout
from dtrain.checkpoint import read as ckread
from dtrain.errors import CheckpointError
from dtrain.parallel import strategy_class, strategy_names
from dtrain.parallel.base import ShardedState, Strategy
from dtrain.parallel.sharded import flattened_optimizer_state


def check_state_form(cls: type[Strategy], step_dir: Path) -> None:
    """A one-line error where strategy ``cls`` cannot load the state in ``step_dir``."""
    sharded = (step_dir / layout.SHARDED_DIR).is_dir()
    saved_by = ckread.load_meta(step_dir).get("strategy", "another strategy")
    if sharded:  # a replicated strategy reads fsdp's and tensor's shards whole (cross_form)
        check_optimizer_layout(cls, saved_by, step_dir)
        return
    if not (issubclass(cls, ShardedState) and flattened_optimizer_state(cls)):
        return  # whole files into a replica, or into fsdp's or tensor's shards (cross_form)
    raise CheckpointError(
        f"{step_dir} holds whole files (model.pt), saved by strategy {saved_by!r}; "
        f"strategy.name = {cls.name!r} resumes DCP shards (dcp/) only: resume with "
        f"strategy.name = {saved_by!r} (or another strategy but pipeline), or start "
        f"a new run from its weights with --run.init_from={step_dir}"
    )


def check_optimizer_layout(cls: type[Strategy], saved_by: str, step_dir: Path) -> None:
    """Shards of the same layout: pipeline keys its optimizer state parameter by parameter
    (a stage holds some of them), fsdp and tensor keep torch's list of groups; DCP reads
    neither as the other."""
    if saved_by not in strategy_names():
        return
    if flattened_optimizer_state(strategy_class(saved_by)) == flattened_optimizer_state(cls):
        return
    raise CheckpointError(
        f"{step_dir} holds the optimizer state of strategy {saved_by!r}, laid out as "
        f"strategy.name = {cls.name!r} cannot read it (pipeline keys it per parameter, fsdp "
        f"and tensor by group): resume with strategy.name = {saved_by!r}, or start a new run "
        f"from its weights with --run.init_from={step_dir}"
    )
