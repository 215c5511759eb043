"""Shards in an object store (``dtrain prepare SOURCE s3://...``, docs/data.md), against moto's
S3 server started here (``make test-s3``: OpenStack Swift's S3 API). The same text prepared to a
local folder and to the store (pieces of 4 KiB, the cache 4 pieces, so that the read-ahead
evicts and fetches again) gives the same windows, the same ids step by step for each of 2 ranks,
and resumed at 3; a missing or damaged object is named; a cache below one piece and a store
prefix without a dataset are refused before any worker starts. Two ranks of one machine share
its cache: each piece is fetched once between them (requests counted), and a rank killed -9
while it fetches a piece leaves it to the other. A warm loader (its read-ahead started once
the position is known, before the first step) has its first step's pieces on its machine before
it asks, at the start and resumed on 3 ranks at the checkpoint's position (its own pieces); it
warms at its construction only when no checkpoint is to be chosen. The processes' test: 2 ranks on
the store's shards stopped by SIGTERM at step 4, resumed on 3: the audit shows each sample once.
The journey (``slow``; ``make test-s3``): prepare with the command, then train from the store's
shards with the run folder in the store, SIGTERM, and resume at another world size."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tomli_w
import torch

from dtrain.checkpoint.layout import step_dir_name
from dtrain.checkpoint.resume import starts_afresh
from dtrain.cli import main
from dtrain.config.sections import STORE_PIECE_BYTES
from dtrain.data.loader import RankLoader
from dtrain.data.node_cache import WRITING, NodeCache
from dtrain.data.partition import OrderSpec, StepPlan
from dtrain.data.prepare import prepare
from dtrain.data.read_ahead import CacheTooSmall, ReadAhead
from dtrain.data.shards import ShardedDataset, verify_dataset
from dtrain.data.text import TokenWindows, collate_windows
from dtrain.data.upload import upload_dataset
from dtrain.errors import USER_ERROR_EXIT_CODE, DataError
from dtrain.fault.failpoints import failpoints
from tests.audit import check_stream, read_trajectory
from tests.conftest import tiny_config, tiny_raw
from tests.dist_helpers import make_trainer
from tests.ranks import run_ranks
from tests.s3_helpers import (
    SIGTERM_AT_STEP_ENV,
    Store,
    dtrain,
    finish,
    open_store,
    silent_store,
)

BUCKET = "shards"
PIECE = 4096
CACHE = 12 * PIECE  # a rank's cache: 12 pieces, of the train set's ~60
SEQ = 16
B = 8


@pytest.fixture(scope="module")
def store() -> Iterator[Store]:
    yield from open_store(BUCKET)


@dataclass
class Prepared:
    local: Path  # a folder with train/ and val/
    url: str  # the same, in the store
    tmp: Path


def write_text(folder: Path, files: int = 24) -> Path:
    """Text files of different lengths (2 to 9 kB): several shards, windows across them."""
    folder.mkdir(parents=True)
    rng = np.random.default_rng(3)
    for i in range(files):
        words = rng.choice(["def", "class", "return", "x", "=", "(", ")", "\n"], 900 + 150 * i)
        (folder / f"f{i:02d}.txt").write_text(" ".join(words))
    return folder


@pytest.fixture(scope="module")
def prepared(store: Store, tmp_path_factory: pytest.TempPathFactory) -> Prepared:
    tmp = tmp_path_factory.mktemp("s3-shards")
    source = write_text(tmp / "text")
    url = f"s3://{BUCKET}/data"
    for part in ("train", "val"):
        local = tmp / "local" / part
        prepare(source, local, shard_bytes=20_000, show_progress=False)
        # Pieces of 4 KiB (the reader takes the manifest's size): a shard is several pieces.
        os.environ.update(store.env)
        upload_dataset(local, store.path(f"data/{part}"), piece_bytes=PIECE)
    return Prepared(tmp / "local", url, tmp)


def fetched_ahead(ahead: ReadAhead, pieces: np.ndarray, timeout: float = 60.0) -> bool:
    """Whether ``pieces`` come to be present on the read-ahead's machine within ``timeout``
    seconds, waiting on its store's condition (notified as each fetch ends), never a sleep."""
    store = ahead.store
    with store._lock:
        return store._lock.wait_for(lambda: bool(store.present(pieces).all()), timeout)


