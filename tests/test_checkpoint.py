"""Checkpoint commit, verification, corruption handling and retention (no processes needed)."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from dtrain.checkpoint import layout, verify
from dtrain.checkpoint import read as ckread
from dtrain.checkpoint import write as ckpt
from dtrain.checkpoint.stream import PieceHasher
from dtrain.errors import CheckpointError
from dtrain.fault.failpoints import failpoints
from tests.conftest import REPO


def make_checkpointer(root: Path, **kwargs: int) -> ckpt.Checkpointer:
    options = {"keep_last": 10, "keep_every": 0} | kwargs
    return ckpt.Checkpointer(root, rank=0, world_size=1, log=lambda _: None, **options)


def state(step: int) -> dict[str, object]:
    g = torch.Generator().manual_seed(step)
    return {
        "model.pt": {"w": torch.randn(64, 64, generator=g), "b": torch.zeros(3)},
        "train_state.pt": {"trainer": {"step": step}, "data": {"consumed": step * 8}},
    }


def save(c: ckpt.Checkpointer, step: int, blocking: bool = True) -> None:
    c.save(step, state(step), {"step": step, "world_size": 1}, blocking=blocking)


def test_commit_writes_marker_last_with_checksums(tmp_path: Path) -> None:
    c = make_checkpointer(tmp_path)
    save(c, 5)
    folder = tmp_path / "step-00000005"
    marker = json.loads((folder / "COMMITTED.json").read_text())
    assert set(marker["files"]) == {"model.pt", "train_state.pt", "meta.json"}
    ckread.verify_checkpoint(folder)
    loaded = ckread.load_file(folder, "model.pt")
    assert torch.equal(loaded["w"], state(5)["model.pt"]["w"])  # type: ignore[index]
    assert not list(tmp_path.glob(".tmp-*"))


def test_async_save_is_the_snapshot_not_the_later_state(tmp_path: Path) -> None:
    c = make_checkpointer(tmp_path)
    weights = {"w": torch.ones(256, 256)}
    c.save(3, {"model.pt": weights}, {"step": 3}, blocking=False)
    weights["w"].add_(1.0)  # training goes on changing the live tensors
    assert c.wait() is None
    assert torch.equal(
        ckread.load_file(tmp_path / "step-00000003", "model.pt")["w"], torch.ones(256, 256)
    )


def test_async_saves_reuse_the_snapshot_and_still_save_each_state(tmp_path: Path) -> None:
    c = make_checkpointer(tmp_path)
    weights = {"w": torch.ones(64, 64), "b": torch.zeros(3)}
    c.save(1, {"model.pt": weights}, {"step": 1}, blocking=False)
    first = c._staged["model.pt"]["w"]
    weights["w"].add_(1.0)
    weights["extra"] = torch.full((2,), 7.0)  # the state may change shape between saves
    c.save(2, {"model.pt": weights}, {"step": 2}, blocking=False)
    assert c._staged["model.pt"]["w"] is first  # copied into, not allocated again
    weights["w"].add_(1.0)  # training goes on
    assert c.wait() is None
    one = ckread.load_file(tmp_path / "step-00000001", "model.pt")
    two = ckread.load_file(tmp_path / "step-00000002", "model.pt")
    assert torch.equal(one["w"], torch.ones(64, 64)) and "extra" not in one
    assert torch.equal(two["w"], torch.full((64, 64), 2.0))
    assert torch.equal(two["extra"], torch.full((2,), 7.0))


def corrupt(path: Path, how: str) -> None:
    data = bytearray(path.read_bytes())
    if how == "truncate":
        path.write_bytes(bytes(data[: len(data) // 2]))
    elif how == "zero-fill":
        path.write_bytes(bytes(len(data)))
    elif how == "bit-flip":
        data[len(data) // 3] ^= 0x10
        path.write_bytes(bytes(data))
    elif how == "delete":
        path.unlink()
    elif how == "append":
        path.write_bytes(bytes(data) + b"x")


@pytest.mark.parametrize("how", ["truncate", "zero-fill", "bit-flip", "delete", "append"])
@pytest.mark.parametrize("victim", ["model.pt", "train_state.pt", "meta.json", "COMMITTED.json"])
def test_corrupted_newest_is_skipped_for_the_previous(
    tmp_path: Path, how: str, victim: str
) -> None:
    c = make_checkpointer(tmp_path)
    save(c, 10)
    save(c, 20)
    corrupt(tmp_path / "step-00000020" / victim, how)
    chosen, skipped = ckread.find_latest_valid(tmp_path)
    assert chosen == tmp_path / "step-00000010"
    assert [p.name for p, _ in skipped] == ["step-00000020"]
    with pytest.raises(CheckpointError):
        ckread.verify_checkpoint(tmp_path / "step-00000020")


@pytest.mark.parametrize("how", ["truncate", "delete"])
def test_a_new_save_replaces_an_older_one_of_the_same_step(tmp_path: Path, how: str) -> None:
    # Resume skipped a corrupted step-20 and went back to step-10; when the run reaches step 20
    # again, its save must replace the corrupted folder, not be dropped in favour of it.
    c = make_checkpointer(tmp_path)
    save(c, 10)
    save(c, 20)
    corrupt(tmp_path / "step-00000020" / "model.pt", how)
    newer = state(21)
    c.save(20, newer, {"step": 20, "world_size": 1}, blocking=True)
    assert ckread.find_latest_valid(tmp_path)[0] == tmp_path / "step-00000020"
    loaded = ckread.load_file(tmp_path / "step-00000020", "model.pt")
    assert torch.equal(loaded["w"], newer["model.pt"]["w"])  # type: ignore[index]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000010", "step-00000020"]


def test_any_damage_to_the_marker_is_detected(tmp_path: Path) -> None:
    # Not only the files it lists: a flipped bit anywhere in COMMITTED.json itself (its
    # timestamp, a key, its own digest) must not leave the checkpoint looking whole.
    c = make_checkpointer(tmp_path)
    save(c, 1)
    path = tmp_path / "step-00000001" / "COMMITTED.json"
    good = path.read_bytes()
    for offset in range(len(good)):
        data = bytearray(good)
        data[offset] ^= 1 << (offset % 8)
        path.write_bytes(bytes(data))
        with pytest.raises(CheckpointError):
            ckread.verify_checkpoint(tmp_path / "step-00000001")
    path.write_bytes(good)
    ckread.verify_checkpoint(tmp_path / "step-00000001")


def test_reason_names_the_bad_file(tmp_path: Path) -> None:
    c = make_checkpointer(tmp_path)
    save(c, 1)
    corrupt(tmp_path / "step-00000001" / "model.pt", "bit-flip")
    with pytest.raises(CheckpointError, match=r"model\.pt fails its SHA-256 checksum"):
        ckread.verify_checkpoint(tmp_path / "step-00000001")


def test_interrupted_saves_leave_nothing_that_loads(tmp_path: Path) -> None:
    c = make_checkpointer(tmp_path)
    save(c, 1)
    for phase in ("write", "before_rename", "before_marker"):

        def boom(name: str, phase: str = phase, **_: object) -> None:
            if name == f"checkpoint.{phase}":
                raise RuntimeError(f"crash at {phase}")

        with failpoints(boom), pytest.raises(CheckpointError, match="not committed"):
            save(c, 2)
        chosen, _ = ckread.find_latest_valid(tmp_path)
        assert chosen == tmp_path / "step-00000001"
        ckread.remove_leftovers(tmp_path)  # what a kill -9 would have left (see chaos tests)
        assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000001"]


def test_failed_background_save_is_reported_and_never_latest(tmp_path: Path) -> None:
    c = make_checkpointer(tmp_path)
    save(c, 1)

    def disk_full(name: str, **_: object) -> None:
        if name == "checkpoint.before_marker":
            raise OSError("disk full")

    with failpoints(disk_full):  # in the background writer's thread
        save(c, 2, blocking=False)
        error = c.wait()
    assert error is not None and "disk full" in error
    assert ckread.find_latest_valid(tmp_path)[0] == tmp_path / "step-00000001"


def test_saves_and_checks_mark_progress_on_the_training_thread_only(tmp_path: Path) -> None:
    # What keeps the hang backstop off a long save or resume check: progress marks, made on
    # the thread that waits for the work (a writer thread's own would vouch for a training
    # thread that may be hung).
    marks: list[str] = []
    here = threading.current_thread().name
    c = ckpt.Checkpointer(
        tmp_path,
        rank=0,
        world_size=1,
        keep_last=10,
        keep_every=0,
        log=lambda _: None,
        on_progress=lambda: marks.append(threading.current_thread().name),
    )
    save(c, 1)  # blocking: model.pt, train_state.pt, meta.json
    assert len(marks) >= 3 and set(marks) == {here}
    marks.clear()

    def slow(name: str, **_: object) -> None:
        if name == "checkpoint.write_file":
            time.sleep(0.3)  # the writer is still at it when the wait begins

    with failpoints(slow):
        save(c, 2, blocking=False)
        assert c.wait() is None
    assert marks and set(marks) == {here}  # by the wait, as the writer moved on
    marks.clear()
    ckread.verify_checkpoint(tmp_path / "step-00000002", lambda: marks.append("hashed"))
    assert len(marks) >= 3  # at least once a file


def test_retention_keeps_last_k_and_every_m(tmp_path: Path) -> None:
    c = make_checkpointer(tmp_path, keep_last=2, keep_every=30)
    for step in range(10, 101, 10):
        save(c, step)
    assert layout.committed_steps(tmp_path) == [100, 90, 60, 30]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_loading_never_executes_code(tmp_path: Path) -> None:
    class Evil:
        def __reduce__(self) -> tuple[object, ...]:
            return (os.system, ("echo pwned > " + str(tmp_path / "pwned"),))

    folder = tmp_path / "step-00000001"
    folder.mkdir()
    torch.save({"x": Evil()}, folder / "model.pt")
    with pytest.raises(CheckpointError, match="is not a checkpoint's data: it tries to load posix"):
        ckread.load_file(folder, "model.pt")
    assert not (tmp_path / "pwned").exists()


def test_missing_checkpoint_folder(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="does not exist"):
        ckread.verify_checkpoint(tmp_path / "step-00000009")


@pytest.mark.skipif(
    not Path("/proc/self/clear_refs").exists(), reason="needs Linux's /proc/self/clear_refs"
)
def test_a_save_adds_no_more_memory_than_its_snapshot(tmp_path: Path) -> None:
    # Measured in a fresh process, by the resident set's high-water mark (tests/save_memory.py
    # says why): an asynchronous save holds its snapshot and streams it to the files, so it
    # adds the snapshot and nothing more; a blocking one streams the live state and adds
    # about nothing. (Serializing each file into memory first added half the state again.)
    proc = subprocess.run(
        [sys.executable, "-m", "tests.save_memory", str(tmp_path / "ckpt"), "64"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    measured = json.loads(proc.stdout.strip().splitlines()[-1])
    snapshot = measured["snapshot"]
    assert measured["async_extra"] <= 1.1 * snapshot, measured
    assert measured["blocking_extra"] <= 0.1 * snapshot, measured


def test_retention_never_prunes_a_new_checkpoint_for_damaged_older_ones(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # An earlier job left steps 90 and 100, both since damaged: resume skipped them and this
    # job started from scratch. Counting them as the newest two (their step numbers are
    # higher) pruned every new checkpoint right after it was written.
    monkeypatch.setenv("DTRAIN_JOB_ID", "earlier-job")
    earlier = make_checkpointer(tmp_path, keep_last=2)
    for step in (90, 100):
        save(earlier, step)
        corrupt(tmp_path / layout.step_dir_name(step) / "model.pt", "bit-flip")
    monkeypatch.setenv("DTRAIN_JOB_ID", "this-job")
    c = make_checkpointer(tmp_path, keep_last=2)
    for step in (20, 40, 60, 80):
        save(c, step)
        assert ckread.find_latest_valid(tmp_path)[0] == tmp_path / layout.step_dir_name(step)
    assert layout.committed_steps(tmp_path) == [80, 60]
    # A later attempt of the same job (a new process) knows its own checkpoints by meta.json.
    again = make_checkpointer(tmp_path, keep_last=2)
    save(again, 30)
    assert layout.committed_steps(tmp_path) == [80, 30]


def test_retention_counts_the_checkpoint_resumed_from(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DTRAIN_JOB_ID", "earlier-job")
    earlier = make_checkpointer(tmp_path, keep_last=3)
    for step in (10, 20, 30):
        save(earlier, step)
    monkeypatch.setenv("DTRAIN_JOB_ID", "this-job")
    c = make_checkpointer(tmp_path, keep_last=2)
    c.note_verified(30)  # resumed from it
    save(c, 40)
    assert layout.committed_steps(tmp_path) == [40, 30]


def test_pieces_hashed_as_they_stream_match_each_piece_hashed_alone() -> None:
    data = os.urandom(10_000)
    hasher = PieceHasher(piece_bytes=4096)
    for start, end in [(0, 1), (1, 4095), (4095, 4097), (4097, 9000), (9000, 10_000)]:
        hasher.update(data[start:end])
    expected = [hashlib.sha256(data[i : i + 4096]).hexdigest() for i in range(0, 10_000, 4096)]
    assert hasher.digests() == expected and hasher.size == 10_000
    assert PieceHasher(4096).digests() == [hashlib.sha256(b"").hexdigest()]  # one empty piece
    exact = PieceHasher(4096)
    exact.update(data[:8192])
    assert len(exact.digests()) == 2 == layout.piece_count(8192, 4096)


def _marker_of(sizes: dict[str, int], piece_bytes: int) -> dict[str, object]:
    return {
        "files": {
            name: {
                "bytes": size,
                "piece_bytes": piece_bytes,
                "pieces": ["0" * 64] * layout.piece_count(size, piece_bytes),
            }
            for name, size in sizes.items()
        }
    }


@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 7, 32])
def test_every_piece_is_verified_once_by_one_rank_its_own_files_by_their_rank(
    world_size: int,
) -> None:
    mib = 2**20
    sizes = {
        "model.pt": 300 * mib + 5,
        "optimizer.pt": 600 * mib,
        "train_state.pt": 3000,
        "meta.json": 900,
        "dcp/.metadata": 20_000,
        **{f"rng-rank{r:05d}.pt": 1500 for r in range(4)},
        **{f"dcp/__{r}_0.distcp": 50 * mib for r in range(4)},
    }
    marker = _marker_of(sizes, 64 * mib)
    shares = verify.assign(marker, world_size)
    pieces = [(p.name, p.index) for share in shares for p in share]
    assert sorted(pieces) == sorted({(p.name, p.index) for p in verify.pieces_of(marker)})
    assert len(pieces) == len(set(pieces))  # once each
    for rank, share in enumerate(shares):
        for piece in share:
            owner = verify.owner_of(piece.name, world_size)
            assert owner in (None, rank), (piece.name, rank)
        if rank < 4:  # a rank's own files are its own, when it exists
            assert any(p.name == f"rng-rank{rank:05d}.pt" for p in share)
    loads = [sum(p.length for p in share) for share in shares]
    assert max(loads) - min(loads) <= 64 * mib + 50 * mib  # a piece, and an owned file
    assert verify.assign(marker, world_size) == shares  # the same on every rank


def test_a_marker_of_an_earlier_format_is_refused(tmp_path: Path) -> None:
    # Whole-file digests (before pieces), or no digest of its own: no such format is read.
    c = make_checkpointer(tmp_path)
    save(c, 1)
    folder = tmp_path / "step-00000001"
    ckread.verify_checkpoint(folder)
    marker = json.loads((folder / "COMMITTED.json").read_text())
    unsealed = {k: v for k, v in marker.items() if k != "marker_sha256"}
    (folder / "COMMITTED.json").write_text(json.dumps(unsealed))
    with pytest.raises(CheckpointError, match=r"fails its own SHA-256 checksum$"):
        ckread.verify_checkpoint(folder)
    for name, info in marker["files"].items():
        digest = hashlib.sha256((folder / name).read_bytes()).hexdigest()
        marker["files"][name] = {"bytes": info["bytes"], "sha256": digest}
    marker["marker_sha256"] = layout.marker_digest(marker)
    (folder / "COMMITTED.json").write_text(json.dumps(marker))
    with pytest.raises(CheckpointError, match=r"is corrupted: bad entry for"):
        ckread.verify_checkpoint(folder)


@pytest.mark.parametrize("umask", [0o022, 0o077])
def test_checkpoint_files_follow_the_umask(tmp_path: Path, umask: int) -> None:
    """Whole files (torch.save), the marker, and DCP's shards and metadata: 0666 less the
    umask, folders 0777 less it, as the run folder around them (an export reads them)."""
    old = os.umask(umask)
    try:
        c = make_checkpointer(tmp_path)
        save(c, 5)
        c.save(6, {}, {"step": 6}, blocking=True, sharded={"model": {"w": torch.ones(4)}})
    finally:
        os.umask(old)
    entries = list(tmp_path.rglob("*"))
    assert {p.name for p in entries} >= {"model.pt", "COMMITTED.json", ".metadata", "dcp"}
    for p in entries:
        want = (0o777 if p.is_dir() else 0o666) & ~umask
        assert p.stat().st_mode & 0o777 == want, p
