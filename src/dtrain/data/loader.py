"""Per-rank batch iterators with an O(1), world-size-independent position.

:class:`RankLoader` turns the pure plan of :mod:`dtrain.data.partition` into collated
micro-batches for one rank. Its state is the global stream position (plus what identifies the
stream: seed, dataset size and fingerprint), so ``load_state_dict`` resumes at any step
instantly -- the next plan is computed, not replayed -- and at any world size.

Fetching runs ahead of the step: in a background thread when ``num_workers == 0``, or in torch
``DataLoader`` worker processes otherwise. Both fetch the same ids in the same order, so the
sequence of batches does not depend on ``num_workers``.
"""

from __future__ import annotations

import collections
import queue
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import KW_ONLY, dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, Self

import numpy as np
import torch
from torch.utils.data import DataLoader

from dtrain.data.partition import OrderSpec, StepPlan, check_weights, eval_shard, plan_steps
from dtrain.data.read_ahead import ReadAhead
from dtrain.errors import DataError

if TYPE_CHECKING:
    from dtrain.task import Task

Collate = Callable[[list[Any]], Any]
# Steps planned at once: 16, or fewer where their ids would pass PLAN_IDS (a plan holds its
# global batch's ids: 16 batches of 10^6 samples would be 64 MB of them). Plans are a pure
# function of the position: how many are made at once changes no plan.
PLAN_CHUNK = 16
PLAN_IDS = 1 << 20


@dataclass
class StepBatch:
    """This rank's part of one optimizer step."""

    plan: StepPlan
    micro: list[Any]  # collated micro-batches, in micro-step order
    rank: int

    @property
    def ids(self) -> list[np.ndarray]:
        return self.plan.rank_ids(self.rank)

    def planned_items(self, items_per_sample: int, count: int, step: int) -> int:
        """The step's global item count from its plan, when every sample holds
        ``items_per_sample`` items (``Task.items_per_sample``): no collective needed. This
        rank's own ``count`` is checked against it."""
        samples = sum(len(ids) for ids in self.ids)
        if count != samples * items_per_sample:
            raise DataError(
                f"data-parallel rank {self.rank}, step {step}: Task.items_per_sample = "
                f"{items_per_sample}, but this rank's {samples} samples hold {count} items; "
                "declare it only when every sample holds that many (or leave it None: the "
                "ranks then count every step's items)"
            )
        return (self.plan.end - self.plan.start) * items_per_sample


class StepLoader(Protocol):
    """What the training loop asks of a loader: a map-style dataset's :class:`RankLoader`
    or a stream's (:class:`dtrain.data.stream_loader.StreamLoader`)."""

    skipped: dict[int, int]  # start -> end of stream ranges never delivered (the NaN guard's)

    def __next__(self) -> StepBatch: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...

    def skip(self, start: int, end: int) -> None: ...

    def set_weights(self, weights: Sequence[float] | None) -> None: ...

    def epoch(self) -> float: ...

    def warm(self, state: dict[str, Any] | None = None) -> None: ...

    def close(self) -> None: ...

    def notice(self) -> str: ...


def fetch(dataset: Any, ids: Sequence[int] | np.ndarray) -> list[Any]:
    """The samples ``ids``, through ``__getitems__`` when the dataset has it (as torch's
    DataLoader does)."""
    # Python ints, as a Dataset expects: one tolist() for an array, not an int() per sample.
    indices = ids.tolist() if isinstance(ids, np.ndarray) else [int(i) for i in ids]
    getitems = getattr(dataset, "__getitems__", None)
    if getitems is not None:
        return list(getitems(indices))
    return [dataset[i] for i in indices]


def fetch_batch(dataset: Any, ids: Sequence[int] | np.ndarray, collate_fn: Collate) -> Any:
    """``collate_fn(fetch(dataset, ids))``. A dataset may offer ``fetch_collated(ids,
    collate_fn)`` returning that same batch faster (one vectorized read instead of one call per
    sample), or None to decline; :class:`~dtrain.data.shards.ShardedDataset` does for
    fixed-size fields and torch's ``default_collate``."""
    fast = getattr(dataset, "fetch_collated", None)
    if fast is not None:
        batch = fast(np.asarray(ids, dtype=np.int64), collate_fn)
        if batch is not None:
            return batch
    return collate_fn(fetch(dataset, ids))


