"""The training loader a task's dataset gets: policy chosen by what the data is (a map-style
dataset: the global plan, :mod:`dtrain.data.loader`; a stream: :mod:`dtrain.data.stream_loader`)."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from dtrain.config import Config
from dtrain.data.loader import RankLoader, StepLoader
from dtrain.data.partition import OrderSpec
from dtrain.data.read_ahead import ReadAhead
from dtrain.data.store_shards import StoreShards
from dtrain.data.stream_loader import StreamLoader
from dtrain.data.stream_source import PREPARE_HINT, is_stream, stream_source
from dtrain.errors import ConfigError, DataError

if TYPE_CHECKING:
    from dtrain.task import Task


def dataset_lengths(dataset: Any) -> np.ndarray | None:
    """Per-sample token counts when the dataset has variable-length samples, else None."""
    method = getattr(dataset, "sample_lengths", None)
    if method is None:
        return None
    lengths = method()
    return None if lengths is None else np.asarray(lengths, dtype=np.int64)


def dataset_fingerprint(dataset: Any) -> str:
    """What identifies the data for a resume check: the manifest hash for dtrain datasets; a
    Hugging Face ``datasets.Dataset``'s own fingerprint (a hash of its source and of every
    transform applied, which changes when a ``map`` or ``filter`` does); else the class and
    size of the map-style dataset."""
    fingerprint = getattr(dataset, "fingerprint", None)
    if isinstance(fingerprint, str):
        return fingerprint
    # The _fingerprint a datasets.Dataset keeps (the library has no public name for it), read
    # only from objects of that library's classes: datasets is not imported.
    if type(dataset).__module__.partition(".")[0] == "datasets":
        own = getattr(dataset, "_fingerprint", None)
        if isinstance(own, str) and own:
            return f"datasets:{own}"
    return f"{type(dataset).__module__}.{type(dataset).__qualname__}:{len(dataset)}"


def order_spec(dataset: Any, cfg: Config) -> OrderSpec:
    return OrderSpec(
        num_samples=len(dataset),
        seed=cfg.run.seed,
        shuffle=cfg.data.shuffle,
        shard_sizes=tuple(getattr(dataset, "shard_sizes", ())),
        window=cfg.data.shuffle_window,
    )


def default_prefetch(requested: int, device: torch.device) -> int:
    """Measured on the default job (2 CPU workers): a prefetch thread cost 20-25% of the
    throughput, holding the GIL and a core the step needs. On a GPU the step runs on the device
    and the thread hides the fetch and the pinned copy."""
    if requested >= 0:
        return requested
    return 2 if device.type == "cuda" else 0


def max_micro_batch(cfg: Config, data_parallel_size: int) -> int:
    """Samples a rank holds per micro-batch at most under load balancing: ``balance.
    max_micro_batch``, by default the micro-batch of an equal split (so a rank given a larger
    share accumulates over more micro-steps instead of needing more memory). 0 without load
    balancing: every rank runs ``data.micro_batches`` micro-steps."""
    if cfg.balance.mode == "off":
        return 0
    if cfg.balance.max_micro_batch > 0:
        return cfg.balance.max_micro_batch
    per_step = data_parallel_size * cfg.data.micro_batches
    return -(-cfg.data.global_batch_size // per_step)


def check_task_data(task: Task, cfg: Config) -> None:
    """What the task's data cannot do, refused in one line before the model is spread or a
    step runs (the datasets exist only once the task is built, in the workers): a global batch
    larger than a map-style training set, what a stream cannot do."""
    if not is_stream(task.train_data):
        check_batch_fits(len(task.train_data), cfg.data.global_batch_size)
    if task.val_data is not None and is_stream(task.val_data):
        raise DataError(
            "Task.val_data is a stream: evaluation gives every rank a contiguous share of a "
            "sized set; give a map-style val_data (e.g. datasets.Dataset.from_list(list("
            f"stream.take(n)))) {PREPARE_HINT}"
        )
    if not is_stream(task.train_data):
        return
    stream_source(task.train_data)  # a one-pass iterator, a malformed protocol: refused here
    if cfg.data.num_workers > 0:
        raise ConfigError(
            f"data.num_workers = {cfg.data.num_workers}: worker processes fetch a map-style "
            "dataset's planned ids; a stream is read in the training process: set "
            f"data.num_workers = 0, {PREPARE_HINT}"
        )
    if cfg.data.split == "tokens":
        raise ConfigError(
            "data.split = 'tokens' needs every sample's length before the step; a stream's "
            "are unknown until read: use 'samples' or 'auto'"
        )


def check_batch_fits(num_samples: int, global_batch_size: int) -> None:
    """A step takes ``global_batch_size`` consecutive positions of the stream, epochs back to
    back: past the training set's size one step would take some samples twice, and each rank
    would plan and hold its share of a batch no data needs (a batch of 10^8 grew rank 0 until
    the kernel killed it). The training set's size is the bound."""
    if global_batch_size > num_samples:
        raise ConfigError(
            f"data.global_batch_size = {global_batch_size} is more than the training set's "
            f"{num_samples} samples: one step would take some samples twice (and every rank "
            f"hold its share of them at once); use at most {num_samples}"
        )


