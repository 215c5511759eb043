"""Crash-consistent checkpoints: ``step-N`` folders that count only once committed.

Commit protocol (one save):

1. every rank snapshots its part of the training state into CPU memory (the only part the
   training loop waits for when saving asynchronously; an asynchronous save keeps its copy,
   and the next one copies into it instead of allocating the memory again);
2. every rank checks that its files fit on the disk, then serializes them straight into
   ``checkpoints/.tmp-step-N/`` (:mod:`dtrain.checkpoint.stream`: no copy of the state beside
   the snapshot, each piece hashed as it is written) and fsyncs each;
3. the ranks report to rank 0 (a background save over a side gloo group, never interleaving
   with the training collectives); any failure stops the commit here;
4. rank 0 renames the folder to ``step-N`` (``os.replace``), fsyncs the parent, and only then
   writes ``COMMITTED.json`` -- the completion marker holding every file's size and the
   SHA-256 of each of its pieces, and a digest of itself -- atomically (temp file, rename,
   fsync);
5. rank 0 prunes old checkpoints (marker first, so a half-deleted folder never looks whole).
   Retention counts only checkpoints known to be valid -- the ones this job wrote (their
   ``meta.json`` names the job) and the one it resumed or rolled back to -- and ranks this
   job's above any other, whatever their step numbers: a new checkpoint is never pruned in
   favour of older ones, damaged ones, or ones of a trajectory the run left.

A folder without a valid marker, or whose files do not match it, is never loaded (finding,
verifying and loading: :mod:`dtrain.checkpoint.read`). Files are plain tensors and data
written with ``torch.save`` (and DCP), which loading admits and nothing else, so it never runs
code from a checkpoint (:mod:`dtrain.checkpoint.safe_load`).
"""

from __future__ import annotations

import datetime
import json
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from contextlib import suppress
from dataclasses import KW_ONLY, asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch.distributed as dist

from dtrain.checkpoint import space
from dtrain.checkpoint.hold import job_id
from dtrain.checkpoint.layout import (
    MARKER,
    META,
    SHARDED_DIR,
    committed_steps,
    job_of,
    marker_digest,
    step_dir_name,
    step_of,
)
from dtrain.checkpoint.snapshot import snapshot
from dtrain.checkpoint.store import (
    in_background,
    move_into_place,
    remove_tree,
    set_aside,
    staging_folder,
    sync_folder,
    write_whole,
)
from dtrain.checkpoint.stream import hashing_file_system, nothing, progress_planner, write_file
from dtrain.checkpoint.upload import Uploads
from dtrain.comm.plain import broadcast_json, gather_json
from dtrain.errors import CheckpointError
from dtrain.fault.failpoints import failpoint
from dtrain.storage.objects import Location, ObjectPath

# ---------------------------------------------------------------------------------------------
# Saving


@dataclass
class _Outcome:
    """One rank's write: what failed (empty: nothing), or the marker entries of its files."""

    error: str = ""
    files: dict[str, dict[str, Any]] = field(default_factory=dict)