def map_tensors(batch: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """``batch`` with ``fn`` applied to every tensor in its lists, tuples and dicts."""
    if isinstance(batch, torch.Tensor):
        return fn(batch)
    if isinstance(batch, (list, tuple)):
        return type(batch)(map_tensors(b, fn) for b in batch)
    if isinstance(batch, dict):
        return {k: map_tensors(v, fn) for k, v in batch.items()}
    return batch


def to_device(batch: Any, device: torch.device) -> Any:
    # A tensor already there (CPU training) makes no call into torch's dispatcher.
    return map_tensors(
        batch, lambda t: t if t.device == device else t.to(device, non_blocking=True)
    )


def split_to_device(task: Task, batch: Any, device: torch.device) -> tuple[Any, int]:
    """``task.split_batch(batch)`` on ``device``, and the items it holds (``task.count_items``).
    Counted where the loader left the targets: on a GPU, counting after the copy would make the
    host wait for the device before every batch."""
    inputs, targets = task.split_batch(batch)
    items = task.count_items(targets)
    return to_device((inputs, targets), device), items


class _FetchDataset(torch.utils.data.Dataset[Any]):
    """Lets a DataLoader worker fetch and collate a whole micro-batch in one call, through the
    same :func:`fetch_batch` the in-process path uses, so both give the same batches."""

    def __init__(self, dataset: Any, collate_fn: Collate) -> None:
        self.dataset = dataset
        self.collate_fn = collate_fn

    def __getitems__(self, ids: list[int]) -> list[Any]:
        return [fetch_batch(self.dataset, ids, self.collate_fn)]


def _only(items: list[Any]) -> Any:
    """The DataLoader's collate step: the worker already collated (see _FetchDataset)."""
    return items[0]


@dataclass(eq=False, repr=False, kw_only=True)
class StepCut:
    """What both loaders (:class:`RankLoader`, a stream's
    :class:`~dtrain.data.stream_loader.StreamLoader`) keep alike: how a global batch is cut
    across ranks and micro-steps, the position, and the ranges never delivered."""

    global_batch_size: int
    micro_batches: int
    rank: int
    world_size: int
    collate_fn: Collate
    weights: Sequence[float] | None = None
    # Samples a rank holds per micro-batch at most (0 = data.micro_batches for every rank).
    max_micro_batch: int = 0
    pin_memory: bool = False
    consumed: int = field(default=0, init=False)  # stream position after the last step
    # start -> end of stream ranges never delivered
    skipped: dict[int, int] = field(default_factory=dict, init=False)

    def check_cut(self) -> None:
        # Under a micro-batch cap (load balancing) each rank needs one sample, not one per
        # micro-step: its micro-steps follow its share (partition.step_shape).
        per_rank = self.micro_batches if self.max_micro_batch <= 0 else 1
        if self.world_size * per_rank > self.global_batch_size:
            raise DataError(
                f"a global batch of {self.global_batch_size} samples cannot give "
                f"{self.world_size} ranks x {per_rank} micro-batches one sample each; raise "
                "data.global_batch_size or lower data.micro_batches"
            )
        if self.weights is not None:
            check_weights(self.weights, self.world_size)
            self.weights = list(self.weights)

    def check_same_stream(self, state: dict[str, Any], checks: list[tuple[str, str, Any]]) -> None:
        """Refuse a saved position that counts in another stream: ``checks`` are (key, what it
        is in words, this run's value)."""
        for key, what, mine in checks:
            theirs = state.get(key)
            if theirs != mine:
                raise DataError(
                    f"cannot resume the data position: the checkpoint was made with {what} "
                    f"{theirs!r}, this run has {mine!r}; use the same {what} or start a new run"
                )

    def skip(self, start: int, end: int) -> None:
        """Never deliver stream positions ``start .. end-1`` (a batch that made the loss
        non-finite); kept in the state, so it stays skipped after a resume."""
        self.skipped[start] = end
        self.reset()

    def __iter__(self) -> Self:
        return self

    def pinned(self, batch: Any) -> Any:
        return map_tensors(batch, torch.Tensor.pin_memory) if self.pin_memory else batch

    def set_weights(self, weights: Sequence[float] | None) -> None:
        """New per-rank shares (one positive number per rank; None = equal) from the next step
        on (load balancing). Every rank must set the same weights before the same step. What
        was planned and fetched ahead with the old weights is dropped; the position stays, so
        every sample is still delivered exactly once."""
        new = [float(w) for w in weights] if weights is not None else None
        if new is not None:
            check_weights(new, self.world_size)
        if new != self.weights:  # else keep what was fetched ahead
            self.weights = new
            self.reshared()

    def reset(self) -> None:
        """Drop what was fetched ahead; the next step starts at ``consumed``."""
        raise NotImplementedError

    def warm(self, state: dict[str, Any] | None = None) -> None:
        """The run's position is known: read ahead of it (a stream reads from its first step)."""

    def reshared(self) -> None:
        """New shares: what was fetched ahead for the old ones goes."""
        self.reset()

    def close(self) -> None:
        self.reset()


@dataclass(eq=False, repr=False)
class RankLoader(StepCut):
    """Endless iterator of :class:`StepBatch` for one rank of the data-parallel group."""

    dataset: Any
    _: KW_ONLY
    order: OrderSpec
    lengths: np.ndarray | None = None
    num_workers: int = 0
    prefetch: int = 2
    fingerprint: str = ""
    # Shards in an object store: their pieces read ahead of the plan (None: local data, whose
    # path has nothing added).
    ahead: ReadAhead | None = None
    _source: Iterator[StepBatch] | None = field(default=None, init=False)
    _halt: Callable[[], None] | None = field(default=None, init=False)  # stops the prefetch

    def __post_init__(self) -> None:
        order, world_size = self.order, self.world_size
        if len(self.dataset) != order.num_samples:
            raise ValueError("order spec and dataset disagree on the number of samples")
        if self.lengths is not None and len(self.lengths) != order.num_samples:
            raise DataError(
                f"sample_lengths() gives {len(self.lengths)} lengths for {order.num_samples} "
                "samples"
            )
        self.check_cut()
        if world_size > order.num_samples:
            raise DataError(
                f"the dataset has {order.num_samples} samples, fewer than the "
                f"{world_size} data-parallel ranks; train on fewer ranks or on more data"
            )

    # -- position ------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The position (``consumed``) and what identifies the stream it counts in. Nothing
        per rank: any world size can resume from it."""
        return {
            "consumed": self.consumed,
            "seed": self.order.seed,
            "num_samples": self.order.num_samples,
            "shuffle": self.order.shuffle,
            "shuffle_window": self.order.window,
            "fingerprint": self.fingerprint,
            "skipped": [list(r) for r in sorted(self.skipped.items())],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume at ``state["consumed"]``: O(1), the next plan is computed, not replayed.
        Refuses a position that counts in a different stream, naming what differs."""
        if state.get("kind") == "stream":
            raise DataError(
                "cannot resume the data position: the checkpoint trained on a stream and this "
                "run's train_data is a map-style dataset; use the same data or start a new run"
            )
        checks: list[tuple[str, str, Any]] = [
            ("seed", "run.seed", self.order.seed),
            ("num_samples", "the dataset size", self.order.num_samples),
            ("fingerprint", "the dataset (fingerprint)", self.fingerprint),
            ("shuffle", "data.shuffle", self.order.shuffle),
        ]
        if self.order.shuffle == "locality":
            checks.append(("shuffle_window", "data.shuffle_window", self.order.window))
        self.check_same_stream(state, checks)
        consumed = state.get("consumed")
        if not isinstance(consumed, (int, np.integer)) or consumed < 0:
            raise DataError(f"the checkpoint's data position {consumed!r} is not a count")
        self.consumed = int(consumed)
        self.skipped = {int(a): int(b) for a, b in state.get("skipped", [])}
        self.reset()

    def epoch(self) -> float:
        return self.consumed / self.order.num_samples

    def notice(self) -> str:
        """A start-up line on how the data is read: none for a map-style dataset (docs/data.md
        says it all)."""
        return ""

    # -- planning ------------------------------------------------------------------------

    def _plans(self, start: int) -> Iterator[StepPlan]:
        position = start
        while True:
            while position in self.skipped:
                position = self.skipped[position]
            # A few steps at a time: planning them together costs less per step.
            for plan in plan_steps(
                self.order,
                position,
                max(1, min(PLAN_CHUNK, PLAN_IDS // self.global_batch_size)),
                self.global_batch_size,
                self.world_size,
                self.micro_batches,
                self.weights,
                self.lengths,
                self.max_micro_batch,
            ):
                if plan.start in self.skipped:
                    break  # plan again from the end of the skipped range
                yield plan
                position = plan.end

    # -- iteration -----------------------------------------------------------------------

    def __next__(self) -> StepBatch:
        if self._source is None:
            self._source = self._start(self.consumed)
        batch = next(self._source)
        self.consumed = batch.plan.end
        if self.ahead is not None:
            self.ahead.passed(self.consumed)
        return batch

    def warm(self, state: dict[str, Any] | None = None) -> None:
        """Read the store's pieces ahead of the run's position now (``state``, a checkpoint's,
        loaded first; else the current one): only once it is the run's (a guess's are wrong)."""
        if state is not None:
            self.load_state_dict(state)
        if self.ahead is not None and self.ahead.origin != self._origin():
            self.ahead.start(self._plans(self.consumed), self._origin())

    def _origin(self) -> tuple[Any, ...]:
        """What the plans from ``consumed`` on depend on (besides the stream itself)."""
        weights = None if self.weights is None else tuple(self.weights)
        return (self.consumed, weights, tuple(sorted(self.skipped.items())))

    def reset(self) -> None:
        """Drop what was fetched ahead (a read-ahead from ``consumed``, warm's, goes on)."""
        if self.ahead is not None and self.ahead.origin != self._origin():
            self.ahead.stop()
        if self._halt is not None:
            self._halt()
        self._source = None
        self._halt = None

    def _fetch_step(self, plan: StepPlan) -> StepBatch:
        mine = plan.rank_ids(self.rank)
        micro = [self.pinned(fetch_batch(self.dataset, ids, self.collate_fn)) for ids in mine]
        return StepBatch(plan=plan, micro=micro, rank=self.rank)

    def close(self) -> None:
        if self.ahead is not None:
            self.ahead.stop()
        self.reset()

    def _start(self, start: int) -> Iterator[StepBatch]:
        self.warm()
        if self.num_workers > 0:
            return self._worker_stream(start)
        if self.prefetch == 0:
            return (self._fetch_step(p) for p in self._plans(start))
        return self._thread_stream(start)

    def _thread_stream(self, start: int) -> Iterator[StepBatch]:
        # Two C-level queues (SimpleQueue): fetched steps go one way, free places the other.
        # The producer takes a place before each fetch, so it stays ``prefetch`` steps ahead;
        # a handoff costs less than with queue.Queue, whose Python-level conditions cost
        # tens of microseconds per step when the loop waits on the loader.
        stop = threading.Event()
        ready: queue.SimpleQueue[Any] = queue.SimpleQueue()
        places: queue.SimpleQueue[None] = queue.SimpleQueue()
        for _ in range(self.prefetch):
            places.put(None)

        def halt() -> None:
            stop.set()
            places.put(None)  # wakes the producer if it waits for a place
            # Then waits out the step it may be fetching (bounded by the dataset's own reads):
            # once the loader is reset or closed no thread of it reads, or holds a store's
            # pieces, any more.
            thread.join()

        self._halt = halt

        def produce() -> None:
            try:
                for plan in self._plans(start):
                    places.get()
                    if stop.is_set():
                        return
                    ready.put(self._fetch_step(plan))
            except BaseException as exc:  # handed to the consumer, raised at its next step
                ready.put(exc)

        thread = threading.Thread(
            target=produce, name=f"dtrain-loader-rank{self.rank}", daemon=True
        )
        thread.start()

        def consume() -> Iterator[StepBatch]:
            while True:
                item = ready.get()
                if isinstance(item, BaseException):
                    raise item
                places.put(None)
                yield item

        return consume()

    def _worker_stream(self, start: int) -> Iterator[StepBatch]:
        planned: collections.deque[StepPlan] = collections.deque()

        def micro_ids() -> Iterator[list[int]]:
            # This rank's micro-batches, step after step; each plan is queued for the consumer
            # to pair with its micro-batches without computing it again.
            for plan in self._plans(start):
                planned.append(plan)
                for ids in plan.rank_ids(self.rank):
                    yield ids.tolist()

        loader = DataLoader(
            _FetchDataset(self.dataset, self.collate_fn),
            batch_sampler=micro_ids(),
            num_workers=self.num_workers,
            collate_fn=_only,
            pin_memory=self.pin_memory,
            prefetch_factor=max(1, self.prefetch) * self.micro_batches,
            persistent_workers=False,
        )
        micro_iter = iter(loader)

        def regroup() -> Iterator[StepBatch]:
            # The DataLoader yields micro-batches in micro_ids' order, which queues each plan
            # before its first micro-batch, so the plan is there once the first micro-batch is;
            # it says how many this rank has (per rank under a cap).
            while True:
                micro = [next(micro_iter)]
                plan = planned.popleft()
                micro += [next(micro_iter) for _ in range(len(plan.rank_ids(self.rank)) - 1)]
                yield StepBatch(plan=plan, micro=micro, rank=self.rank)

        return regroup()


def eval_batches(
    dataset: Any,
    rank: int,
    world_size: int,
    batch_size: int,
    collate_fn: Collate,
    max_samples: int = 0,
) -> Iterator[Any]:
    """This rank's evaluation batches: a contiguous, unpadded share of the set, so the metrics
    summed over ranks count every sample exactly once."""
    total = len(dataset) if max_samples <= 0 else min(max_samples, len(dataset))
    mine = eval_shard(total, rank, world_size)
    for begin in range(mine.start, mine.stop, batch_size):
        ids = np.arange(begin, min(begin + batch_size, mine.stop), dtype=np.int64)
        yield fetch_batch(dataset, ids, collate_fn)
