"""The per-rank loader: exact resume at any cut point (with and without DataLoader workers),
refusal of a position from another stream, exact evaluation, and real ranks that each get
their own disjoint part of every global batch."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import default_collate

from dtrain.data.build import dataset_fingerprint, dataset_lengths, order_spec
from dtrain.data.loader import RankLoader, eval_batches, fetch, fetch_batch
from dtrain.data.partition import OrderSpec, plan_step
from dtrain.data.shards import ShardedDataset, write_shards
from dtrain.data.text import TokenSequences, TokenWindows, collate_padded
from dtrain.errors import DataError
from tests.conftest import tiny_config
from tests.data_helpers import rank_loader_ids, write_features, write_sequences
from tests.ranks import run_ranks
from tests.tasks import Regression

GBS, WORLD, RANK, MICRO = 10, 3, 1, 2  # 10 does not divide by 3 ranks x 2 micro-batches


@pytest.fixture(scope="module")
def features(tmp_path_factory: pytest.TempPathFactory) -> dict[int, ShardedDataset]:
    root = tmp_path_factory.mktemp("features")
    return {n: ShardedDataset(write_features(root / f"n{n}", n)) for n in (100, 101)}


def make_loader(dataset: Any, **kw: Any) -> RankLoader:
    options: dict[str, Any] = {
        "order": OrderSpec(len(dataset), seed=0),
        "global_batch_size": GBS,
        "micro_batches": MICRO,
        "rank": RANK,
        "world_size": WORLD,
        "collate_fn": default_collate,
        "fingerprint": dataset_fingerprint(dataset),
    }
    options.update(kw)
    return RankLoader(dataset, **options)


def take(loader: RankLoader, steps: int) -> list[tuple[list[list[int]], list[Any]]]:
    """``steps`` steps: this rank's plan ids and its collated micro-batches."""
    out = []
    for _ in range(steps):
        batch = next(loader)
        out.append(([m.tolist() for m in batch.ids], batch.micro))
    return out


def assert_same_steps(a: list[Any], b: list[Any]) -> None:
    assert len(a) == len(b)
    for (ids_a, micro_a), (ids_b, micro_b) in zip(a, b):
        assert ids_a == ids_b
        for ma, mb in zip(micro_a, micro_b):
            assert ma.keys() == mb.keys()
            for key in ma:
                assert torch.equal(ma[key], mb[key]), key


