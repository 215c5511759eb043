"""What a checkpoint in an object store costs in requests (issue 42): a save sends its large
files as multipart uploads with a bounded number of parts in flight, and a resume downloads
each byte of the checkpoint once -- what it verifies is what it loads
(:mod:`dtrain.checkpoint.copies`) -- and the step folders, markers and leftovers come from
listings, not a look-up per object. Counted at the store client (botocore's events on the
checkpointer's own s3fs), against moto's S3 server (or ``make test-s3``'s Swift), in this
process; no wall clock."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

from dtrain.checkpoint import copies, layout, upload
from dtrain.checkpoint import read as ckread
from dtrain.checkpoint.copies import keep_copies
from dtrain.checkpoint.verify import assign, pieces_of, verify_pieces
from dtrain.checkpoint.write import Checkpointer
from dtrain.storage.objects import ObjectPath
from tests.test_s3_run_dir import BUCKET, Store, store  # noqa: F401  (the module's server)

MIB = 2**20


@dataclass
class Requests:
    """Requests the client made, by operation; the bytes GETs returned; the most UploadParts
    in flight at once."""

    calls: dict[str, int] = field(default_factory=dict)
    keys: list[tuple[str, str]] = field(default_factory=list)  # (operation, key), in order
    bodies: set[str] = field(default_factory=set)  # the types of the bodies sent
    got_bytes: int = 0
    parts_now: int = 0
    parts_most: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def before(self, event_name: str, **_: Any) -> None:
        op = event_name.rsplit(".", 1)[1]
        with self.lock:
            self.calls[op] = self.calls.get(op, 0) + 1
            if op == "UploadPart":
                self.parts_now += 1
                self.parts_most = max(self.parts_most, self.parts_now)

    def params(self, event_name: str, params: dict[str, Any], **_: Any) -> None:
        with self.lock:
            self.keys.append((event_name.rsplit(".", 1)[1], str(params.get("Key", ""))))
            if "Body" in params:
                self.bodies.add(type(params["Body"]).__name__)

    def after(self, event_name: str, parsed: dict[str, Any], **_: Any) -> None:
        op = event_name.rsplit(".", 1)[1]
        with self.lock:
            if op == "UploadPart":
                self.parts_now -= 1
            if op == "GetObject":
                self.got_bytes += int(parsed.get("ContentLength", 0))


@pytest.fixture
def counted(store: Store) -> Iterator[tuple[Any, Requests]]:  # noqa: F811
    """A client of the store of its own, whose requests are counted."""
    import s3fs

    fs = s3fs.S3FileSystem(
        key=store.secrets[0],
        secret=store.secrets[1],
        endpoint_url=store.endpoint,
        use_listings_cache=False,
        skip_instance_cache=True,
    )
    fs.ls(BUCKET)  # the client exists from here
    seen = Requests()
    fs.s3.meta.events.register("before-call.s3", seen.before)
    fs.s3.meta.events.register("after-call.s3", seen.after)
    fs.s3.meta.events.register("provide-client-params.s3", seen.params)
    yield fs, seen


def test_a_save_streams_its_parts_a_resume_reads_each_byte_once_listings_do_the_rest(
    counted: tuple[Any, Requests], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    fs, seen = counted
    # Small parts (S3's smallest) and pieces, so that a file of 20 MiB is a multipart upload,
    # 2 parts in flight, and 6 pieces to verify.
    monkeypatch.setattr(upload, "PART_BYTES", 5 * MIB)
    monkeypatch.setattr(upload, "PARTS_IN_FLIGHT", 2)
    monkeypatch.setattr(upload, "ONE_REQUEST_BYTES", 15 * MIB)
    monkeypatch.setattr(layout, "PIECE_BYTES", 4 * MIB)
    root = ObjectPath(f"s3://{BUCKET}/io/checkpoints", fs)
    saver = Checkpointer(root, rank=0, world_size=1, keep_last=2, keep_every=0, log=print)
    generator = torch.Generator().manual_seed(3)
    big = torch.randn(5 * MIB, generator=generator)  # 20 MiB
    small = torch.arange(10.0)
    mid = torch.randn(3 * MIB, generator=generator)  # 12 MiB: two full parts and a rest, held
    shards = {"model": {"s": torch.randn(1000, generator=generator)}}
    saver.save(
        1,
        {"model.pt": {"big": big}, "optimizer.pt": {"small": small, "mid": mid}},
        {"step": 1, "world_size": 1},
        blocking=True,
        sharded=shards,
    )
    # DCP's metadata is put at its name (no copy from .metadata.tmp, no delete), and nothing
    # is looked up; the one delete is the marker's, which a first save cannot know is absent.
    assert "CopyObject" not in seen.calls and "HeadObject" not in seen.calls
    # DCP's files upload while the next is written, as the others do; the marker, the
    # commit, is put once every upload is complete (retention's listing follows it).
    writes = [key for op, key in seen.keys if op in ("PutObject", "CompleteMultipartUpload")]
    assert writes[-1].endswith(f"/{layout.MARKER}") and len(writes) == len(set(writes))
    assert {key.rpartition("/")[2] for key in writes} == {
        "model.pt",
        "optimizer.pt",
        "meta.json",
        "__0_0.distcp",
        ".metadata",
        layout.MARKER,
    }
    assert [key for op, key in seen.keys if op == "DeleteObject"] == [
        f"io/checkpoints/{layout.step_dir_name(1)}/{layout.MARKER}"
    ]
    step = root / layout.step_dir_name(1)
    marker = json.loads((step / layout.MARKER).read_bytes())
    sizes = {name: info["bytes"] for name, info in marker["files"].items()}
    assert sizes["model.pt"] > 20 * MIB and len(marker["files"]["model.pt"]["pieces"]) == 6
    # model.pt alone outgrows one request (15 MiB: 3 parts' worth): 4 full parts and the
    # rest; every other file is one put_object (optimizer.pt's held parts joined).
    assert seen.calls.get("CreateMultipartUpload") == 1 and seen.calls.get("UploadPart") == 5
    assert seen.calls.get("CompleteMultipartUpload") == 1
    assert seen.parts_most <= 2  # the bound on what a save holds beside its state
    assert seen.calls.get("AbortMultipartUpload", 0) == 0
    # Every body a file (or bytes, which botocore wraps as one): aiohttp sends a bytearray's
    # joined to its headers, a copy of the body on the store's event loop, and another of the
    # rest into the transport's buffer.
    assert seen.bodies == {"BytesIO", "bytes"}
    for name, size in sizes.items():  # the marker's sizes are the objects'
        assert (step / name).stat().st_size == size, name
    marker_bytes = (step / layout.MARKER).stat().st_size

    # A resume on one rank: every piece verified, every file loaded, each byte read once;
    # the marker and the files are the only requests: one ranged read brings each file's
    # pieces, hashed one after another as it streams (its size comes with its answer).
    seen.got_bytes = 0
    seen.calls.clear()
    local = tmp_path / "local"
    with keep_copies(local, root):
        ckread.verify_checkpoint(step)
        model = ckread.load_file(step, "model.pt")
        optim = ckread.load_file(step, "optimizer.pt")
        assert ckread.load_meta(step) == {"step": 1, "world_size": 1, "job": saver.job}
        template = {"model": {"s": torch.zeros(1000)}}
        ckread.load_sharded(step, template)
    assert seen.got_bytes == marker_bytes + sum(sizes.values())
    assert sum(len(f["pieces"]) for f in marker["files"].values()) == 13  # 6 of model.pt
    assert seen.calls == {"GetObject": 1 + len(marker["files"])}
    assert torch.equal(model["big"], big) and torch.equal(optim["small"], small)
    assert torch.equal(optim["mid"], mid)
    assert torch.equal(template["model"]["s"], shards["model"]["s"])
    assert list(local.iterdir()) == []  # the copies went with the scope

    # Rank 1 of 2: its share of the pieces verified, then model.pt loaded whole: the pieces
    # rank 0 checked are downloaded at the load, once; model.pt's bytes are read once in all.
    share = assign(marker, 2)[1]
    mine = sum(p.length for p in share if p.name == "model.pt")
    assert 0 < mine < sizes["model.pt"]
    seen.got_bytes = 0
    with keep_copies(local, root):
        assert verify_pieces(step, share) is None
        verified = seen.got_bytes
        assert torch.equal(ckread.load_file(step, "model.pt")["big"], big)
    shared = sum(p.length for p in share) - mine
    assert verified == mine + shared
    assert seen.got_bytes == sizes["model.pt"] + shared

    # Leftovers of interrupted saves and prunes, found from two listings and removed; the
    # committed checkpoint stays, and the step folders and markers are listed, not looked up.
    (root / "step-00000009" / "model.pt").write_bytes(b"cut off before its marker")
    (root / ".trash-step-00000002" / "model.pt").write_bytes(b"half deleted")
    assert [step for step, _ in layout.list_step_dirs(root)] == [9, 1]
    seen.calls.clear()
    assert layout.committed_steps(root) == [1]
    assert seen.calls == {"ListObjectsV2": 1}
    removed = ckread.remove_leftovers(root)
    assert sorted(path.name for path in removed) == [".trash-step-00000002", "step-00000009"]
    assert [entry.name for entry in root.iterdir()] == ["step-00000001"]


def test_a_save_asks_only_what_it_cannot_know_and_uncommits_a_step_it_saves_again(
    counted: tuple[Any, Requests],
) -> None:
    fs, seen = counted
    root = ObjectPath(f"s3://{BUCKET}/known/checkpoints", fs)
    saver = Checkpointer(root, rank=0, world_size=1, keep_last=3, keep_every=0, log=print)

    def save(step: int, value: float) -> None:
        saver.save(
            step,
            {"model.pt": {"w": torch.full((4,), value)}},
            {"step": step, "world_size": 1},
            blocking=True,
            sharded={"model": {"s": torch.full((6,), value)}},
        )

    save(1, 1.0)
    seen.calls.clear()
    save(2, 2.0)
    # model.pt, meta.json, DCP's shard and metadata, the marker: a put each; retention's one
    # listing, which told the first save's retention that no step-2 marker is there.
    assert seen.calls == {"PutObject": 5, "ListObjectsV2": 1}
    # Step 1 saved again (a rollback's trajectory): its marker goes before any byte of it.
    seen.keys.clear()
    save(1, 3.0)
    step1 = f"known/checkpoints/{layout.step_dir_name(1)}"
    assert seen.keys[0] == ("DeleteObject", f"{step1}/{layout.MARKER}")
    puts = [key for op, key in seen.keys if op == "PutObject"]
    assert puts[-1] == f"{step1}/{layout.MARKER}" and len(puts) == 5
    step = root / layout.step_dir_name(1)
    ckread.verify_checkpoint(step)
    assert torch.equal(ckread.load_file(step, "model.pt")["w"], torch.full((4,), 3.0))
    template = {"model": {"s": torch.zeros(6)}}
    ckread.load_sharded(step, template)
    assert torch.equal(template["model"]["s"], torch.full((6,), 3.0))
    assert layout.committed_steps(root) == [2, 1]


def test_a_stored_file_missing_or_cut_short_is_named_from_its_ranges(
    counted: tuple[Any, Requests], monkeypatch: pytest.MonkeyPatch
) -> None:
    fs, seen = counted
    monkeypatch.setattr(layout, "PIECE_BYTES", MIB)
    root = ObjectPath(f"s3://{BUCKET}/short/checkpoints", fs)
    saver = Checkpointer(root, rank=0, world_size=1, keep_last=3, keep_every=0, log=print)
    files = {"model.pt": {"w": torch.randn(MIB)}, "optimizer.pt": {"m": torch.arange(4.0)}}
    saver.save(1, files, {"step": 1}, blocking=True)  # model.pt: 4 MiB and a bit, 5 pieces
    step = root / layout.step_dir_name(1)
    marker = ckread.read_marker(step)
    size = marker["files"]["model.pt"]["bytes"]
    model = step / "model.pt"
    model.write_bytes(model.read_bytes()[: 2 * MIB])
    said = f"{model} has {2 * MIB} bytes, expected {size}"
    # From the first piece's range (its answer names the object's size) ...
    seen.calls.clear()
    assert verify_pieces(step, pieces_of(marker)) == said
    assert set(seen.calls) == {"GetObject"}  # no listing, no look-up
    # ... and from a piece past the object's end, which the store refuses (then looked up).
    past = [p for p in pieces_of(marker) if p.name == "model.pt" and p.start >= 2 * MIB]
    assert verify_pieces(step, past) == said
    (step / "optimizer.pt").unlink()
    problem = verify_pieces(step, [p for p in pieces_of(marker) if p.name == "optimizer.pt"])
    assert problem == f"{step / 'optimizer.pt'} is missing (listed in {layout.MARKER})"


def test_the_small_files_after_a_large_one_do_not_wait_for_its_upload(
    counted: tuple[Any, Requests], monkeypatch: pytest.MonkeyPatch
) -> None:
    fs, _ = counted
    monkeypatch.setattr(upload, "PART_BYTES", 5 * MIB)
    monkeypatch.setattr(upload, "PARTS_IN_FLIGHT", 2)
    monkeypatch.setattr(upload, "ONE_REQUEST_BYTES", 15 * MIB)  # one request: up to 15 MiB
    root = ObjectPath(f"s3://{BUCKET}/budget", fs)
    uploads = upload.Uploads()  # 20 MiB in flight: one file's 15 and a part's 5

    def send(name: str, size: int) -> None:
        out = upload.PartUpload(root / name, uploads=uploads)
        out.write(bytes(size))
        out.close()

    send("large", 12 * MIB)
    send("small", 100)
    assert uploads.in_flight == 2  # the small one went out beside the large one
    send("large2", 12 * MIB)  # 24 MiB would be in flight: the first large one completes
    assert uploads.in_flight == 2
    uploads.wait()
    assert uploads.in_flight == 0
    sizes = {name: (root / name).stat().st_size for name in ("large", "small", "large2")}
    assert sizes == {"large": 12 * MIB, "small": 100, "large2": 12 * MIB}


def test_a_file_read_as_one_range_names_its_damaged_piece_and_keeps_only_what_matched(
    counted: tuple[Any, Requests], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    fs, seen = counted
    monkeypatch.setattr(layout, "PIECE_BYTES", MIB)
    monkeypatch.setattr(copies, "CHUNK_BYTES", 768 * 1024)  # chunks that straddle pieces
    root = ObjectPath(f"s3://{BUCKET}/runs/checkpoints", fs)
    saver = Checkpointer(root, rank=0, world_size=1, keep_last=3, keep_every=0, log=print)
    weights = torch.randn(MIB, generator=torch.Generator().manual_seed(5))
    saver.save(1, {"model.pt": {"w": weights}}, {"step": 1}, blocking=True)
    step = root / layout.step_dir_name(1)
    marker = ckread.read_marker(step)
    size = marker["files"]["model.pt"]["bytes"]
    assert len(marker["files"]["model.pt"]["pieces"]) == 5  # 4 MiB and a bit
    seen.calls.clear()
    seen.got_bytes = 0
    assert verify_pieces(step, pieces_of(marker)) is None
    # One ranged read a file (model.pt's 5 pieces, meta.json), every byte once.
    assert (
        seen.calls == {"GetObject": 2}
        and seen.got_bytes == size + marker["files"]["meta.json"]["bytes"]
    )
    model = step / "model.pt"
    data = bytearray(model.read_bytes())
    data[2 * MIB + 5] ^= 0xFF  # the third piece, its size unchanged
    model.write_bytes(bytes(data))
    with keep_copies(tmp_path / "local", root) as kept:
        assert kept is not None
        problem = verify_pieces(step, pieces_of(marker))
        assert problem == (
            f"{model} fails its SHA-256 checksum (bytes {2 * MIB}-{3 * MIB - 1} of {size})"
        )
        # The two pieces before it count as verified; the rest is downloaded again for a load.
        seen.got_bytes = 0
        local = kept.completed(model)
        assert local is not None and seen.got_bytes == size - 2 * MIB
        with local.open() as fh:
            assert fh.read() == bytes(data)


def test_a_resume_keeps_small_files_in_memory_and_the_rest_on_the_local_disk(
    counted: tuple[Any, Requests], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    fs, seen = counted
    monkeypatch.setattr(layout, "PIECE_BYTES", MIB)
    root = ObjectPath(f"s3://{BUCKET}/memory/checkpoints", fs)
    saver = Checkpointer(root, rank=0, world_size=1, keep_last=3, keep_every=0, log=print)
    generator = torch.Generator().manual_seed(7)
    model = {"w": torch.randn(MIB // 2, generator=generator)}  # 2 MiB and a bit
    optim = {"m": torch.randn(MIB, generator=generator)}  # 4 MiB and a bit
    saver.save(1, {"model.pt": model, "optimizer.pt": optim}, {"step": 1}, blocking=True)
    step = root / layout.step_dir_name(1)
    marker = ckread.read_marker(step)
    sizes = {name: info["bytes"] for name, info in marker["files"].items()}
    marker_bytes = (step / layout.MARKER).stat().st_size
    local = tmp_path / "local"

    def resume() -> tuple[list[Path], int]:
        """Verify and load in one scope: the local files and the bytes in memory once verified,
        each byte got once, every tensor the saved one."""
        seen.got_bytes = 0
        with keep_copies(local, root) as kept:
            assert kept is not None
            ckread.verify_checkpoint(step)
            on_disk, in_memory = sorted(local.rglob("*-*.pt")), kept.in_memory
            for name, saved in (("model.pt", model), ("optimizer.pt", optim)):
                loaded = ckread.load_file(step, name)
                assert loaded.keys() == saved.keys()
                assert all(torch.equal(loaded[k], saved[k]) for k in saved)
            assert ckread.load_meta(step) == {"step": 1, "job": saver.job}
            # A loaded file's copy goes at once; meta.json's (read, not loaded) with the scope.
            assert kept.in_memory == sizes["meta.json"]
        assert seen.got_bytes == marker_bytes + sum(sizes.values())
        assert list(local.iterdir()) == []
        return on_disk, in_memory

    # Within the memory's budget: every verified byte kept in memory, no local file at all.
    assert resume() == ([], sum(sizes.values()))
    # A budget that holds meta.json and model.pt (verified in name order) but not
    # optimizer.pt: its copy is a local file, written as it streamed past, with the store's
    # bytes; model.pt's stays in memory.
    monkeypatch.setattr(copies, "MEMORY_BYTES", sizes["meta.json"] + sizes["model.pt"])
    on_disk, in_memory = resume()
    assert [path.name for path in on_disk] == ["00001-optimizer.pt"]
    assert in_memory == sizes["meta.json"] + sizes["model.pt"]


def test_a_save_lists_for_retention_before_its_files_and_listings_come_in_pages(
    counted: tuple[Any, Requests], monkeypatch: pytest.MonkeyPatch
) -> None:
    from dtrain.storage import objects

    fs, seen = counted
    root = ObjectPath(f"s3://{BUCKET}/first/checkpoints", fs)
    saver = Checkpointer(root, rank=0, world_size=1, keep_last=1, keep_every=0, log=print)
    # The first save into an empty prefix: retention's one listing, asked for before any file
    # goes out (it is answered while they upload), no look-up of the empty prefix; the marker
    # is the last write.
    saver.save(1, {"model.pt": {"w": torch.arange(4.0)}}, {"step": 1}, blocking=True)
    ops = [op for op, _ in seen.keys]
    assert ops.count("ListObjectsV2") == 1 and "HeadObject" not in ops
    assert ops.index("ListObjectsV2") < ops.index("PutObject")
    assert seen.keys[-1] == (
        "PutObject",
        f"first/checkpoints/{layout.step_dir_name(1)}/COMMITTED.json",
    )
    # The second save's retention (keep_last 1) prunes step 1 from its listing, which did not
    # show step 2 yet: the commit adds it.
    saver.save(2, {"model.pt": {"w": torch.arange(5.0)}}, {"step": 2}, blocking=True)
    assert layout.committed_steps(root) == [2]
    # A prefix's objects in pages: 2 a request, 3 objects under it (and one beside it, not
    # under it) in 2 requests; an empty prefix in one.
    monkeypatch.setattr(objects, "LIST_PAGE", 2)
    pages = ObjectPath(f"s3://{BUCKET}/pages", fs)
    for name, size in (("a", 1), ("b/c", 2), ("d", 3)):
        (pages / name).write_bytes(bytes(size))
    ObjectPath(f"s3://{BUCKET}/pages-beside", fs).write_bytes(b"x")
    seen.calls.clear()
    assert pages.sizes() == {"a": 1, "b/c": 2, "d": 3}
    assert seen.calls == {"ListObjectsV2": 2}
    seen.calls.clear()
    assert (pages / "none").sizes() == {}
    assert seen.calls == {"ListObjectsV2": 1}
