"""Checkpoint commit, verification, corruption handling and retention (no processes needed)."""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

import pytest
import torch

from dtrain.checkpoint import layout
from dtrain.checkpoint import read as ckread
from dtrain.checkpoint import write as ckpt
from dtrain.errors import CheckpointError
from dtrain.fault.failpoints import failpoints


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
    with pytest.raises(CheckpointError, match="cannot be loaded"):
        ckread.load_file(folder, "model.pt")
    assert not (tmp_path / "pwned").exists()


def test_missing_checkpoint_folder(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="does not exist"):
        ckread.verify_checkpoint(tmp_path / "step-00000009")
