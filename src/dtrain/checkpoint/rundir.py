"""Checks on the run folder made in the parent process, before any worker starts: resuming into a
folder made by a different config, a checkpoint to resume from that does not exist, starting
afresh over old checkpoints."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from dtrain.checkpoint import layout
from dtrain.checkpoint import read as ckread
from dtrain.config import Config
from dtrain.config_load import REMOVED, RENAMED
from dtrain.errors import CheckpointError, UserError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

# Keys a resumed run may change without changing what is being trained.
SAFE_TO_CHANGE = (
    "run.dir",
    "run.resume",
    "train.steps",
    "train.log_every",
    "eval.",
    "checkpoint.",
    "dist.",
    "data.num_workers",
    "data.prefetch",
    "strategy.",
    "metrics.",
    "comm.transport",  # how sums travel, not what they are
)


def flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(flatten(value, name + "."))
        else:
            out[name] = value
    return out


def config_differences(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """The keys that differ and may not; a key the saved config lacks (a checkpoint made
    before the key existed) counts as its default, which is what that run trained with. A key
    since renamed is compared under its new name; one since removed changes nothing."""
    before, after = flatten(saved), flatten(current)
    for old, (new, _note) in RENAMED.items():
        if old in before:
            before.setdefault(new, before.pop(old))
    for gone in REMOVED:
        before.pop(gone, None)
    for key, default in flatten(Config().to_dict()).items():
        before.setdefault(key, default)
    diffs = []
    for key in sorted(set(before) | set(after)):
        if key.startswith(SAFE_TO_CHANGE) or key in SAFE_TO_CHANGE:
            continue
        if before.get(key) != after.get(key):
            diffs.append(f"{key}: {before.get(key, '(unset)')!r} -> {after.get(key, '(unset)')!r}")
    return diffs


def check_run_dir(cfg: Config, force: bool) -> Path | None:
    """The checkpoint the run will resume from (None: a fresh start); raises a user error
    when the request does not fit what the folder holds."""
    root = Path(cfg.run.dir) / "checkpoints"
    if cfg.run.resume == "never":
        if layout.committed_steps(root) and not force:
            raise UserError(
                f"run.dir {cfg.run.dir} already holds checkpoints and run.resume = "
                "'never': choose a new run.dir, resume with --resume auto, or pass "
                "--force to start afresh beside them"
            )
        return None
    if cfg.run.resume == "auto":
        path, _ = ckread.find_latest_valid(root)
    else:
        path = Path(cfg.run.resume)
        if not path.exists():
            raise CheckpointError(f"checkpoint folder {path} does not exist")
        ckread.verify_checkpoint(path)
    if path is None:
        return None
    meta = ckread.load_meta(path)
    try:
        saved = tomllib.loads(meta.get("config", ""))
    except tomllib.TOMLDecodeError:
        saved = {}
    diffs = config_differences(saved, cfg.to_dict())
    if diffs and not force:
        shown = "; ".join(diffs[:10]) + (f"; ... {len(diffs) - 10} more" if len(diffs) > 10 else "")
        raise UserError(
            f"{path} was made with a different config ({shown}); use a new "
            "run.dir, or pass --force to resume anyway"
        )
    return path


def make_run_dir(run_dir: str | Path) -> Path:
    """Create the run folder (and its parents) if needed; a path that is, or runs through, a
    file is the user's mistake, said in one line."""
    path = Path(run_dir)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError):
        blocker = next((p for p in (path, *path.parents) if p.exists() and not p.is_dir()), path)
        raise UserError(
            f"run.dir {run_dir}: {blocker} is a file, not a folder; choose another run.dir"
        ) from None
    return path
