"""Pure functions from the data position to each rank's sample ids.

The data position is one number, ``consumed``, into one seeded global order; how a step's
global batch is cut across ranks and micro-steps is a pure function of ``(ids, world size,
micro-batches, weights, lengths)``. Nothing is stored per rank, so the position survives any
change of the world size or of the per-rank shares. The rules (equal samples, equal tokens,
weights, the micro-batch cap, ascending ids inside a micro-batch): docs/data.md, "How the
stream is cut".

:func:`plan_steps` sorts a rank's parts only when that rank's ids are asked for
(:meth:`StepPlan.rank_ids`): a loader pays for its own rank, not the world's.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass, replace
from functools import lru_cache

import numpy as np

from dtrain.errors import ConfigError

ShuffleKind = str  # "full" | "locality" | "none"


@dataclass(frozen=True)
class OrderSpec:
    """Everything the global order depends on."""

    num_samples: int
    seed: int
    shuffle: ShuffleKind = "full"
    # Locality shuffle: the sizes of the storage shards, in id order, and the window (samples)
    # within which samples are shuffled after the shard order is.
    shard_sizes: tuple[int, ...] = ()
    window: int = 0


def epoch_order(spec: OrderSpec, epoch: int) -> np.ndarray:
    """The permutation of ``range(num_samples)`` that epoch ``epoch`` visits."""
    if spec.shuffle != "locality" and (spec.shard_sizes or spec.window):
        # Only the locality shuffle reads the shard layout: leave it out of the cache key, so
        # specs that differ only there share one cached permutation.
        spec = replace(spec, shard_sizes=(), window=0)
    return _epoch_order_cached(spec, epoch)


@lru_cache(maxsize=4)
def _epoch_order_cached(spec: OrderSpec, epoch: int) -> np.ndarray:
    n = spec.num_samples
    dtype = np.int32 if n < 2**31 else np.int64
    if spec.shuffle == "none":
        order = np.arange(n, dtype=dtype)
    elif spec.shuffle == "full":
        rng = np.random.default_rng([spec.seed, epoch, 0x5EED])
        order = rng.permutation(n).astype(dtype, copy=False)
    elif spec.shuffle == "locality":
        order = _locality_order(spec, epoch, dtype)
    else:
        raise ConfigError(f"data.shuffle = {spec.shuffle!r}: expected full, locality or none")
    order.setflags(write=False)
    return order


def _locality_order(spec: OrderSpec, epoch: int, dtype: type) -> np.ndarray:
    """Shuffle the shard order, then shuffle inside consecutive windows of that sequence, so a
    rank reads a few shards at a time, mostly forward, and the page cache stays useful."""
    rng = np.random.default_rng([spec.seed, epoch, 0x10CA1])
    sizes = np.asarray(spec.shard_sizes or _virtual_shards(spec.num_samples), dtype=np.int64)
    if sizes.sum() != spec.num_samples:
        raise ValueError("shard sizes do not add up to the number of samples")
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    shard_perm = rng.permutation(len(sizes))
    order = (
        np.concatenate(
            [np.arange(starts[s], starts[s] + sizes[s], dtype=dtype) for s in shard_perm]
        )
        if len(sizes)
        else np.zeros(0, dtype=dtype)
    )
    window = spec.window or int(4 * max(1, round(float(sizes.mean()))))
    for begin in range(0, len(order), window):
        block = order[begin : begin + window]
        rng.shuffle(block)  # in place on the view
    return order


def _virtual_shards(num_samples: int, size: int = 4096) -> list[int]:
    full, rest = divmod(num_samples, size)
    return [size] * full + ([rest] if rest else [])


def stream_slice(spec: OrderSpec, start: int, count: int) -> np.ndarray:
    """Ids ``start .. start+count-1`` of the endless stream (epochs back to back)."""
    return _stream_block(spec, start, count).astype(np.int64)  # a copy: the order is cached


def _stream_block(spec: OrderSpec, start: int, count: int) -> np.ndarray:
    """:func:`stream_slice` in the epoch order's own dtype (int32 below 2**31 samples)."""
    n = spec.num_samples
    parts = []
    pos = start
    end = start + count
    while pos < end:
        epoch, offset = divmod(pos, n)
        take = min(n - offset, end - pos)
        parts.append(epoch_order(spec, epoch)[offset : offset + take])
        pos += take
    if not parts:
        return np.zeros(0, dtype=np.int64)
    return parts[0] if len(parts) == 1 else np.concatenate(parts)