def build_train_loader(
    task: Task,
    cfg: Config,
    rank: int,
    ranks: int,
    device: torch.device,
    exchange: Callable[[Any], list[Any]] | None = None,
) -> StepLoader:
    """This data-parallel ``rank``'s loader, of ``ranks`` that share each global batch.
    ``exchange`` (collective: every rank's value, in rank order; None for one process) carries
    a stream's shard positions between the ranks. The caller ran :func:`check_task_data`."""
    dataset = task.train_data
    if is_stream(dataset):
        if exchange is None and ranks > 1:
            raise ValueError("a stream read by several ranks needs their exchange of positions")
        return StreamLoader(
            stream_source(dataset),
            seed=cfg.run.seed,
            shuffle=cfg.data.shuffle,
            global_batch_size=cfg.data.global_batch_size,
            micro_batches=cfg.data.micro_batches,
            rank=rank,
            world_size=ranks,
            collate_fn=task.collate_fn,
            exchange=exchange or (lambda value: [value]),
            max_micro_batch=max_micro_batch(cfg, ranks),
            pin_memory=device.type == "cuda",
        )
    lengths = None
    if cfg.data.split in ("auto", "tokens"):
        lengths = dataset_lengths(dataset)
        if lengths is None and cfg.data.split == "tokens":
            raise ConfigError(
                "data.split = 'tokens' needs variable-length samples: the "
                "training set has no sample_lengths(); use 'samples' or 'auto'"
            )
    ahead = None
    store = getattr(dataset, "store", None)  # shards in an object store
    if isinstance(store, StoreShards):
        if cfg.data.num_workers > 0:
            raise ConfigError(
                f"data.num_workers = {cfg.data.num_workers}: shards in an object store "
                f"({store.root}) are read ahead by the training process; set "
                "data.num_workers = 0"
            )
        store.limit = cfg.data.cache_bytes  # the machine's: its ranks share the cache
        store.sharers = int(os.environ.get("LOCAL_WORLD_SIZE") or 1)  # torch's elastic agent's
        ahead = ReadAhead(store, dataset.pieces, rank)
    return RankLoader(
        dataset,
        ahead=ahead,
        order=order_spec(dataset, cfg),
        global_batch_size=cfg.data.global_batch_size,
        micro_batches=cfg.data.micro_batches,
        rank=rank,
        world_size=ranks,
        collate_fn=task.collate_fn,
        lengths=lengths,
        max_micro_batch=max_micro_batch(cfg, ranks),
        num_workers=cfg.data.num_workers,
        prefetch=default_prefetch(cfg.data.prefetch, device),
        pin_memory=device.type == "cuda",
        fingerprint=dataset_fingerprint(dataset),
    )