def loaders(datasets: list[TokenWindows], cache: bool) -> list[RankLoader]:
    """A loader per rank, each on its dataset (a rank of a job opens its own)."""
    world, first = len(datasets), datasets[0]
    order = OrderSpec(len(first), seed=5, shuffle="full", shard_sizes=first.shard_sizes)
    out = []
    for rank, dataset in enumerate(datasets):
        ahead = None
        if cache:
            assert dataset.store is not None
            ahead = ReadAhead(dataset.store, dataset.pieces, rank)
        out.append(
            RankLoader(
                dataset,
                order=order,
                global_batch_size=B,
                micro_batches=2,
                rank=rank,
                world_size=world,
                collate_fn=collate_windows,
                fingerprint=dataset.fingerprint,
                ahead=ahead,
            )
        )
    return out


def same_step(theirs: list[RankLoader], mine: list[RankLoader]) -> None:
    """One step of each rank: the same ids and the same windows from both."""
    for a, b in zip(theirs, mine, strict=True):
        want, got = next(a), next(b)
        assert [x.tolist() for x in got.ids] == [x.tolist() for x in want.ids]
        for (wi, wt), (gi, gt) in zip(want.micro, got.micro, strict=True):
            assert torch.equal(wi, gi) and torch.equal(wt, gt)


