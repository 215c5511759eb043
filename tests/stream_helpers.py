"""Streams for the tests of dtrain.data.stream_loader: a stream of dtrain's protocol, JSONL
shards for a Hugging Face streaming dataset, the tiny GPT task trained on either
(``tests.stream_helpers:stream_gpt``), and the exactly-once check per source shard."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import IterableDataset

from dtrain.config import Config
from dtrain.data.stream_units import ID_BITS, UnitMap
from dtrain.models.gpt import GPT, GPTConfig
from dtrain.task import Task, task_config
from tests.tasks import TinyOptions, lm_loss

LENGTHS = (9, 12, 7, 0, 11)  # items per source shard; one empty


def split_id(sample: int) -> tuple[int, int]:
    """``(unit, index)`` of a sample id (:func:`dtrain.data.stream_units.sample_id`)."""
    return sample >> ID_BITS, sample & ((1 << ID_BITS) - 1)


class ShardStream(IterableDataset[tuple[int, int]]):
    """dtrain's protocol: ``num_shards`` and ``read_shard(index, start)``; item ``(shard,
    index)``. ``__iter__`` reads the shards one after another (what a plain loop would)."""

    def __init__(self, lengths: Sequence[int]) -> None:
        self.lengths = list(lengths)
        self.num_shards = len(self.lengths)

    def read_shard(self, index: int, start: int) -> Iterator[tuple[int, int]]:
        return ((index, k) for k in range(start, self.lengths[index]))

    def __iter__(self) -> Iterator[tuple[int, int]]:
        for shard in range(self.num_shards):
            yield from self.read_shard(shard, 0)


class Unsharded(IterableDataset[tuple[int, int]]):
    """A plain IterableDataset: one shard of ``sum(lengths)`` items, read again on every
    ``iter``."""

    def __init__(self, lengths: Sequence[int]) -> None:
        self.inner = ShardStream([sum(lengths)])

    def __iter__(self) -> Iterator[tuple[int, int]]:
        return iter(self.inner)


def write_jsonl_shards(folder: Path, lengths: Sequence[int]) -> list[str]:
    """One JSONL file per source shard: ``{"shard": i, "index": k}`` per line."""
    folder.mkdir(parents=True, exist_ok=True)
    files = []
    for shard, n in enumerate(lengths):
        path = folder / f"part-{shard:02d}.jsonl"
        path.write_text("".join(json.dumps({"shard": shard, "index": k}) + "\n" for k in range(n)))
        files.append(str(path))
    return files


def hf_stream(folder: Path) -> Any:
    import datasets

    files = sorted(str(p) for p in folder.glob("part-*.jsonl"))
    return datasets.load_dataset("json", data_files=files, split="train", streaming=True)


def item_key(item: Any) -> tuple[int, int]:
    if isinstance(item, dict):
        return int(item["shard"]), int(item["index"])
    shard, index = item
    return int(shard), int(index)


def windows(items: list[Any], seq_len: int = 16) -> torch.Tensor:
    """Token windows that are a function of each item's (shard, index)."""
    rows = []
    for item in items:
        shard, index = item_key(item)
        rng = np.random.default_rng([shard, index])
        rows.append(rng.integers(0, 64, seq_len + 1))
    return torch.from_numpy(np.stack(rows))


def collate_stream(items: list[Any]) -> tuple[torch.Tensor, torch.Tensor]:
    data = windows(items)
    return data[:, :-1], data[:, 1:]


@dataclass
class StreamOptions(TinyOptions):
    stream: str = "protocol"  # protocol | datasets | iterable | oneshot
    stream_dir: str = ""  # the JSONL shards (stream = "datasets")
    val_stream: bool = False


@task_config(StreamOptions)
def stream_gpt(cfg: Config) -> Task:
    opts: StreamOptions = cfg.task
    model = GPT(GPTConfig(vocab_size=64, seq_len=16, n_layer=1, n_head=2, d_model=16))
    train: Any
    if opts.stream == "datasets":
        train = hf_stream(Path(opts.stream_dir))
    elif opts.stream == "iterable":
        train = Unsharded(LENGTHS)
    elif opts.stream == "oneshot":
        train = iter(ShardStream(LENGTHS))
    else:
        train = ShardStream(LENGTHS)
    return Task(
        model=model,
        train_data=train,
        val_data=ShardStream(LENGTHS) if opts.val_stream else None,
        loss_fn=lm_loss,
        collate_fn=collate_stream,
        item_name="tokens",
    )


def check_units(
    ids: Iterable[int], lengths: Sequence[int], state: dict[str, Any], shuffled: bool = False
) -> int:
    """Exactly once, per unit (a pass over one source shard, dtrain.data.stream_units): each
    unit's delivered indices are ``0 .. m-1``, each once, where ``m`` is the shard's length for
    a finished unit and the position ``state`` (the run's last data position) holds for a unit
    in flight; no unit of the queue missing, none beyond it. Returns the items checked."""
    units = UnitMap(len(lengths), int(state["seed"]), shuffled)
    delivered: dict[int, Counter[int]] = {}
    for sample in ids:
        unit, index = split_id(int(sample))
        delivered.setdefault(unit, Counter())[index] += 1
    in_flight = {int(u): int(p) for u, p, _ in state["open"]}
    assert max(delivered) < state["next_unit"], (sorted(delivered), state)
    total = 0
    for unit in range(int(state["next_unit"])):
        _, shard = units.locate(unit)
        expected = in_flight.get(unit, lengths[shard])
        got = delivered.get(unit, Counter())
        assert got == Counter(range(expected)), (unit, shard, expected, sorted(got.items()))
        total += expected
    return total