def split_counts(total: int, weights: Sequence[float], minimum: int = 0) -> list[int]:
    """``total`` split in proportion to ``weights`` by largest remainder, each part at least
    ``minimum``. A part whose exact share falls below ``minimum`` is fixed at it and the rest is
    split among the others in proportion to their weights. Deterministic: ties go to the lower
    index."""
    k = len(weights)
    if k == 0:
        raise ValueError("no parts to split into")
    if minimum * k > total:
        raise ValueError(f"cannot give {k} parts at least {minimum} of {total}")
    w = np.asarray(weights, dtype=np.float64)
    if np.any(w <= 0) or not np.all(np.isfinite(w)):
        raise ValueError(f"weights must be positive and finite, got {list(weights)}")
    pinned = np.zeros(k, dtype=bool)  # parts held at the minimum
    while True:
        free = ~pinned
        spare = total - minimum * int(pinned.sum())
        exact = np.where(free, w / w[free].sum() * spare, 0.0)
        low = free & (exact < minimum)
        if not low.any():
            break
        pinned |= low  # each round pins at least one part, so this ends within k rounds
    counts = np.where(free, np.floor(exact), minimum).astype(np.int64)
    short = total - int(counts.sum())
    remainder = np.where(free, exact - np.floor(exact), -1.0)
    # Largest remainder first; the stable sort keeps the lower index first on ties.
    for idx in np.argsort(-remainder, kind="stable")[:short]:
        counts[idx] += 1
    return [int(c) for c in counts]


def equal_weights(world_size: int) -> list[float]:
    return [1.0] * world_size


def check_weights(weights: Sequence[float], world_size: int) -> None:
    """Raise ``ValueError`` naming what is wrong with per-rank ``weights``: one positive,
    finite number per rank."""
    values = list(weights)
    if len(values) != world_size:
        raise ValueError(
            f"{len(values)} per-rank weights {values} for a world of {world_size} ranks: give "
            "one weight per data-parallel rank"
        )
    for rank, weight in enumerate(values):
        if isinstance(weight, bool) or not isinstance(weight, (int, float, np.number)):
            raise ValueError(f"per-rank weights {values}: rank {rank}'s {weight!r} is no number")
        if not (np.isfinite(weight) and weight > 0):
            raise ValueError(
                f"per-rank weights {values}: rank {rank}'s weight {weight} is not positive and "
                "finite; every rank needs a positive share"
            )


def step_shape(
    total: int,
    world_size: int,
    micro_batches: int,
    weights: Sequence[float] | None = None,
    micro_cap: int = 0,
) -> list[list[int]]:
    """The sizes of every rank's micro-batches in a global batch of ``total`` samples split by
    count (the ``samples`` rule): ``result[rank][micro]``.

    ``micro_cap == 0``: every rank runs ``micro_batches`` micro-steps and holds at least that
    many samples. ``micro_cap > 0`` (load balancing): every rank holds at least one sample and
    runs ``ceil(share / micro_cap)`` micro-steps, so that no micro-batch exceeds the cap."""
    minimum = micro_batches if micro_cap <= 0 else 1
    if weights is None:
        # Equal shares, the common case; computed directly, as this runs on every step.
        per_rank = _equal_counts(total, world_size, minimum)
    else:
        check_weights(weights, world_size)
        per_rank = split_counts(total, weights, minimum=minimum)
    return [_equal_counts(n, _micro_steps(n, micro_batches, micro_cap), 1) for n in per_rank]


