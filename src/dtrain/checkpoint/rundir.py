"""Checks on the run folder made in the parent process, before any worker starts: resuming into a
folder made by a different config (which keys may change is the config's rule,
:mod:`dtrain.config.resume`), a checkpoint to resume from that does not exist, starting
afresh over old checkpoints, a folder that cannot be written, a folder another job holds
(:func:`held_run_dir`)."""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from dtrain.checkpoint import layout
from dtrain.checkpoint import read as ckread
from dtrain.checkpoint.hold import JOB_ID_ENV, launch_config_path, say, take_hold
from dtrain.config import Config
from dtrain.config.resume import check_resumed_config
from dtrain.errors import CheckpointError, UserError
from dtrain.fsutil import require_output_folder, write_atomic


def check_resume_folder(resume: str, run_dir: str = "") -> Path:
    """The step folder ``run.resume`` names, when it is one that a run can start from (its
    marker and meta.json; the workers verify every file): a user error otherwise."""
    path = Path(resume)
    if not path.exists():
        # run.resume is a path (from the working folder), not a name in run.dir's checkpoints/.
        within = Path(run_dir) / "checkpoints" / path if run_dir else None
        hint = f": did you mean {within}?" if within is not None and within.is_dir() else ""
        raise CheckpointError(f"checkpoint folder {path} does not exist{hint}")
    root_given = path / "checkpoints" if (path / "checkpoints").is_dir() else path
    held = layout.committed_steps(root_given)
    if held:  # a run folder (or its checkpoints/), not a step folder
        newest = root_given / layout.step_dir_name(max(held))
        raise CheckpointError(
            f"run.resume = '{path}' holds checkpoints but is none itself: give one of its "
            f"step folders ({newest}, its newest), or run.resume = 'auto' with that run's "
            "run.dir"
        )
    ckread.check_marker_and_meta(path)
    return path


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
    # The marker and meta.json only (a few kB): reading the whole checkpoint here would cost
    # what resuming costs once more, in one process; the workers verify every file, together.
    if cfg.run.resume == "auto":
        path, _ = ckread.find_latest_valid(root, check=ckread.check_marker_and_meta)
    else:
        path = check_resume_folder(cfg.run.resume, cfg.run.dir)
    if path is None:
        return None
    if not force:
        check_resumed_config(ckread.load_meta(path).get("config", ""), cfg, path)
    return path


def check_writable(run_dir: Path) -> None:
    """The run folder and its ``checkpoints/`` exist (made if need be) and take a file: a
    one-line user error otherwise (read-only, not ours, a file where a folder should be)."""
    for folder in (run_dir, run_dir / "checkpoints"):
        require_output_folder(folder, f"run.dir {run_dir}", choose="run.dir")


@contextmanager
def held_run_dir(cfg: Config, run_id: str, rdzv_endpoint: str) -> Iterator[Path]:
    """Before any worker starts: the run folder writable and held for this job (refused when
    another live job holds it), and this launcher's config written where only its own workers
    read it (the machines of a job each have their own; the workers check that they agree).
    Yields that config file; on exit, removes it and releases the hold."""
    run_dir = Path(cfg.run.dir)
    check_writable(run_dir)
    try:
        hold = take_hold(run_dir, run_id, rdzv_endpoint)
    except OSError as exc:
        raise UserError(f"run.dir {run_dir}: cannot take it for this job: {exc}") from None
    os.environ[JOB_ID_ENV] = hold.token  # the workers name their checkpoints' job with it
    path = launch_config_path(run_dir, socket.gethostname(), os.getpid())
    try:
        write_atomic(path, cfg.to_toml())
        yield path
    finally:
        path.unlink(missing_ok=True)
        hold.release()


def write_config_of_record(cfg: Config) -> None:
    """``RUN_DIR/config.toml``, the resolved config; a disk that cannot take it is a warning
    (the checkpoints hold the config too, in meta.json)."""
    try:
        os.makedirs(cfg.run.dir, exist_ok=True)
        write_atomic(os.path.join(cfg.run.dir, "config.toml"), cfg.to_toml())
    except OSError as exc:
        say(f"warning: cannot write {cfg.run.dir}/config.toml ({exc.strerror or exc})")