@dataclass(eq=False)
class Checkpointer:
    """Saves on every rank, commits on rank 0. At most one save is in flight; a failed
    background save is reported by :meth:`poll` (at the next step) and never committed.

    Made collectively when the process group is up: every rank makes the checkpointer's own
    group (``timeout``: its collectives' limit) at the same point.

    ``on_progress`` is called on the training thread as a save it waits for goes on (a file
    written or hashed, a piece of a large one): by a blocking save as it writes, and by
    :meth:`wait` as the background writer of an asynchronous one does its pieces. The writer
    thread only counts them: a thread working beside the training thread must not vouch for
    it, which may be hung meanwhile."""

    root: Location
    _: KW_ONLY
    rank: int
    world_size: int
    keep_last: int
    keep_every: int
    timeout: datetime.timedelta = datetime.timedelta(minutes=5)
    background: bool = True  # saves may be written in the background (checkpoint.async_save)
    log: Callable[[str], None] = print
    on_progress: Callable[[], None] = nothing
    last_saved_step: int | None = field(default=None, init=False)  # saved or being saved
    blocking_seconds: list[float] = field(default_factory=list, init=False)
    write_seconds: list[float] = field(default_factory=list, init=False)

    def __post_init__(self) -> None:
        # A background save has a gloo group of its own, apart from the training collectives
        # (NCCL's cannot carry CPU tensors); a gloo job's blocking saves use the default one.
        own = dist.is_initialized() and (self.background or dist.get_backend() != "gloo")
        self.group = dist.new_group(backend="gloo", timeout=self.timeout) if own else None
        self._thread: threading.Thread | None = None
        self._error: str | None = None
        self._staged: dict[str, Any] = {}  # the last async snapshot, reused by the next one
        self._pieces = 0  # pieces the background writer has done (only it counts them)
        # The steps with a marker: retention's last listing, kept by this writer since (the
        # run folder's hold keeps any other out); None until then.
        self._markers: set[int] | None = None
        # Retention's knowledge (rank 0's): this job's id, the steps this process committed,
        # those verified whole (the resume or rollback point), and each checkpoint's job.
        self.job = job_id()
        self._ours: list[int] = []  # in the order committed
        self._verified: set[int] = set()
        self._jobs: dict[int, str] = {}

    # -- in flight -----------------------------------------------------------------------

    def poll(self) -> str | None:
        """The error of a finished background save, once; None if it went well or runs on."""
        if self._thread is not None and not self._thread.is_alive():
            self._thread.join()
            self._thread = None
        return self._take_error()

    def wait(self) -> str | None:
        """Wait for the save in flight; the error of a failed one, once."""
        if self._thread is not None:
            seen = self._pieces
            while self._thread.is_alive():
                self._thread.join(timeout=0.5)
                if self._pieces != seen:  # the writer moved on: so does this wait for it
                    seen = self._pieces
                    self.on_progress()
            self._thread = None
        return self._take_error()

    def _take_error(self) -> str | None:
        error, self._error = self._error, None
        return error

    # -- saving --------------------------------------------------------------------------

    def save(
        self,
        step: int,
        files: dict[str, Any],
        meta: dict[str, Any] | None,
        *,
        blocking: bool,
        sharded: dict[str, Any] | None = None,
    ) -> None:
        """Save this rank's ``files`` (name -> state) for ``step``; rank 0 also gives ``meta``.
        ``sharded`` is a state whose tensors differ across ranks (FSDP's DTensors, pipeline
        stages): it goes through ``torch.distributed.checkpoint`` into ``dcp/``, one file set
        per rank, and can be loaded at another world size. Every rank must call ``save`` for
        the same step. Raises at once when ``blocking``.

        A blocking save writes the live state (nothing changes it while the loop waits, and
        ``torch.save`` copies a device's tensor to the host one at a time); an asynchronous
        one writes a snapshot, the only memory it adds."""
        assert blocking or self.background, "a background save needs background=True"
        previous = self.wait()  # at most one save in flight
        if previous:
            self.log(f"warning: {previous}")
        self.last_saved_step = step
        started = time.perf_counter()
        if meta is not None:
            meta = {**meta, "job": self.job}  # which checkpoints are this job's (retention)
        if blocking:
            self._write(step, files, meta, sharded, self.on_progress)
            error = self._take_error()
            self.blocking_seconds.append(time.perf_counter() - started)
            if error:
                raise CheckpointError(error)
            return
        # The previous save is written (waited for above): its copy can take this one.
        staged, self._staged = self._staged, {}
        snap = {name: snapshot(obj, staged.get(name)) for name, obj in files.items()}
        sharded_snap = snapshot(sharded)
        self.blocking_seconds.append(time.perf_counter() - started)
        self._staged = snap  # kept for the next asynchronous save (one copy of this state)
        self._thread = threading.Thread(
            target=self._write,
            args=(step, snap, meta, sharded_snap, self._count_piece),
            name=f"dtrain-ckpt-step{step}",
            daemon=True,
        )
        self._thread.start()

    def _count_piece(self) -> None:
        self._pieces += 1

    def _write(
        self,
        step: int,
        files: dict[str, Any],
        meta: dict[str, Any] | None,
        sharded: dict[str, Any] | None,
        on_progress: Callable[[], None],
    ) -> None:
        """Write, gather, commit: on the training thread for a blocking save, else on the
        background writer's (``on_progress``: what each piece done calls, on that thread)."""
        started = time.perf_counter()
        tmp = staging_folder(self.root, step_dir_name(step))
        outcome = _Outcome()
        meta_text = json.dumps(meta, indent=1, sort_keys=True).encode() if meta else b""
        need = space.state_bytes(files) + space.state_bytes(sharded) + len(meta_text)
        uploads = Uploads()  # a store's file goes on uploading while the next is written
        listed: Future[list[int]] | None = None
        try:
            if self.rank == 0 and (self._markers is None or step in self._markers):
                # A store's save writes into step-N itself: a marker there from another
                # trajectory's save of this step goes first (until the new one is written,
                # the folder does not count; a piece read meanwhile fails its checksum).
                # Skipped where rank 0's last listing, kept since, says none is there.
                (tmp / MARKER).unlink(missing_ok=True)
            if self.rank == 0 and not isinstance(tmp, Path):
                # Retention's listing of a store, asked for now: it is answered while the files
                # upload, not beside the marker's request, the commit's round trip, which it
                # slowed (12 MB: 6-15 ms against moto). Under the run folder's hold no other
                # writer changes the markers meanwhile; the commit adds this step's.
                listed = in_background(committed_steps, self.root)
            tmp.mkdir(parents=True, exist_ok=True)
            failpoint("checkpoint.write", step=step)
            space.check_room(self.root, need)
            for name, obj in files.items():
                failpoint("checkpoint.write_file", step=step, path=tmp / name)
                outcome.files[name] = write_file(tmp / name, obj, on_progress, uploads)
            if meta is not None:
                failpoint("checkpoint.write_file", step=step, path=tmp / META)
                outcome.files[META] = write_file(tmp / META, meta_text, on_progress, uploads)
            if sharded is not None:  # DCP's files, the last of the above still uploading
                outcome.files.update(self._write_sharded(tmp, sharded, on_progress, uploads))
            uploads.wait()  # every file whole in the store before this rank says it wrote
        except Exception as exc:
            uploads.abort()
            mine = [*files, *([META] if meta is not None else [])]
            why = self._why_not_written(exc, tmp, need, mine)
            outcome = _Outcome(error=why)
        outcomes = self._gather(outcome)
        error, retention = "", None
        if self.rank == 0:
            try:
                retention = self._commit(step, tmp, outcomes, listed)
            except Exception as exc:
                error = f"checkpoint {step_dir_name(step)} was not committed: {exc}"
                error += self._newest_kept()
        # Every rank acts on rank 0's outcome of the commit, not on its own write: a rank
        # that believed a failed commit had landed would skip a save the others then make
        # without it.
        error = self._agree_on_commit(step, error, outcome)
        if error:
            self._error = error
            self.last_saved_step = None
        elif self.rank == 0:
            self._prune_after(step, retention)
        self.write_seconds.append(time.perf_counter() - started)

    def _why_not_written(
        self, error: BaseException, tmp: Location, need: int, names: list[str]
    ) -> str:
        """This rank's failure to write its files (``names``, and its DCP shards), in words. A
        full disk names the folder, what this rank's files need and what is free once its
        partial files are gone."""
        if isinstance(error, space.DiskFull):
            return f"rank {self.rank}: {error}"
        if space.is_disk_full(error):
            # Rank 0 removes the whole folder once every rank has reported; this rank's own
            # partial files go now, so that the free space it reports is the disk's.
            for name in names:
                (tmp / name).unlink(missing_ok=True)
            for path in (tmp / SHARDED_DIR).glob(f"__{self.rank}_*"):
                path.unlink(missing_ok=True)
            return f"rank {self.rank}: {space.words(self.root, need)}"
        return f"rank {self.rank}: {type(error).__name__}: {error}"

    def _newest_kept(self) -> str:
        try:
            steps = committed_steps(self.root)
        except OSError:  # a store that stopped answering: the failure above says so
            return ""
        if not steps:
            return " (no earlier checkpoint exists)"
        return f"; the newest checkpoint is still {step_dir_name(steps[0])}"

    def _write_sharded(
        self,
        tmp: Location,
        state: dict[str, Any],
        on_progress: Callable[[], None],
        uploads: Uploads,
    ) -> dict[str, dict[str, Any]]:
        """Every rank writes its shards with DCP (coordinated over the side group), each file
        hashed as it is written; returns the files this rank wrote, with their marker entries."""
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter
        from torch.distributed.checkpoint.filesystem import FileSystemWriter
        from torch.distributed.checkpoint.state_dict_saver import save

        folder = tmp / SHARDED_DIR
        records: dict[str, dict[str, Any]] = {}
        # A store's file is durable once its upload completes (closed): nothing to fsync.
        writer = (
            FsspecWriter(str(folder), sync_files=False)
            if isinstance(folder, ObjectPath)
            else FileSystemWriter(str(folder), sync_files=True)
        )
        writer.fs = hashing_file_system(records, on_progress, folder, uploads)
        save(
            state,
            # One writer thread (the default): DCP writes on the thread that called it, so the
            # planner's progress marks are made there.
            storage_writer=writer,
            planner=progress_planner(on_progress),
            process_group=self.group if dist.is_initialized() else None,
        )
        written = {Path(path).name: entry for path, entry in records.items()}
        return {
            f"{SHARDED_DIR}/{name}": entry
            for name, entry in written.items()
            if name.startswith(f"__{self.rank}_") or (self.rank == 0 and name == ".metadata")
        }

    def _gather(self, outcome: _Outcome) -> list[_Outcome]:
        if self.world_size == 1 or not dist.is_initialized():
            return [outcome]
        try:
            gathered = gather_json(asdict(outcome), dst=0, group=self.group)
        except Exception as exc:
            return [_Outcome(error=f"the ranks could not agree on the save: {exc}")]
        return [_Outcome(**each) for each in gathered] if gathered is not None else [outcome]

    def _agree_on_commit(self, step: int, error: str, outcome: _Outcome) -> str:
        """Rank 0's word on the commit (``error``: empty when it committed), on every rank.
        Where the ranks cannot hear it, none of them counts the checkpoint as saved."""
        if self.world_size == 1 or not dist.is_initialized():
            return error
        try:
            word = broadcast_json(error, src=0, group=self.group)
        except Exception as exc:
            why = outcome.error or f"rank {self.rank} did not hear whether it was: {exc}"
            return f"checkpoint {step_dir_name(step)} was not committed: {why}"
        return str(word)

    def _commit(
        self, step: int, tmp: Location, outcomes: list[_Outcome], listed: Future[list[int]] | None
    ) -> Callable[[], list[int]] | None:
        """Commit the save (its marker); in a store, how retention gets the committed steps:
        ``listed``, the listing asked for as the save began, and this step."""
        failures = [o.error for o in outcomes if o.error]
        if failures:
            with suppress(OSError):  # a store that stopped answering: removed at the next start
                remove_tree(tmp)

            raise CheckpointError("; ".join(failures))
        listing: dict[str, dict[str, Any]] = {}
        for o in outcomes:
            listing.update(o.files)
        failpoint("checkpoint.before_rename", step=step)
        final = self.root / step_dir_name(step)
        if final != tmp and final.exists():
            # An older save of this step from another trajectory: one that resume skipped as
            # corrupted, or one from before a NaN rollback or a --resume of an earlier step.
            # This save holds the state the run has now, so it replaces the old one (keeping
            # the old one would leave a corrupted or stale checkpoint as "latest").
            self._discard(final)
        self._jobs.pop(step, None)
        move_into_place(tmp, final)  # a store's save wrote into final: no rename
        try:
            failpoint("checkpoint.before_marker", step=step)
            marker = {
                "step": step,
                "files": listing,
                "world_size": self.world_size,
                "committed": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            }
            marker["marker_sha256"] = marker_digest(marker)
            # Written last, whole or not at all: the commit.
            write_whole(final / MARKER, json.dumps(marker, indent=1, sort_keys=True))
        except BaseException:
            # Not committed: its space goes back (a full disk is the likeliest cause).
            remove_tree(final)
            raise
        self._ours = [s for s in self._ours if s != step] + [step]
        self._markers = None if self._markers is None else self._markers | {step}
        if listed is None:
            return None
        return lambda: sorted({*listed.result(), step}, reverse=True)

    def _prune_after(self, step: int, listed: Callable[[], list[int]] | None) -> None:
        """Retention after a commit; a failure to prune is a warning, never a failed save."""
        try:
            failpoint("checkpoint.after_marker", step=step)
            self.prune(listed)
        except Exception as exc:
            self.log(f"warning: pruning old checkpoints after {step_dir_name(step)}: {exc}")

    # -- retention -----------------------------------------------------------------------

    def note_verified(self, step: int) -> None:
        """``step`` verified whole (the checkpoint a run resumed or rolled back to): it counts
        as valid for retention."""
        self._verified.add(step)

    def is_ours(self, step: int) -> bool:
        """Whether checkpoint ``step`` was written by this job (this process, or an earlier
        attempt of the same job, as its ``meta.json`` says)."""
        if step in self._ours:
            return True
        if not self.job:
            return False
        if step not in self._jobs:
            self._jobs[step] = job_of(self.root / step_dir_name(step))
        return self._jobs[step] == self.job

    def prune(self, listed: Callable[[], list[int]] | None = None) -> None:
        """Delete old checkpoints: keep the ``keep_last`` newest that are known to be valid --
        newest in the order this process committed them, then the rest of this job's by step,
        then the others by step -- and every one before the last of them in that order (a
        damaged or unchecked one among them counts for nothing, and is kept), and every step
        divisible by ``keep_every``. ``listed``: the committed steps (default: listed now)."""
        steps = listed() if listed is not None else committed_steps(self.root)
        self._markers = set(steps)  # less each one discarded below
        mine = [s for s in reversed(self._ours) if s in steps]
        ours = mine + [s for s in steps if s not in mine and self.is_ours(s)]
        order = ours + [s for s in steps if s not in ours]
        keep: set[int] = set()
        counted = 0
        for s in order:
            if counted >= self.keep_last:
                break
            keep.add(s)
            counted += s in self._verified or s in ours
        else:
            return  # fewer known-valid checkpoints than keep_last: all stay
        if self.keep_every > 0:
            keep.update(s for s in steps if s % self.keep_every == 0)
        for step in steps:
            if step not in keep:
                self._discard(self.root / step_dir_name(step))
                self._jobs.pop(step, None)

    def _discard(self, folder: Location) -> None:
        """Delete a checkpoint folder, uncommitting it first, so that an interruption never
        leaves a half-deleted folder that looks whole."""
        (folder / MARKER).unlink(missing_ok=True)
        if self._markers is not None:
            self._markers -= {step_of(folder.name)}
        sync_folder(folder)
        remove_tree(set_aside(folder, self.root / f".trash-{folder.name}"))
