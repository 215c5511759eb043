"""Checks on the run folder made in the parent process, before any worker starts: resuming into a
folder made by a different config (which keys may change is the config's rule,
:mod:`dtrain.config.resume`), a checkpoint to resume from that does not exist, starting
afresh over old checkpoints, a folder that cannot be written, a folder another job holds
(:func:`held_run_dir`). A run folder in an object store (``s3://bucket/prefix``) is probed with
a write (:func:`check_store`): missing credentials, an endpoint that does not answer, a bucket
that does not exist or cannot be written are one line each, before any worker starts."""

from __future__ import annotations

import os
import socket
import uuid
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

from dtrain.checkpoint import layout
from dtrain.checkpoint import read as ckread
from dtrain.checkpoint.hold import JOB_ID_ENV, launch_config_path, say, take_hold
from dtrain.checkpoint.store import write_whole
from dtrain.config import Config
from dtrain.config.resume import check_resumed_config
from dtrain.errors import CheckpointError, UserError
from dtrain.fsutil import local_run_dir, require_output_folder, scheme_of, write_atomic
from dtrain.storage.objects import (
    Location,
    NoConditionalWrites,
    ObjectPath,
    StoreError,
    file_system,
    location,
    store_refusal,
)


def check_resume_folder(resume: str, run_dir: str = "") -> Location:
    """The step folder ``run.resume`` names, when it is one that a run can start from (its
    marker and meta.json; the workers verify every file): a user error otherwise."""
    path = location(resume)
    if not path.exists():
        # run.resume is a path (from the working folder), not a name in run.dir's checkpoints/.
        within = location(run_dir) / "checkpoints" / str(path) if run_dir else None
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


def check_run_dir(cfg: Config, force: bool) -> None:
    """Raise a user error when the request to start afresh or to resume does not fit what the
    folder holds."""
    root = location(cfg.run.dir) / "checkpoints"
    if cfg.run.resume == "never":
        if layout.committed_steps(root) and not force:
            raise UserError(
                f"run.dir {cfg.run.dir} already holds checkpoints and run.resume = "
                "'never': choose a new run.dir, resume with --resume auto, or pass "
                "--force to start afresh beside them"
            )
        return
    # The marker and meta.json only (a few kB): reading the whole checkpoint here would cost
    # what resuming costs once more, in one process; the workers verify every file, together.
    if cfg.run.resume == "auto":
        path, _ = ckread.find_latest_valid(root, check=ckread.check_marker_and_meta)
    else:
        path = check_resume_folder(cfg.run.resume, cfg.run.dir)
    if path is not None and not force:
        check_resumed_config(ckread.load_meta(path).get("config", ""), cfg, path)


def check_store(run_dir: ObjectPath) -> None:
    """A write probe of a run folder in an object store, with a conditional write (what the
    hold rests on): a user error naming what is wrong and what to do. A store that takes a
    second exclusive write of one key ignores the condition: said as a warning (the hold cannot
    keep two jobs apart there)."""
    label = f"run.dir {run_dir}"
    if not run_dir.bucket:
        raise UserError(f"{label}: no bucket named; give {run_dir.scheme}://BUCKET/PREFIX")
    probe = run_dir / f".dtrain-write-check-{uuid.uuid4().hex}"
    unguarded = (
        f"warning: {label}: the {run_dir.store()} %s conditional writes, so the run folder's "
        "hold cannot keep two jobs apart there: run one job per run.dir"
    )
    try:
        try:
            probe.create(b"")
            with suppress(FileExistsError):
                probe.create(b"")
                say(unguarded % "ignores")
        except NoConditionalWrites:
            probe.write_bytes(b"")
            say(unguarded % "does not implement")
        probe.unlink(missing_ok=True)
    except FileNotFoundError:
        raise UserError(
            f"{label}: the bucket {run_dir.bucket!r} does not exist in the {run_dir.store()}; "
            "create it, or choose another run.dir"
        ) from None
    except StoreError as exc:
        raise store_refusal(label, run_dir, exc, "cannot write there: ") from None
    except PermissionError as exc:
        raise UserError(
            f"{label}: the credentials may not write in bucket {run_dir.bucket!r} of the "
            f"{run_dir.store()} ({exc}); use credentials that may, or another run.dir"
        ) from None


def check_scheme(run_dir: str) -> None:
    """A URL run folder names a scheme fsspec knows and can open here: a user error
    otherwise (naming the package to install)."""
    scheme = scheme_of(run_dir)
    if not scheme:
        return
    from fsspec.registry import known_implementations, registry

    if scheme not in known_implementations and scheme not in registry:
        raise UserError(
            f"run.dir {run_dir}: unknown scheme {scheme}://; a run folder is a local path or "
            "s3://bucket/prefix (other fsspec schemes: gs://, az://, ...)"
        )
    file_system(scheme)  # a missing package (s3fs) is one line naming the extra


@contextmanager
def held_run_dir(cfg: Config, run_id: str, rdzv_endpoint: str) -> Iterator[Path]:
    """Before any worker starts: the run folder writable and held for this job (refused when
    another live job holds it), and this launcher's config written where only its own workers
    read it (the machines of a job each have their own; the workers check that they agree).
    Yields that config file; on exit, removes it and releases the hold."""
    check_scheme(cfg.run.dir)
    run_dir = location(cfg.run.dir)
    local = local_run_dir(cfg.run.dir, cfg.run.local_dir)
    if isinstance(run_dir, ObjectPath):
        check_store(run_dir)
    else:  # the folder and its checkpoints/ made if need be, and taking a file: one line if not
        for folder in (run_dir, run_dir / "checkpoints"):
            require_output_folder(folder, f"run.dir {run_dir}", choose="run.dir")
    if local != Path(str(run_dir)):
        require_output_folder(local, f"run.local_dir {local}", choose="run.local_dir")
    try:
        hold = take_hold(run_dir, run_id, rdzv_endpoint, local_dir=local)
    except OSError as exc:
        raise UserError(f"run.dir {run_dir}: cannot take it for this job: {exc}") from None
    os.environ[JOB_ID_ENV] = hold.token  # the workers name their checkpoints' job with it
    path = launch_config_path(local, socket.gethostname(), os.getpid())
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
        run_dir = location(cfg.run.dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        write_whole(run_dir / "config.toml", cfg.to_toml())
    except OSError as exc:
        say(f"warning: cannot write {cfg.run.dir}/config.toml ({exc.strerror or exc})")
