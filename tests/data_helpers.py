"""Small datasets for the data-layer tests, and functions the ranks of
:func:`tests.ranks.run_ranks` import as ``tests.data_helpers:<name>``."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from torch.utils.data import default_collate

from dtrain.data.loader import RankLoader
from dtrain.data.partition import OrderSpec, _part_bounds, step_shape
from dtrain.data.shards import FieldSpec, ShardedDataset, write_shards


def feature_rows(n: int, seed: int = 0) -> dict[str, np.ndarray]:
    """Fixed-size samples whose ``id`` field names the sample, so a batch says what it holds."""
    rng = np.random.default_rng(seed)
    return {
        "x": rng.standard_normal((n, 3, 4)).astype(np.float32),
        "id": np.arange(n, dtype=np.int64),
        "label": rng.integers(0, 10, n).astype(np.uint8),
    }


def write_features(path: Path, n: int, seed: int = 0, shard_bytes: int = 1500) -> Path:
    """A dataset of ``n`` fixed-size samples in several small shards."""
    rows = feature_rows(n, seed)
    samples = ({k: v[i] for k, v in rows.items()} for i in range(n))
    return write_shards(samples, path, shard_bytes=shard_bytes)


def write_sequences(path: Path, n: int, seed: int = 0, shard_bytes: int = 2000) -> Path:
    """``n`` variable-length token sequences (skewed lengths) plus their ``id``."""
    rng = np.random.default_rng(seed)
    lengths = np.minimum(200, 2 + rng.pareto(1.5, n) * 10).astype(np.int64)
    samples = (
        {"tokens": rng.integers(0, 256, int(length)), "id": np.int64(i)}
        for i, length in enumerate(lengths)
    )
    return write_shards(
        samples, path, fields={"tokens": FieldSpec("uint16", None)}, shard_bytes=shard_bytes
    )


def rank_loader_ids(data_dir: str, steps: int, gbs: int, micro: int, workers: int) -> Any:
    """Run inside a rank: this rank's ``id`` tensors for ``steps`` steps, per micro-batch, and
    the plan's global ids, so the parent can check the cut."""
    import torch.distributed as dist

    dataset = ShardedDataset(data_dir)
    loader = RankLoader(
        dataset,
        order=OrderSpec(len(dataset), seed=9, shard_sizes=dataset.shard_sizes),
        global_batch_size=gbs,
        micro_batches=micro,
        rank=dist.get_rank(),
        world_size=dist.get_world_size(),
        collate_fn=default_collate,
        num_workers=workers,
        fingerprint=dataset.fingerprint,
    )
    out = []
    for _, batch in zip(range(steps), loader):
        out.append(
            {
                "mine": [m["id"].tolist() for m in batch.micro],
                "plan": [[m.tolist() for m in rank] for rank in batch.plan.ids],
            }
        )
    loader.close()
    return out


# -- measures of a split, for the partitioner's tests -----------------------------------------


def partition_samples(
    ids: np.ndarray, world_size: int, micro_batches: int, weights: Sequence[float] | None = None
) -> list[list[np.ndarray]]:
    """The product's equal-count (or weight-proportional) contiguous split of ``ids`` (its
    :func:`~dtrain.data.partition.step_shape`, laid out in order): ``result[rank][micro]``."""
    shape = step_shape(len(ids), world_size, micro_batches, weights)
    return [[np.sort(ids[a:b]) for a, b in rank] for rank in _part_bounds(shape)]


def imbalance(parts: list[list[np.ndarray]], lengths: np.ndarray) -> float:
    """Max over mean of the tokens per rank: 1.0 is perfect balance."""
    tokens = np.array(
        [sum(int(lengths[m].sum()) for m in rank) for rank in parts], dtype=np.float64
    )
    return float(tokens.max() / tokens.mean()) if tokens.mean() > 0 else 1.0


def imbalance_bound(batch_lengths: np.ndarray, world_size: int) -> float:
    """The best max/mean any split can reach: one sequence longer than a rank's fair share of
    the tokens sets the floor."""
    total = float(np.sum(batch_lengths))
    if total <= 0:
        return 1.0
    return max(1.0, float(np.max(batch_lengths)) / (total / world_size))