def cut_points(n: int, steps: int, count: int = 50, seed: int = 0) -> list[int]:
    last_of_epoch = (n - 1) // GBS  # the step that holds the epoch's last sample
    boundary = -(-n // GBS)  # the first step that starts in epoch 1
    special = {0, last_of_epoch, boundary, steps - 1}
    rng = np.random.default_rng(seed)
    rest = [int(k) for k in rng.permutation(steps) if int(k) not in special]
    return sorted(special) + rest[: count - len(special)]


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("n", [100, 101])
def test_resume_at_50_cut_points_equals_the_uninterrupted_run(
    features: dict[int, ShardedDataset], n: int, num_workers: int
) -> None:
    dataset = features[n]
    steps = 60  # 6 epochs: 50 distinct cut points among them
    reference_loader = make_loader(dataset, num_workers=num_workers)
    states = [reference_loader.state_dict()]
    reference = []
    for _ in range(steps):
        reference += take(reference_loader, 1)
        states.append(reference_loader.state_dict())
    reference_loader.close()
    # The ids are what the pure plan says, and the tensors hold those samples.
    for k, (ids, micro) in enumerate(reference):
        plan = plan_step(dataset_order(dataset), k * GBS, GBS, WORLD, MICRO)
        assert ids == [m.tolist() for m in plan.ids[RANK]]
        assert [m["id"].tolist() for m in micro] == ids
    cuts = cut_points(n, steps)
    assert len(cuts) == 50
    for k in cuts:
        resumed_loader = make_loader(dataset, num_workers=num_workers)
        resumed_loader.load_state_dict(states[k])
        # Three steps after the cut: the cut itself, the batch after, and one more.
        after = take(resumed_loader, min(3, steps - k))
        resumed_loader.close()
        assert_same_steps(after, reference[k : k + len(after)])
        assert states[k]["consumed"] == k * GBS


def dataset_order(dataset: Any) -> OrderSpec:
    return OrderSpec(len(dataset), seed=0)


def test_workers_and_threads_give_the_same_sequence(features: dict[int, ShardedDataset]) -> None:
    dataset = features[101]
    runs = []
    for options in ({"num_workers": 0, "prefetch": 0}, {"num_workers": 0}, {"num_workers": 2}):
        loader = make_loader(dataset, **options)
        runs.append(take(loader, 25))
        loader.close()
    assert_same_steps(runs[0], runs[1])
    assert_same_steps(runs[0], runs[2])


def test_loading_a_state_mid_iteration_drops_what_was_fetched_ahead(
    features: dict[int, ShardedDataset],
) -> None:
    dataset = features[100]
    loader = make_loader(dataset, prefetch=4)
    first = take(loader, 6)
    state = loader.state_dict()
    loader.load_state_dict(make_loader(dataset).state_dict())  # back to position 0
    again = take(loader, 6)
    assert_same_steps(first, again)
    loader.load_state_dict(state)
    reference = make_loader(dataset)
    take(reference, 6)
    assert_same_steps(take(loader, 4), take(reference, 4))
    loader.close()
    reference.close()


def test_skipped_steps_are_jumped_over_inside_a_planning_chunk(
    features: dict[int, ShardedDataset],
) -> None:
    # The loader plans 16 steps at once; a skipped range in the middle of a chunk must still
    # be jumped over, and stay skipped after a resume.
    dataset = features[101]
    loader = make_loader(dataset, prefetch=0)
    loader.skip(3 * GBS, 4 * GBS)
    loader.skip(9 * GBS, 11 * GBS)
    starts = [next(loader).plan.start for _ in range(10)]
    expected = [s * GBS for s in (0, 1, 2, 4, 5, 6, 7, 8, 11, 12)]
    assert starts == expected
    resumed = make_loader(dataset, prefetch=0)
    resumed.load_state_dict(make_loader(dataset).state_dict() | {"skipped": [[3 * GBS, 40]]})
    assert [next(resumed).plan.start for _ in range(4)] == [0, GBS, 2 * GBS, 40]
    loader.close()
    resumed.close()


def test_token_balanced_loader_resumes_exactly(tmp_path: Path) -> None:
    dataset = TokenSequences(ShardedDataset(write_sequences(tmp_path / "seq", 150)), max_len=64)
    lengths = dataset_lengths(dataset)
    assert lengths is not None

    def loader(workers: int) -> RankLoader:
        return make_loader(
            dataset,
            order=OrderSpec(
                len(dataset), seed=0, shuffle="locality", shard_sizes=dataset.shard_sizes
            ),
            global_batch_size=32,
            collate_fn=collate_padded,
            lengths=lengths,
            num_workers=workers,
        )

    reference_loader = loader(0)
    states, reference = [], []
    for _ in range(12):
        states.append(reference_loader.state_dict())
        batch = next(reference_loader)
        reference.append((batch.ids, batch.micro))
    reference_loader.close()
    for k in (0, 4, 5, 11):  # 150 / 32: the epoch ends inside step 4
        for workers in (0, 2):
            resumed = loader(workers)
            resumed.load_state_dict(states[k])
            for ids, micro in reference[k : k + 2]:
                batch = next(resumed)
                assert [m.tolist() for m in batch.ids] == [m.tolist() for m in ids]
                for (x, y), (rx, ry) in zip(batch.micro, micro):
                    assert torch.equal(x, rx) and torch.equal(y, ry)
            resumed.close()


# -- refusals ------------------------------------------------------------------------------


def test_load_state_dict_refuses_another_stream(
    features: dict[int, ShardedDataset], tmp_path: Path
) -> None:
    dataset = features[100]
    state = make_loader(dataset).state_dict() | {"consumed": 30}
    with pytest.raises(DataError, match=r"run\.seed 0, this run has 1"):
        make_loader(dataset, order=OrderSpec(100, seed=1)).load_state_dict(state)
    with pytest.raises(DataError, match="the dataset size 100, this run has 101"):
        make_loader(features[101]).load_state_dict(state)
    other = ShardedDataset(write_features(tmp_path / "other", 100, seed=5))
    with pytest.raises(DataError, match=r"the dataset \(fingerprint\)"):
        make_loader(other).load_state_dict(state)
    with pytest.raises(DataError, match=r"data\.shuffle 'full', this run has 'none'"):
        make_loader(dataset, order=OrderSpec(100, seed=0, shuffle="none")).load_state_dict(state)
    local = make_loader(dataset, order=OrderSpec(100, 0, "locality", window=20))
    with pytest.raises(DataError, match=r"data\.shuffle_window 20, this run has 40"):
        make_loader(dataset, order=OrderSpec(100, 0, "locality", window=40)).load_state_dict(
            local.state_dict()
        )
    with pytest.raises(DataError, match="not a count"):
        make_loader(dataset).load_state_dict(state | {"consumed": -1})
    resumed = make_loader(dataset)
    resumed.load_state_dict(state)
    assert resumed.consumed == 30


def test_a_world_larger_than_the_dataset_is_refused(tmp_path: Path) -> None:
    tiny = ShardedDataset(write_features(tmp_path / "tiny", 3))
    with pytest.raises(DataError, match="3 samples, fewer than the 4 data-parallel ranks"):
        make_loader(tiny, world_size=4, rank=0, micro_batches=1, global_batch_size=8)
    with pytest.raises(DataError, match="cannot give 3 ranks x 2 micro-batches"):
        make_loader(tiny, global_batch_size=5)


# -- evaluation ----------------------------------------------------------------------------


@pytest.mark.parametrize("n", [97, 101])
def test_evaluation_counts_every_sample_once(tmp_path: Path, n: int) -> None:
    dataset = ShardedDataset(write_features(tmp_path / "eval", n))
    for world in (1, 2, 3, 4):
        seen: list[int] = []
        for rank in range(world):
            for batch in eval_batches(dataset, rank, world, 8, default_collate):
                seen += batch["id"].tolist()
        assert sorted(seen) == list(range(n))  # N does not divide: nothing padded or dropped
    capped = [
        i
        for rank in range(4)
        for b in eval_batches(dataset, rank, 4, 8, default_collate, max_samples=50)
        for i in b["id"].tolist()
    ]
    assert sorted(capped) == list(range(50))


def test_evaluation_of_a_user_dataset() -> None:
    data = Regression(17)
    rows = [b[0] for rank in range(3) for b in eval_batches(data, rank, 3, 4, default_collate)]
    assert torch.equal(torch.cat(rows), data.x)


# -- the fast path and user datasets ------------------------------------------------------


def test_the_vectorized_batch_equals_default_collate(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    samples = [
        {
            "f32": rng.standard_normal((3, 4)).astype(np.float32),
            "f16": rng.standard_normal(5).astype(np.float16),
            "i64": np.int64(i),
            "u8": rng.integers(0, 255, 16).astype(np.uint8),
            "i32": rng.integers(-5, 5, (2, 2)).astype(np.int32),
            "flag": np.bool_(i % 2),
        }
        for i in range(40)
    ]
    dataset = ShardedDataset(write_shards(samples, tmp_path / "mixed", shard_bytes=300))
    assert len(dataset.shard_sizes) > 3
    for ids in ([0], [5, 39, 0, 17, 17, 3], list(range(40))[::-1], [12, 13, 14]):
        fast = fetch_batch(dataset, ids, default_collate)
        with warnings.catch_warnings():  # torch warns about tensors over read-only maps
            warnings.simplefilter("ignore", UserWarning)
            slow = default_collate(fetch(dataset, ids))
        assert fast.keys() == slow.keys()
        for key in fast:
            assert fast[key].dtype == slow[key].dtype, key
            assert torch.equal(fast[key], slow[key]), key


def test_a_user_map_style_dataset_gets_the_same_partition() -> None:
    data = Regression(50)
    loader = make_loader(data)
    for k in range(8):
        batch = next(loader)
        plan = plan_step(OrderSpec(50, seed=0), k * GBS, GBS, WORLD, MICRO)
        for ids, (x, _) in zip(plan.ids[RANK], batch.micro):
            assert torch.equal(x, data.x[torch.as_tensor(ids)])
    loader.close()
    assert dataset_fingerprint(data) == "tests.tasks.Regression:50"
    assert dataset_lengths(data) is None


def test_order_spec_follows_the_storage_shards(tmp_path: Path) -> None:
    cfg = tiny_config(tmp_path, data={"shuffle": "locality"})
    raw = ShardedDataset(write_sequences(tmp_path / "seq", 300))
    windows = TokenWindows(raw, seq_len=16)
    sequences = TokenSequences(raw, max_len=16)
    for dataset in (raw, windows, sequences):
        spec = order_spec(dataset, cfg)
        assert sum(spec.shard_sizes) == len(dataset)
        assert len(spec.shard_sizes) == len(raw.shard_sizes) > 3
    # Every window is the token stream cut at multiples of seq_len.
    stream = np.concatenate([raw[i]["tokens"] for i in range(len(raw))])
    for i in (0, 1, len(windows) // 2, len(windows) - 1):
        assert windows[i].tolist() == stream[i * 16 : i * 16 + 17].tolist()


# -- real ranks ----------------------------------------------------------------------------


@pytest.mark.parametrize("world", [2, 3])
def test_each_rank_gets_a_disjoint_part_of_every_global_batch(
    features: dict[int, ShardedDataset], world: int
) -> None:
    # num_workers = 0: run_ranks starts daemonic processes, which may not start DataLoader
    # workers; workers are covered in-process above.
    dataset = features[101]
    results = run_ranks(rank_loader_ids, world, str(dataset.path), 12, 14, 2, 0)
    spec = OrderSpec(101, seed=9, shard_sizes=dataset.shard_sizes)
    for step in range(12):
        plan = plan_step(spec, step * 14, 14, world, 2)
        mine = [np.concatenate(r[step]["mine"]).tolist() for r in results]
        # Every rank computed the same plan, and read exactly its own part of it.
        for rank, r in enumerate(results):
            assert r[step]["plan"] == [[m.tolist() for m in p] for p in plan.ids]
            assert r[step]["mine"] == [m.tolist() for m in plan.ids[rank]]
        # Parts are disjoint stream positions whose union is the global batch.
        assert sorted(i for part in mine for i in part) == sorted(
            i for rank in plan.ids for m in rank for i in m.tolist()
        )
        assert sum(len(part) for part in mine) == 14


class HFStandIn(Regression):
    """What dtrain reads of a Hugging Face ``datasets.Dataset``: its class's module (the
    ``datasets`` package) and its ``_fingerprint``, which the library changes with every
    ``map``/``filter``. (The real class, checked once by hand with datasets 5.2, keeps the
    same attribute; the dev extra leaves datasets and its pandas out.)"""

    __module__ = "datasets.arrow_dataset"

    def __init__(self, n: int, fingerprint: str) -> None:
        super().__init__(n)
        self._fingerprint = fingerprint


def test_a_datasets_dataset_is_identified_by_its_own_fingerprint() -> None:
    data = HFStandIn(50, "a1b2c3")
    assert dataset_fingerprint(data) == "datasets:a1b2c3"
    state = make_loader(data).state_dict() | {"consumed": 16}
    make_loader(HFStandIn(50, "a1b2c3")).load_state_dict(state)  # the same data: resumes
    # The same size after another map(): not the same samples (before, only the class and
    # the size were compared, and this resumed).
    with pytest.raises(DataError, match=r"the dataset \(fingerprint\) 'datasets:a1b2c3'"):
        make_loader(HFStandIn(50, "d4e5f6")).load_state_dict(state)
    # Another library's _fingerprint means nothing to dtrain.
    other = Regression(50)
    other._fingerprint = "x"  # type: ignore[attr-defined]
    assert dataset_fingerprint(other) == "tests.tasks.Regression:50"
