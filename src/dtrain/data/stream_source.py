"""What a streaming ``train_data`` is to dtrain: a number of source shards, each read from a
given item on. Three kinds, best first: dtrain's protocol (``num_shards``, ``read_shard(index,
start)``), a Hugging Face streaming ``datasets.IterableDataset`` (shard ``i`` is
``dataset.shard(n_shards, i)``), any other iterable (one shard); docs/data.md, "Streams".

The reader assumes what it cannot check: a shard yields the same items in the same order
every time it is read (a seeded shuffle buffer does; a live feed does not). A one-pass iterator
(``iter(x) is x``) cannot be read twice and is refused.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from dtrain.errors import DataError

PREPARE_HINT = "or write it to shards with `dtrain prepare` (docs/data.md)"


def is_stream(dataset: Any) -> bool:
    """Whether ``dataset`` is read by iterating (no ``__len__``/``__getitem__`` to plan over)."""
    if isinstance(dataset, torch.utils.data.IterableDataset):
        return True
    if hasattr(dataset, "read_shard") or _is_hf_stream(dataset):
        return True
    sized = hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__")
    return not sized and hasattr(dataset, "__iter__")


def _is_hf_stream(dataset: Any) -> bool:
    # Read only from objects of that library's classes: datasets is not imported.
    return type(dataset).__module__.partition(".")[0] == "datasets" and hasattr(dataset, "n_shards")


@dataclass(frozen=True)
class StreamSource:
    """A stream as source shards: ``read(shard, start, epoch)`` iterates one from an item on."""

    num_shards: int
    fingerprint: str
    kind: str  # "protocol" | "datasets" | "iterable": what the start-up line says
    read: Callable[[int, int, int], Iterator[Any]]


def stream_source(dataset: Any) -> StreamSource:
    """``dataset`` (a stream: :func:`is_stream`) as source shards; a stream dtrain cannot read
    again is refused in one line that says what to do."""
    name = f"{type(dataset).__module__}.{type(dataset).__qualname__}"
    own = getattr(dataset, "fingerprint", None)
    if hasattr(dataset, "read_shard"):
        count = getattr(dataset, "num_shards", None)
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise DataError(
                f"Task.train_data ({name}) has read_shard() but num_shards = {count!r}: "
                "give the number of its source shards as a positive int"
            )
        return StreamSource(
            count,
            own if isinstance(own, str) else f"{name}:{count} shards",
            "protocol",
            lambda shard, start, epoch: iter(dataset.read_shard(shard, start)),
        )
    if _is_hf_stream(dataset):
        count = int(dataset.n_shards)
        return StreamSource(
            count,
            own if isinstance(own, str) else f"{name}:{count} shards",
            "datasets",
            lambda shard, start, epoch: _hf_shard(dataset, count, shard, start, epoch),
        )
    try:
        first, second = iter(dataset), iter(dataset)
    except TypeError:
        raise DataError(
            f"Task.train_data ({name}) is neither a map-style dataset (__len__, __getitem__) "
            f"nor iterable; give one of them, {PREPARE_HINT}"
        ) from None
    if first is second or first is dataset:
        raise DataError(
            f"Task.train_data ({name}) is a one-pass iterator: dtrain reads a stream again for "
            "every pass and on resume; give an IterableDataset whose __iter__ starts a new "
            f"pass, implement num_shards and read_shard(index, start), {PREPARE_HINT}"
        )
    return StreamSource(
        1,
        own if isinstance(own, str) else f"{name}:unsharded",
        "iterable",
        lambda shard, start, epoch: _skip(_iterate(dataset, epoch), start),
    )


def _iterate(dataset: Any, epoch: int) -> Iterator[Any]:
    set_epoch = getattr(dataset, "set_epoch", None)
    if callable(set_epoch):
        set_epoch(epoch)
    return iter(dataset)


def _hf_shard(dataset: Any, count: int, shard: int, start: int, epoch: int) -> Iterator[Any]:
    part = dataset.shard(num_shards=count, index=shard) if count > 1 else dataset
    return _skip(_iterate(part, epoch), start)


def _skip(items: Iterator[Any], start: int) -> Iterator[Any]:
    """``items`` from item ``start`` on (the ones before read and dropped)."""
    return itertools.islice(items, start, None) if start else items
