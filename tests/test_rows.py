"""ShardRows: one read of a batch spread over many shards, on both of its paths (a row grid
read by ``take`` when the shards' rows line up, a byte-strided view otherwise)."""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest

from dtrain.data.rows import ShardRows
from dtrain.data.shards import ShardedDataset, write_shards


def carved_shards(
    byte_gaps: list[int], sizes: list[int], row_shape: tuple[int, ...], dtype: str
) -> tuple[list[np.ndarray], np.ndarray, np.ndarray]:
    """Shards cut out of one buffer, each starting ``byte_gaps[s]`` bytes after the previous
    one ends: the gaps decide whether the rows of all shards lie on one grid."""
    rng = np.random.default_rng(0)
    item = np.dtype(dtype).itemsize * int(np.prod(row_shape))
    buffer = np.zeros(sum(sizes) * item + sum(byte_gaps) + 64, dtype=np.uint8)
    shards, position = [], 0
    for gap, size in zip(byte_gaps, sizes):
        position += gap
        raw = buffer[position : position + size * item]
        raw[:] = rng.integers(0, 256, raw.size, dtype=np.uint8)
        shards.append(raw.view(dtype).reshape(size, *row_shape))
        position += size * item
    starts = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    return shards, starts, np.concatenate(shards)


@pytest.mark.parametrize(
    ("gaps", "on_grid"),
    [([0, 0, 24, 12, 0], True), ([0, 5, 0, 3, 1], False)],
)
def test_both_paths_read_exactly_the_rows_asked_for(gaps: list[int], on_grid: bool) -> None:
    sizes = [7, 1, 13, 5, 9]
    shards, starts, everything = carved_shards(gaps, sizes, (3,), "int32")
    opened: list[int] = []

    def open_shard(s: int) -> np.ndarray:
        opened.append(s)
        return shards[s]

    rows = ShardRows(open_shard, starts, np.dtype("int32"), (3,))
    rng = np.random.default_rng(1)
    first = np.array([8, 9], dtype=np.int64)  # shard 2 only
    got = rows.read(first, starts.searchsorted(first, "right") - 1)
    assert np.array_equal(got, everything[first]) and opened == [2]
    for _ in range(20):  # unsorted, repeated, across every shard
        ids = rng.integers(0, len(everything), rng.integers(1, 60)).astype(np.int64)
        got = rows.read(ids, starts.searchsorted(ids, "right") - 1)
        assert got.dtype == np.int32 and got.shape == (len(ids), 3)
        assert np.array_equal(got, everything[ids])
    assert rows._layout is not None and rows._layout.grid is on_grid
    assert sorted(opened) == [0, 1, 2, 3, 4]
    assert rows.read(np.zeros(0, np.int64), np.zeros(0, np.int64)).shape == (0, 3)


def test_a_dataset_of_many_shards_reads_any_ids_exactly(tmp_path: Path) -> None:
    n = 600
    features = np.random.default_rng(2).standard_normal((n, 5)).astype(np.float32)
    labels = np.arange(n, dtype=np.int64) * 7
    out = write_shards(
        ({"f": features[i], "y": labels[i]} for i in range(n)), tmp_path / "ds", shard_bytes=200
    )
    dataset = ShardedDataset(out)
    assert len(dataset.shard_sizes) > 50
    ids = np.random.default_rng(3).permutation(n)[:250]
    assert np.array_equal(dataset.gather("f", ids), features[ids])
    assert np.array_equal(dataset.gather("y", ids), labels[ids])
    with pytest.raises(IndexError, match="out of range"):
        dataset.gather("y", [0, -1])
    with pytest.raises(IndexError, match="out of range"):
        dataset.gather("y", [n])


def test_a_thread_reading_while_another_maps_shards_sees_the_right_rows() -> None:
    # A prefetch thread and the training thread may read one field while shards are being
    # mapped. Here thread A maps shards 0 and 1 for its batch; while it opens shard 1 (shard
    # 0 is open by then), thread B reads from shard 0. B must not use a half-built layout.
    shards, starts, everything = carved_shards([0, 8, 8], [4, 4, 4], (2,), "int64")
    results: dict[str, np.ndarray] = {}

    def read(ids: list[int]) -> np.ndarray:
        idx = np.asarray(ids, dtype=np.int64)
        return rows.read(idx, starts.searchsorted(idx, "right") - 1)

    def reader_b() -> None:
        results["b"] = read([1, 2])  # shard 0 only

    thread_b = threading.Thread(target=reader_b)

    def open_shard(s: int) -> np.ndarray:
        if s == 1:  # shard 0 is open: let B read now, for as long as it will take
            thread_b.start()
            thread_b.join(timeout=0.3)
        return shards[s]

    rows = ShardRows(open_shard, starts, np.dtype("int64"), (2,))
    results["a"] = read([0, 5, 6])  # shards 0 and 1
    thread_b.join()
    assert np.array_equal(results["a"], everything[[0, 5, 6]])
    assert np.array_equal(results["b"], everything[[1, 2]])
