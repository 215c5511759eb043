"""Whether a strategy can resume a checkpoint, as the launcher sees before any worker starts.

A replicated strategy (ddp, allreduce, localsgd, diloco) saves and loads whole files
(``model.pt``, ``optimizer.pt``); a sharded one (fsdp, tensor, pipeline and their composed
layouts) DCP shards (``dcp/``), pipeline's optimizer settings kept per parameter, fsdp's and
tensor's as torch's list of groups. ``strategy.*`` may change between runs: every strategy
reads every other's state by parameter name (:mod:`.cross_form`). What none can read is whole
files whose ``optimizer.pt`` does not name its parameters (written by a dtrain from before the
names) into a sharded strategy: torch keys that state by position in the saving optimizer's
groups, which only a replicated strategy shares. The workers would each refuse it after the
whole start-up; the launcher reads the names (not the tensors: the file is mapped) first."""

from __future__ import annotations

from pathlib import Path

from dtrain.checkpoint import layout
from dtrain.checkpoint import read as ckread
from dtrain.checkpoint.forms import NAMES_KEY, Form
from dtrain.checkpoint.safe_load import torch_load
from dtrain.errors import CheckpointError


def check_state_form(strategy: str, form: Form, step_dir: Path) -> None:
    """A one-line error where strategy ``strategy``, whose state is in ``form``, cannot load
    the state in ``step_dir``."""
    if (step_dir / layout.SHARDED_DIR).is_dir() or form is not Form.SHARDED:
        return  # shards into any strategy, whole files into a replica
    if names_its_parameters(step_dir / layout.OPTIMIZER_FILE):
        return  # whole files cut into shards by name
    saved_by = ckread.load_meta(step_dir).get("strategy", "another strategy")
    raise CheckpointError(
        f"{step_dir / layout.OPTIMIZER_FILE} does not name its parameters (saved by an earlier "
        f"dtrain), which strategy.name = {strategy!r} reads them by: resume it once with "
        f"strategy.name = {saved_by!r} and let it write a checkpoint, or start a new run from "
        f"its weights with --run.init_from={step_dir}"
    )


def names_its_parameters(path: Path) -> bool:
    """Whether a whole ``optimizer.pt`` names its groups' parameters; True where it cannot
    be read here (the workers verify every file and say what is wrong with it)."""
    try:
        # Mapped, not read: the state's tensors stay on disk.
        saved = torch_load(path, mmap=True)
    except Exception:
        return True
    return not isinstance(saved, dict) or NAMES_KEY in saved