def _micro_steps(samples: int, micro_batches: int, micro_cap: int) -> int:
    """Micro-steps of a rank holding ``samples``: ``micro_batches``, or under a cap as few as
    keep every micro-batch within it."""
    return micro_batches if micro_cap <= 0 else max(1, -(-samples // micro_cap))


def _part_bounds(shape: list[list[int]]) -> list[list[tuple[int, int]]]:
    """Where each (rank, micro-batch) part lies in the global batch, ``[rank][micro] ->
    (first, last + 1)``: ranks in order, each rank's micro-batches of the sizes ``shape``
    gives (:func:`step_shape`) one after the other."""
    bounds: list[list[tuple[int, int]]] = []
    begin = 0
    for sizes in shape:
        rank = []
        for size in sizes:
            rank.append((begin, begin + size))
            begin += size
        bounds.append(rank)
    return bounds


def _equal_counts(total: int, parts: int, minimum: int) -> list[int]:
    """``split_counts`` with equal weights: the first ``total % parts`` get one more."""
    if minimum * parts > total:
        raise ValueError(f"cannot give {parts} parts at least {minimum} of {total}")
    base, extra = divmod(total, parts)
    return [base + 1] * extra + [base] * (parts - extra)


def partition_tokens(
    ids: np.ndarray,
    lengths: np.ndarray,
    world_size: int,
    micro_batches: int,
    weights: Sequence[float] | None = None,
    micro_cap: int = 0,
) -> list[list[np.ndarray]]:
    """Token-balanced split: every rank (and micro-batch) gets close to its share of tokens.

    ``lengths[i]`` is the token count of ``ids[i]``. Greedy longest-processing-time: samples,
    longest first, go to the part with the lowest load relative to its weight, each part keeping
    at least one sample per micro-step: once the samples left are just enough for those
    minimums, they go only to parts still short of theirs. With ``micro_cap`` a rank's
    micro-steps follow its sample count, as in :func:`step_shape`.
    """
    weights = list(weights) if weights is not None else equal_weights(world_size)
    check_weights(weights, world_size)
    minimum = micro_batches if micro_cap <= 0 else 1
    if len(ids) < world_size * minimum:
        raise ValueError(
            f"{len(ids)} samples cannot give {world_size} ranks x {minimum} micro-batches one each"
        )
    lengths = np.asarray(lengths, dtype=np.int64)
    rank_positions = _lpt_assign(lengths, weights, minimum)
    out: list[list[np.ndarray]] = []
    for positions in rank_positions:
        steps = _micro_steps(len(positions), micro_batches, micro_cap)
        micro_positions = _lpt_assign(lengths[positions], equal_weights(steps), 1)
        out.append([np.sort(ids[positions[mp]]) for mp in micro_positions])
    return out


def _lpt_assign(lengths: np.ndarray, weights: Sequence[float], minimum: int) -> list[np.ndarray]:
    """Positions ``0..len(lengths)-1`` assigned to ``len(weights)`` parts, each part's positions
    in ascending order."""
    k = len(weights)
    order = np.argsort(-lengths, kind="stable").tolist()
    sizes = lengths.tolist()
    w = [float(x) for x in weights]
    load = [0] * k
    need = [minimum] * k
    owed = minimum * k  # samples still owed to parts below their minimum
    # A heap of (load / weight, part): the lowest relative load first, the lower part on ties.
    heap = [(0.0, part) for part in range(k)]
    assigned: list[list[int]] = [[] for _ in range(k)]
    for left, pos in zip(range(len(order), 0, -1), order):
        if left > owed:
            _, part = heapq.heappop(heap)
        else:
            # Only as many samples left as the minimums still need: the least-loaded part that
            # is short gets this one.
            part = min((p for p in range(k) if need[p] > 0), key=lambda p: (load[p] / w[p], p))
            heap.remove((load[part] / w[part], part))
            heapq.heapify(heap)
        assigned[part].append(pos)
        load[part] += sizes[pos]
        if need[part] > 0:
            need[part] -= 1
            owed -= 1
        heapq.heappush(heap, (load[part] / w[part], part))
    return [np.sort(np.asarray(a, dtype=np.int64)) for a in assigned]


class StepPlan:
    """One optimizer step's share of the stream for every rank: ``ids[rank][micro]``.

    Plans made together by :func:`plan_steps` share one :class:`_CountSplit` and sort a
    rank's parts only when they are asked for: a rank's loader reads its own parts
    (:meth:`rank_ids`), so the other ranks' parts are never sorted on it."""

    __slots__ = ("_ids", "_row", "_split", "end", "start")

    def __init__(
        self,
        start: int,
        end: int,
        ids: list[list[np.ndarray]] | None = None,
        split: _CountSplit | None = None,
        row: int = 0,
    ) -> None:
        self.start = start  # stream position before the step
        self.end = end  # stream position after the step (start + the global batch size)
        self._ids = ids  # given (the token split), or read from the shared split
        self._split = split
        self._row = row

    @property
    def ids(self) -> list[list[np.ndarray]]:
        """[rank][micro-batch] -> sample ids, ascending within each micro-batch."""
        if self._ids is None:
            assert self._split is not None
            self._ids = [self.rank_ids(r) for r in range(len(self._split.columns))]
        return self._ids

    def rank_ids(self, rank: int) -> list[np.ndarray]:
        """Rank ``rank``'s micro-batches: ``ids[rank]``, without sorting any other rank's."""
        if self._ids is not None:
            return self._ids[rank]
        assert self._split is not None
        return [micro[self._row] for micro in self._split.sorted_parts(rank)]

    def __repr__(self) -> str:
        return f"StepPlan(start={self.start}, end={self.end})"


class _CountSplit:
    """The count split (equal or weighted) of consecutive global batches (rows of ``block``),
    each rank's parts sorted on first use, for all the steps at once."""

    def __init__(self, block: np.ndarray, columns: list[list[tuple[int, int]]]) -> None:
        self.block = block  # (steps, global batch size), the epoch order's own dtype
        self.columns = columns  # [rank][micro] -> (first, last + 1) column of the part
        self._sorted: dict[int, list[np.ndarray]] = {}

    def sorted_parts(self, rank: int) -> list[np.ndarray]:
        parts = self._sorted.get(rank)
        if parts is None:
            # Sorted in the order's dtype (int32 below 2**31 samples sorts about twice as fast
            # as int64), then widened once: ids are int64 everywhere else.
            parts = [
                np.sort(self.block[:, a:b], axis=1).astype(np.int64, copy=False)
                for a, b in self.columns[rank]
            ]
            self._sorted[rank] = parts
        return parts


def plan_step(
    spec: OrderSpec,
    consumed: int,
    global_batch_size: int,
    world_size: int,
    micro_batches: int,
    weights: Sequence[float] | None = None,
    lengths: np.ndarray | None = None,
    micro_cap: int = 0,
) -> StepPlan:
    """The step that starts at stream position ``consumed``. With ``lengths`` (the token count
    of every sample id) the split is token-balanced, else equal-count (in proportion to
    ``weights`` when given). ``micro_cap``: see :func:`step_shape`."""
    cut = (global_batch_size, world_size, micro_batches, weights, lengths, micro_cap)
    return plan_steps(spec, consumed, 1, *cut)[0]


def plan_steps(
    spec: OrderSpec,
    consumed: int,
    steps: int,
    global_batch_size: int,
    world_size: int,
    micro_batches: int,
    weights: Sequence[float] | None = None,
    lengths: np.ndarray | None = None,
    micro_cap: int = 0,
) -> list[StepPlan]:
    """``steps`` consecutive plans from stream position ``consumed``, each as
    :func:`plan_step` gives it. The count split (equal or weighted) slices and sorts once per
    rank and micro-batch for all the steps instead of once per step."""
    starts = [consumed + step * global_batch_size for step in range(steps)]
    if lengths is not None:
        plans = []
        for start in starts:
            ids = stream_slice(spec, start, global_batch_size)
            parts = partition_tokens(
                ids, lengths[ids], world_size, micro_batches, weights, micro_cap
            )
            plans.append(StepPlan(start, start + global_batch_size, ids=parts))
        return plans
    block = _stream_block(spec, consumed, steps * global_batch_size)
    # The columns of every (rank, micro-batch) part, the same in every step: the count split
    # depends on the batch size, the weights and the cap only.
    shape = step_shape(global_batch_size, world_size, micro_batches, weights, micro_cap)
    split = _CountSplit(block.reshape(steps, global_batch_size), _part_bounds(shape))
    return [
        StepPlan(start, start + global_batch_size, split=split, row=row)
        for row, start in enumerate(starts)
    ]


def eval_shard(num_samples: int, rank: int, world_size: int) -> range:
    """The contiguous range of evaluation samples rank ``rank`` owns: sizes differ by at most
    one, every sample belongs to exactly one rank, and no sample is padded in or repeated."""
    base, extra = divmod(num_samples, world_size)
    start = rank * base + min(rank, extra)
    return range(start, start + base + (1 if rank < extra else 0))