def test_the_store_s_shards_give_the_local_windows_and_ids_step_by_step(
    store: Store, prepared: Prepared
) -> None:
    local = TokenWindows(ShardedDataset(prepared.local / "train"), SEQ)

    def remote(machine: int = 0) -> TokenWindows:
        # Each rank on a machine of its own (a cache folder of its own): it alone fills it.
        cache_dir = str(prepared.tmp / f"machine-{machine}")
        return TokenWindows(ShardedDataset(f"{prepared.url}/train", cache_dir, CACHE), SEQ)

    one = remote()
    files = one.store
    assert files is not None and files.piece_bytes == PIECE
    assert len(one) == len(local) > 200 and one.fingerprint == local.fingerprint
    assert (
        len(one.dataset.shard_sizes) >= 3 and files.bytes_of(np.arange(files.base[-1])) > 3 * CACHE
    )
    for i in (0, 1, len(local) // 2, len(local) - 1):  # read without the read-ahead
        assert np.array_equal(one[i], local[i])
    # Two ranks side by side, 10 steps; then the position resumed on 3 ranks, 4 steps more.
    mine = loaders([one, remote(1)], cache=True)
    theirs = loaders([local, local], cache=False)
    for _ in range(10):
        same_step(theirs, mine)
        assert files.cache.resident() <= CACHE and files.held_bytes <= CACHE  # bounded
    assert files.fetched > 2 * CACHE  # evicted what the steps passed, fetched what came next
    state = mine[0].state_dict()
    assert state == theirs[0].state_dict() and state["consumed"] == 10 * B
    for loader in mine:
        loader.close()
    assert files.held_bytes == 0  # the read-ahead gave back what it held
    mine = loaders([remote(m) for m in range(3)], cache=True)
    theirs = loaders([local] * 3, cache=False)
    for a, b in zip(theirs, mine, strict=True):
        a.load_state_dict(state)
        b.load_state_dict(state)
    for _ in range(4):
        for a, b in zip(theirs, mine, strict=True):
            want, got = next(a), next(b)
            assert [x.tolist() for x in got.ids] == [x.tolist() for x in want.ids]
            assert all(torch.equal(w[0], g[0]) for w, g in zip(want.micro, got.micro, strict=True))
    for loader in mine:
        loader.close()


def test_a_warm_loader_has_its_first_step_s_pieces_before_it_asks_and_a_resume_its_own(
    store: Store, prepared: Prepared
) -> None:
    local = TokenWindows(ShardedDataset(prepared.local / "train"), SEQ)

    def machines(n: int, tag: str) -> list[TokenWindows]:
        # A machine each (a cache folder of its own): what it holds, its rank fetched.
        return [
            TokenWindows(
                ShardedDataset(f"{prepared.url}/train", str(prepared.tmp / f"{tag}-{m}"), CACHE),
                SEQ,
            )
            for m in range(n)
        ]

    def warmed_first_steps(
        ranks: list[TokenWindows], state: dict[str, object] | None, position: int
    ) -> tuple[list[RankLoader], list[list[list[int]]]]:
        """Warm each rank's loader at ``state`` (or the start), then check, before any step
        is asked for, that its read-ahead walked from ``position`` and that its share of the
        first step is on its machine; then that step against the local shards."""
        mine = loaders(ranks, cache=True)
        theirs = loaders([local] * len(ranks), cache=False)
        firsts = []
        for a, b in zip(theirs, mine, strict=True):
            if state is not None:
                a.load_state_dict(state)
            b.warm(state)
            if state is not None:
                b.load_state_dict(state)  # the trainer's load of the chosen checkpoint, after
                assert b.ahead is not None and b.ahead.origin is not None  # kept running
        for dataset, loader, want in zip(ranks, mine, theirs, strict=True):
            assert loader.ahead is not None and dataset.store is not None
            # Walking from the run's position (no weights, nothing skipped): its own plans.
            assert loader.ahead.origin == (position, None, ())
            first = next(want)
            assert first.plan.start == position
            # Present before the step asks: fetched by the read-ahead, checked, on the disk.
            pieces = dataset.pieces(np.concatenate(first.ids))
            assert fetched_ahead(loader.ahead, pieces), loader.ahead.error
            got = next(loader)
            firsts.append([x.tolist() for x in first.ids])
            assert [x.tolist() for x in got.ids] == firsts[-1]
            for (wi, wt), (gi, gt) in zip(first.micro, got.micro, strict=True):
                assert torch.equal(wi, gi) and torch.equal(wt, gt)
        return mine, firsts

    # A start: warmed at position 0 on 2 ranks, then 4 steps more.
    mine, _ = warmed_first_steps(machines(2, "warm-start"), None, 0)
    for _ in range(4):
        for loader in mine:
            next(loader)
    state = mine[0].state_dict()
    assert state["consumed"] == 5 * B
    for loader in mine:
        loader.close()
    # A resume on 3 ranks at the checkpoint's position: each warms its own share of it.
    mine, firsts = warmed_first_steps(machines(3, "warm-resume"), state, 5 * B)
    for loader, ids in zip(mine, firsts, strict=True):
        loader.load_state_dict(state)  # back to where its read-ahead started (a rollback)
        assert [x.tolist() for x in next(loader).ids] == ids
        loader.close()


def test_a_loader_warms_at_its_construction_only_when_the_run_certainly_starts_afresh(
    tmp_path: Path,
) -> None:
    # Before the model is set up, the position is certain only without a checkpoint to choose
    # (dtrain.train.wiring); else the loader warms once the checkpoint is chosen.
    root = tmp_path / "checkpoints"
    assert starts_afresh(tiny_config(tmp_path), root)  # auto, no run folder yet
    root.mkdir()
    assert starts_afresh(tiny_config(tmp_path), root)
    (root / step_dir_name(2)).mkdir()  # a checkpoint (committed or not): to choose
    assert not starts_afresh(tiny_config(tmp_path), root)
    assert starts_afresh(tiny_config(tmp_path, run={"resume": "never"}), root)
    named = tiny_config(tmp_path, run={"resume": str(root / step_dir_name(2))})
    assert not starts_afresh(named, tmp_path / "elsewhere")
    inplace = tiny_config(tmp_path, fault={"recovery": "inplace"}, run={"resume": "never"})
    assert not starts_afresh(inplace, tmp_path / "elsewhere")  # a replacement: its peers'


def test_two_ranks_of_a_machine_fetch_each_piece_once_between_them(
    store: Store, prepared: Prepared
) -> None:
    machine = str(prepared.tmp / "machine-shared")  # one cache folder: the ranks of a machine
    local = TokenWindows(ShardedDataset(prepared.local / "train"), SEQ)
    ranks = [
        TokenWindows(ShardedDataset(f"{prepared.url}/train", machine, 2**20), SEQ) for _ in range(2)
    ]
    a, b = (rank.store for rank in ranks)
    assert a is not None and b is not None and a.folder == b.folder
    a.sharers = b.sharers = 2
    mine = loaders(ranks, cache=True)
    theirs = loaders([local, local], cache=False)
    for _ in range(6):
        for want, got in zip(theirs, mine, strict=True):
            assert [x.tolist() for x in next(got).ids] == [x.tolist() for x in next(want).ids]
    for loader in mine:
        loader.close()
    present = np.flatnonzero(a.present(np.arange(a.base[-1])))
    # Each rank's read-ahead walked its next steps over most of the ~60 pieces; between them
    # they fetched each piece on the machine once, with a request a run of consecutive pieces
    # at most (and each rank read the offsets files whole, once).
    assert len(present) > 30 and b.present(present).all()
    assert a.fetched + b.fetched == a.bytes_of(present) == a.cache.resident() == b.cache.resident()
    offsets = sum(name.endswith(".idx.npy") for name in a.names)
    assert len(a.runs(present)) <= a.requests + b.requests - 2 * offsets <= len(present)
    a.close()
    assert os.path.isdir(b.folder)  # b still uses it
    b.close()
    assert not os.path.exists(b.folder)  # the last to leave removed it


def test_two_ranks_sharing_a_small_cache_evict_each_other_s_pieces_within_its_bound(
    store: Store, prepared: Prepared
) -> None:
    machine = str(prepared.tmp / "machine-small")
    local = TokenWindows(ShardedDataset(prepared.local / "train"), SEQ)
    ranks = [
        TokenWindows(ShardedDataset(f"{prepared.url}/train", machine, CACHE), SEQ) for _ in range(2)
    ]
    a, b = (rank.store for rank in ranks)
    assert a is not None and b is not None
    a.sharers = b.sharers = 2  # each holds at most half the machine's 12 pieces ahead
    mine = loaders(ranks, cache=True)
    theirs = loaders([local, local], cache=False)
    for _ in range(10):
        same_step(theirs, mine)
        assert a.cache.resident() <= CACHE and a.held_bytes + b.held_bytes <= CACHE  # the machine's
    # The machine evicted what its ranks had passed and fetched what came next.
    assert a.fetched + b.fetched > 2 * CACHE
    for loader in mine:
        loader.close()
    assert a.held_bytes == b.held_bytes == 0


def test_a_piece_another_rank_holds_is_never_evicted(store: Store, prepared: Prepared) -> None:
    machine = str(prepared.tmp / "machine-two-pieces")
    url = f"{prepared.url}/val"
    a, b = (ShardedDataset(url, machine, 2 * PIECE).store for _ in range(2))
    assert a is not None and b is not None
    p0, p1, p2 = np.flatnonzero(a.piece_size == PIECE)[:3]
    with b.hold(np.array([p0, p1])):  # the machine's cache is full of what b holds
        assert a.cache.resident() == 2 * PIECE and a.present(np.array([p0, p1])).all()
        with pytest.raises(DataError, match="cannot hold the pieces"), a.hold(np.array([p2])):
            pass
        assert b.present(np.array([p0, p1])).all()  # a evicted none of them
    with a.hold(np.array([p2])):  # let go: one of them makes room
        assert a.cache.resident() == 2 * PIECE and a.present(np.array([p2])).all()
    assert a.fetched == PIECE and b.fetched == 2 * PIECE


# A rank of the machine that fetches one piece and goes no further: its request goes to a
# socket that never answers (argv: the dataset, the cache folder, a sample, the socket's URL).
_STUCK_RANK = """
import sys

import s3fs

from dtrain.data.shards import ShardedDataset

dataset = ShardedDataset(sys.argv[1], sys.argv[2], 2**20)
sample = int(sys.argv[3])
dataset.pieces([sample])  # the offsets files, read whole from the store
assert dataset.store is not None
dataset.store.root.fs = s3fs.S3FileSystem(
    key="k", secret="s", endpoint_url=sys.argv[4], skip_instance_cache=True
)
dataset[sample]
"""


def test_a_rank_killed_while_it_fetches_a_piece_leaves_it_to_the_others(
    store: Store, prepared: Prepared
) -> None:
    machine = str(prepared.tmp / "machine-killed")
    url = f"{prepared.url}/val"
    dataset = ShardedDataset(url, machine, 2**20)  # this rank, first on the machine
    files = dataset.store
    assert files is not None
    sample = len(dataset) - 1
    first = int(dataset.pieces([sample])[0])
    with socket.create_server(("127.0.0.1", 0)) as silent:
        silent.settimeout(60)
        env = os.environ | store.env | {"PYTHONPATH": os.pathsep.join(sys.path)}
        port = silent.getsockname()[1]
        args = [url, machine, str(sample), f"http://127.0.0.1:{port}"]
        stuck = subprocess.Popen([sys.executable, "-c", _STUCK_RANK, *args], env=env)
        try:
            connection, _ = silent.accept()  # its request: it holds the piece's claim
            connection.close()
        finally:
            stuck.kill()  # -9
            stuck.wait()
    # It died claiming the sample's first pieces, counted in the machine's bytes, never written.
    pieces = dataset.pieces([sample])
    claimed = np.flatnonzero(files.cache.state == WRITING)
    assert first in claimed and np.isin(claimed, pieces).all() and not files.present(pieces).any()
    assert files.cache.resident() == files.bytes_of(claimed)
    got = dataset[sample]  # this rank claims it now, fetches and checks it
    want = ShardedDataset(prepared.local / "val")[sample]
    assert got.keys() == want.keys() and all(np.array_equal(got[k], want[k]) for k in want)
    assert files.present(pieces).all() and files.fetched == files.bytes_of(pieces)
    assert files.cache.resident() == files.bytes_of(pieces)  # the dead rank's claim counted once


def test_a_read_ahead_started_again_forgets_a_cache_too_small_for_its_old_plans(
    store: Store, prepared: Prepared
) -> None:
    # A reset (an in-place regroup changes the shares) starts the read-ahead again: what
    # stopped the old plans' thread is no longer the loader's to raise.
    dataset = TokenWindows(
        ShardedDataset(f"{prepared.url}/val", str(prepared.tmp / "machine-reset"), 2 * PIECE), SEQ
    )
    assert dataset.store is not None
    ahead = ReadAhead(dataset.store, dataset.pieces, 0)
    every = np.arange(len(dataset), dtype=np.int64)
    ahead.start(iter([StepPlan(0, len(every), [[every]])]))  # reads more than 2 pieces
    assert ahead._thread is not None
    ahead._thread.join()
    with pytest.raises(CacheTooSmall, match=r"bytes .*; raise data\.cache_bytes"):
        ahead.passed(0)
    ahead.start(iter([StepPlan(0, 1, [[every[:1]]])]))  # one window: fits
    assert fetched_ahead(ahead, dataset.pieces(every[:1]))
    ahead.passed(1)  # nothing to raise
    ahead.stop()
    dataset.store.close()


def test_a_missing_or_damaged_object_is_named(store: Store, prepared: Prepared) -> None:
    # A copy of the dataset of its own, to damage.
    upload_dataset(prepared.local / "val", store.path("hurt"), piece_bytes=PIECE)
    dataset = ShardedDataset(f"s3://{BUCKET}/hurt", cache_bytes=4 * PIECE)
    assert dataset.store is not None
    names = dataset.store.names
    first = next(n for n in names if n.startswith("shard-00000.tokens.npy"))
    last_shard = max(names)[: len("shard-00000")]
    data = bytearray(store.fs.cat_file(f"{BUCKET}/hurt/{first}"))
    data[-5] ^= 0xFF  # same size: only a piece's hash sees it
    store.fs.pipe_file(f"{BUCKET}/hurt/{first}", bytes(data))
    end = len(dataset) - 1
    with pytest.raises(DataError, match=rf"s3://{BUCKET}/hurt/{first}: bytes \d+\.\.\d+ fail"):
        dataset[int(dataset._starts[1]) - 1]  # the last sample of shard 0
    store.fs.rm_file(f"{BUCKET}/hurt/{last_shard}.tokens.npy")
    with pytest.raises(
        DataError, match=rf"shard file {last_shard}.tokens.npy is missing in the object store "
    ) as caught:
        dataset[end]
    assert f"key s3://{BUCKET}/hurt/{last_shard}.tokens.npy" in str(caught.value)
    with pytest.raises(DataError, match=f"{last_shard}.tokens.npy is missing"):
        ShardedDataset(f"s3://{BUCKET}/hurt")  # and at once when opened
    bad = {str(b.path).rpartition("/")[2]: b.problem for b in verify_dataset(dataset.path)}
    assert bad.keys() == {first, f"{last_shard}.tokens.npy"}  # `dtrain verify` reads it all
    assert bad[first].startswith("sha256 ") and bad[f"{last_shard}.tokens.npy"] == "missing"


def test_a_store_that_stops_answering_is_named_with_the_retry_policy(
    store: Store, prepared: Prepared
) -> None:
    dataset = ShardedDataset(f"{prepared.url}/val", cache_bytes=4 * PIECE)
    assert dataset.store is not None
    dataset[0]  # the offsets files read (whole), and the first piece
    dataset.store.root.fs = silent_store()  # the store goes away once the dataset is open
    last = dataset.store.names[-1]  # the last shard's values, not fetched yet
    assert last.endswith(".tokens.npy") and not last.endswith(".idx.npy")
    with pytest.raises(DataError) as caught:
        dataset[len(dataset) - 1]
    said = str(caught.value)
    assert said.startswith(f"reading shard file {last}: the object store s3://{BUCKET}")
    assert "attempts per request" in said and f"{prepared.url}/val/{last}" in said


def write_config(path: Path, data_dir: str, run_dir: str, local_dir: Path, steps: int) -> Path:
    """A job on the default task's GPT (tiny) reading ``data_dir``, audited."""
    config = {
        "run": {"dir": run_dir, "local_dir": str(local_dir)},
        "data": {"global_batch_size": B},
        "train": {"steps": steps, "log_every": 1},
        "eval": {"every": 0},
        "checkpoint": {"every": 2},
        "fault": {"audit_sample_ids": True},
        "dist": {"timeout_s": 30},
        "task": {"data_dir": data_dir, "seq_len": SEQ, "n_layer": 1, "d_model": 32}
        | {"generate_tokens": 0},
    }
    path.write_text(tomli_w.dumps(config))
    return path


def test_refused_before_any_worker_starts(
    store: Store,
    prepared: Prepared,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    for name, value in store.env.items():
        monkeypatch.setenv(name, value)
    run = prepared.tmp / "refused"
    config = write_config(prepared.tmp / "refused.toml", prepared.url, str(run), run, 4)
    small = f"--data.cache_bytes={STORE_PIECE_BYTES - 1}"
    assert main(["train", str(config), small]) == USER_ERROR_EXIT_CODE
    said = capsys.readouterr().err
    assert f"data.cache_bytes = {STORE_PIECE_BYTES - 1} is less than one piece" in said
    nothing = f"s3://{BUCKET}/nothing"
    assert main(["train", str(config), f"--task.data_dir={nothing}"]) == USER_ERROR_EXIT_CODE
    said = capsys.readouterr().err
    assert f"task.data_dir: dataset folder {nothing}/train does not exist" in said
    # A store that is not there (a process of its own: this one keeps its client to moto).
    gone = {"AWS_ENDPOINT_URL_S3": "http://127.0.0.1:9"}
    code, said = finish(dtrain(store, "train", str(config), env=gone))
    assert code == USER_ERROR_EXIT_CODE, said[-2000:]
    assert f"task.data_dir {prepared.url}/train: the object store s3://{BUCKET}" in said
    assert "does not answer; check AWS_ENDPOINT_URL_S3" in said
    assert not run.exists()  # no worker started, no run folder made


def run_job(prepared: Prepared, run_dir: Path, steps: int) -> dict[str, object]:
    raw = tiny_raw(
        run_dir,
        run={"task": "dtrain.tasks.gpt:build"},
        data={"global_batch_size": B, "cache_bytes": STORE_PIECE_BYTES},
        train={"steps": steps, "log_every": 2},
        checkpoint={"every": 2},
        fault={"audit_sample_ids": True},
    )
    raw["task"] = {
        "data_dir": prepared.url,
        "seq_len": SEQ,
        "n_layer": 1,
        "d_model": 32,
        "n_head": 2,
        "generate_tokens": 0,
    }
    return raw


STEPS = 8


def trained_from_wiring(raw: dict[str, Any], sigterm_at: int = 0) -> dict[str, Any]:
    """A rank: where its loader's read-ahead started by the end of the wiring (None: not
    yet, the checkpoint to choose), then its run (rank 1 sent SIGTERM at step
    ``sigterm_at``, if any)."""
    import torch.distributed as dist

    trainer = make_trainer(raw)
    ahead = getattr(trainer.loader, "ahead", None)
    origin = ahead.origin if ahead is not None else "no read-ahead"

    def at_step(name: str, **args: Any) -> None:
        if name == "train.step" and args["step"] == sigterm_at and dist.get_rank() == 1:
            os.kill(os.getpid(), signal.SIGTERM)

    with failpoints(at_step):
        summary = trainer.fit()
    return {"origin": origin, "steps": summary.steps}


def test_stopped_on_2_ranks_and_resumed_on_3_each_sample_once(
    store: Store, prepared: Prepared, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name, value in store.env.items():
        monkeypatch.setenv(name, value)  # this process's reads of the store
    run_dir = prepared.tmp / "run"
    job = run_job(prepared, run_dir, STEPS)
    # The ranks' environment, passed: they fork from a server that may have started before
    # this test set its own (alone it passed; in the suite a rank found no credentials).
    env = dict(store.env)
    stopped = run_ranks(trained_from_wiring, 2, job, 4, env=env)
    assert [s["steps"] for s in stopped] == [4, 4], stopped
    # A start: the read-ahead started at the wiring, from the start (before the model is set
    # up). A resume: not before the checkpoint is chosen, never from a guess.
    assert [s["origin"] for s in stopped] == [(0, None, ())] * 2, stopped
    resumed = run_ranks(trained_from_wiring, 3, job, env=env)
    assert [r["origin"] for r in resumed] == [None] * 3 and resumed[0]["steps"] == STEPS
    final = json.loads((run_dir / "checkpoints" / step_dir_name(STEPS) / "meta.json").read_text())
    assert final["world_size"] == 3 and final["data"]["consumed"] == STEPS * B
    trajectory = read_trajectory(run_dir)
    assert sorted(trajectory) == list(range(1, STEPS + 1))
    local = TokenWindows(ShardedDataset(prepared.local / "train"), SEQ)
    result = check_stream(trajectory, len(local))
    assert result.exactly_once and not result.gaps and result.positions == STEPS * B, result
    assert final["data"]["fingerprint"] == local.fingerprint  # the local shards' stream


@pytest.mark.slow
def test_the_journey_prepare_train_sigterm_resume_at_another_world_size(
    store: Store, prepared: Prepared
) -> None:
    tmp = prepared.tmp / "journey"
    tmp.mkdir()
    source = write_text(tmp / "text", files=12)
    for part in ("train", "val"):
        code, said = finish(dtrain(store, "prepare", str(source), f"s3://{BUCKET}/j/{part}"))
        assert code == 0 and f"to s3://{BUCKET}/j/{part}" in said, said[-2000:]
    run_url = f"s3://{BUCKET}/j-run"
    config = write_config(tmp / "job.toml", f"s3://{BUCKET}/j", run_url, tmp / "local", 12)
    task = "--run.task=tests.s3_helpers:preempted_gpt"
    first = dtrain(
        store, "train", str(config), task, "--nproc", "2", env={SIGTERM_AT_STEP_ENV: "5"}
    )
    code, said = finish(first)
    # The launcher forwards the signal: the ranks stop at the end of step 5 or the next.
    stopped = re.search(r"stopped by SIGTERM and saved at step (\d+)", said)
    assert code == 0 and stopped is not None and 5 <= int(stopped[1]) < 12, said[-3000:]
    code, said = finish(dtrain(store, "train", str(config), task, "--nproc", "3"))
    assert code == 0, said[-3000:]
    resumed = f"training ddp on 3 rank(s), cpu, resumed from {step_dir_name(int(stopped[1]))}"
    assert resumed in said, said[-3000:]
    trajectory = read_trajectory(tmp / "local")
    assert sorted(trajectory) == list(range(1, 13))
    windows = TokenWindows(ShardedDataset(f"s3://{BUCKET}/j/train"), SEQ)
    result = check_stream(trajectory, len(windows))
    assert result.exactly_once and not result.gaps and result.positions == 12 * B, result


def test_a_cache_folder_another_could_write_is_refused(tmp_path: Path) -> None:
    # The cache trusts a piece marked present: a folder at its predictable name that others
    # can write (made before the job, in a shared temporary folder) must not be used.
    planted = tmp_path / "dtrain-shards-planted"
    planted.mkdir()
    planted.chmod(0o777)
    with pytest.raises(DataError, match="belongs to another user or is open to others"):
        NodeCache(str(tmp_path), planted.name, np.full(4, 1024, dtype=np.int64))
    planted.chmod(0o700)
    cache = NodeCache(str(tmp_path), planted.name, np.full(4, 1024, dtype=np.int64))
    assert cache.resident() == 0
    cache.close()
    assert not planted.exists()
