"""The partitioner's pure functions, tested exhaustively without processes: exactly-once
delivery per epoch, the uneven-division rule, resume across world sizes, token balance,
per-rank weights, the locality shuffle and the evaluation split."""

from __future__ import annotations

import math
from collections import OrderedDict

import numpy as np
import pytest

from dtrain.data.partition import (
    OrderSpec,
    StepPlan,
    epoch_order,
    eval_shard,
    partition_tokens,
    plan_step,
    plan_steps,
    split_counts,
    stream_slice,
)
from tests.data_helpers import imbalance, imbalance_bound, partition_samples

SIZES = (97, 100, 101, 117)


def walk(
    spec: OrderSpec,
    start: int,
    steps: int,
    gbs: int,
    world: int,
    micro: int,
    weights: list[float] | None = None,
    lengths: np.ndarray | None = None,
) -> list[StepPlan]:
    """``steps`` consecutive plans from stream position ``start``."""
    plans = []
    position = start
    for _ in range(steps):
        plan = plan_step(spec, position, gbs, world, micro, weights, lengths)
        plans.append(plan)
        position = plan.end
    return plans


def flat(plan: StepPlan) -> list[int]:
    """Every id of the step, rank after rank, micro-batch after micro-batch."""
    return [int(i) for rank in plan.ids for m in rank for i in m]


def assert_contiguous_cut(plan: StepPlan, stream: np.ndarray) -> None:
    """The ``samples`` rule: rank after rank, micro-batch after micro-batch, each part is the
    next slice of the stream (listed in ascending id order)."""
    position = 0
    for rank in plan.ids:
        for micro in rank:
            part = stream[position : position + len(micro)]
            assert micro.tolist() == sorted(part.tolist())
            position += len(micro)
    assert position == len(stream)


def pareto_lengths(n: int, seed: int = 0) -> np.ndarray:
    """Skewed sequence lengths: Pareto(1.5) tail with a 16-token floor, capped at a 2048-token
    context, as documents of a language corpus are."""
    rng = np.random.default_rng(seed)
    return np.minimum(2048, 16 + rng.pareto(1.5, n) * 64).astype(np.int64)


# -- the stream -----------------------------------------------------------------------------


@pytest.mark.parametrize("shuffle", ["full", "locality", "none"])
def test_every_epoch_is_a_permutation(shuffle: str) -> None:
    for n in SIZES:
        spec = OrderSpec(n, seed=3, shuffle=shuffle, shard_sizes=(30, 30, n - 60), window=20)
        orders = [epoch_order(spec, e) for e in range(3)]
        for order in orders:
            assert sorted(order.tolist()) == list(range(n))
        if shuffle != "none":
            assert orders[0].tolist() != orders[1].tolist()  # each epoch is reshuffled
        stream = stream_slice(spec, 0, 3 * n)
        assert stream.tolist() == np.concatenate(orders).tolist()


def test_the_order_depends_only_on_seed_and_epoch() -> None:
    a = OrderSpec(101, seed=7)
    assert epoch_order(a, 2).tolist() == epoch_order(OrderSpec(101, seed=7), 2).tolist()
    assert epoch_order(a, 2).tolist() != epoch_order(OrderSpec(101, seed=8), 2).tolist()


def test_every_epoch_delivers_each_id_exactly_once_across_ranks() -> None:
    checked = 0
    for n in SIZES:
        spec = OrderSpec(n, seed=11)
        for world in (1, 2, 3, 4):
            for micro in (1, 2):
                for gbs in sorted({world * micro, 8, 13, 32, 64, 100}):
                    if gbs < world * micro:
                        continue
                    # Walk whole epochs: lcm(n, gbs) samples is a whole number of both.
                    steps = math.lcm(n, gbs) // gbs
                    plans = walk(spec, 0, steps, gbs, world, micro)
                    delivered = []
                    for plan in plans:
                        assert all(len(m) >= 1 for r in plan.ids for m in r)
                        # Cut in rank order, the parts are consecutive slices of the stream:
                        # nothing dropped, repeated or moved to another step.
                        stream = stream_slice(spec, plan.start, gbs)
                        assert_contiguous_cut(plan, stream)
                        delivered += flat(plan)
                    # Steps follow each other with no gap or overlap in the stream, and every
                    # epoch of the stream is a permutation: each id once per epoch.
                    assert [p.start for p in plans] == list(range(0, steps * gbs, gbs))
                    stream = stream_slice(spec, 0, steps * gbs)
                    epochs = steps * gbs // n
                    for e in range(epochs):
                        assert sorted(stream[e * n : (e + 1) * n].tolist()) == list(range(n))
                    counts = np.bincount(delivered, minlength=n)
                    assert counts.min() == counts.max() == epochs
                    checked += 1
    assert checked > 100


def test_token_balanced_epochs_also_deliver_each_id_exactly_once() -> None:
    for n in SIZES:
        spec = OrderSpec(n, seed=5)
        lengths = pareto_lengths(n, seed=n)
        for world in (1, 2, 3, 4):
            for micro in (1, 2):
                gbs = 24
                steps = math.lcm(n, gbs) // gbs
                plans = walk(spec, 0, steps, gbs, world, micro, lengths=lengths)
                for plan in plans:
                    stream = stream_slice(spec, plan.start, gbs)
                    assert sorted(flat(plan)) == sorted(stream.tolist())
                    assert all(len(m) >= 1 for r in plan.ids for m in r)
                    # Within a micro-batch ids are listed in storage (ascending) order.
                    assert all(np.all(np.diff(m) >= 0) for r in plan.ids for m in r)
                counts = np.bincount([i for p in plans for i in flat(p)], minlength=n)
                assert counts.min() == counts.max() == steps * gbs // n


def test_planning_many_steps_at_once_equals_one_at_a_time() -> None:
    lengths = pareto_lengths(117)
    for n in SIZES:
        spec = OrderSpec(n, seed=6)
        for world, micro, gbs in [(1, 1, 8), (2, 2, 13), (3, 1, 64), (4, 2, 100)]:
            unequal = [1.0, 3.0, 2.0, 1.0][:world]
            for weights, lens in [(None, None), (unequal, None), (None, lengths[:n])]:
                together = plan_steps(spec, 5, 30, gbs, world, micro, weights, lens)
                one_by_one = walk(spec, 5, 30, gbs, world, micro, weights, lens)
                for a, b in zip(together, one_by_one):
                    assert (a.start, a.end) == (b.start, b.end)
                    assert [[m.tolist() for m in r] for r in a.ids] == [
                        [m.tolist() for m in r] for r in b.ids
                    ]


def test_a_rank_reads_its_own_parts_without_sorting_the_others() -> None:
    spec = OrderSpec(1000, seed=3, shard_sizes=(400, 600))
    for world, micro, gbs in [(4, 1, 64), (3, 2, 50)]:
        for rank in range(world):
            together = plan_steps(spec, 17, 20, gbs, world, micro)
            one_by_one = walk(spec, 17, 20, gbs, world, micro, None, None)
            for a, b in zip(together, one_by_one):
                assert [m.tolist() for m in a.rank_ids(rank)] == [m.tolist() for m in b.ids[rank]]
            # The plans share one split, and only this rank's parts were sorted on it.
            assert together[0]._split is not None
            assert set(together[0]._split._sorted) == {rank}


def test_the_shard_layout_is_not_part_of_a_full_shuffle() -> None:
    bare, laid_out = OrderSpec(500, seed=1), OrderSpec(500, seed=1, shard_sizes=(100, 400))
    # One cached permutation serves both: the layout only matters to the locality shuffle.
    assert epoch_order(bare, 2) is epoch_order(laid_out, 2)
    local = OrderSpec(500, seed=1, shuffle="locality", shard_sizes=(100, 400))
    assert not np.array_equal(epoch_order(local, 2), epoch_order(bare, 2))


def test_a_batch_spanning_the_epoch_boundary_is_full() -> None:
    spec = OrderSpec(10, seed=1)
    plan = plan_step(spec, 8, 4, 1, 1)  # samples 8, 9 of epoch 0, then 0, 1 of epoch 1
    expected = [*epoch_order(spec, 0)[8:].tolist(), *epoch_order(spec, 1)[:2].tolist()]
    assert flat(plan) == sorted(expected)
    assert plan.end == 12


# -- split_counts and the uneven-division rule ---------------------------------------------


def test_split_counts_properties() -> None:
    rng = np.random.default_rng(0)
    for _ in range(3000):
        k = int(rng.integers(1, 9))
        minimum = int(rng.integers(0, 4))
        total = int(rng.integers(minimum * k, 300))
        weights = (rng.random(k) * 4 + 0.05).tolist()
        counts = split_counts(total, weights, minimum)
        assert sum(counts) == total
        assert min(counts) >= minimum
        exact = np.asarray(weights) / sum(weights) * total
        if np.all(exact >= minimum):
            # No minimum binds: every part is its exact share rounded down or up.
            assert np.all(np.abs(np.asarray(counts) - exact) < 1)
        # A larger weight never gets fewer samples.
        order = np.argsort(weights)
        assert np.all(np.diff(np.asarray(counts)[order]) >= 0)
    assert split_counts(10, [1, 1, 1, 1]) == [3, 3, 2, 2]  # remainder to the lower ranks
    assert split_counts(10, [3, 1]) == [8, 2]  # the weight's share, 7.5 + 2.5, tie to rank 0
    assert split_counts(10, [100, 1, 1], minimum=3) == [4, 3, 3]  # minimum binds
    assert split_counts(100, [1, 2, 3, 4], minimum=2) == [10, 20, 30, 40]
    with pytest.raises(ValueError, match="at least 2"):
        split_counts(5, [1, 1, 1], minimum=2)
    with pytest.raises(ValueError, match="positive"):
        split_counts(5, [1, 0])


def test_uneven_division_rule_for_samples() -> None:
    # The rule of docs/data.md ('Equal samples'): contiguous slices in rank order, sizes by largest
    # remainder (the first B % world ranks get one more), micro-batches cut the same way.
    ids = np.arange(100, 110)
    parts = partition_samples(ids, world_size=4, micro_batches=2)
    assert [[m.tolist() for m in r] for r in parts] == [
        [[100, 101], [102]],
        [[103, 104], [105]],
        [[106], [107]],
        [[108], [109]],
    ]
    weighted = partition_samples(ids, world_size=2, micro_batches=1, weights=[3, 1])
    assert [r[0].tolist() for r in weighted] == [list(range(100, 108)), [108, 109]]
    with pytest.raises(ValueError, match="cannot give 4 parts at least 2"):
        partition_samples(ids[:7], world_size=4, micro_batches=2)


def test_uneven_division_rule_for_tokens() -> None:
    # Longest first to the least-loaded rank, lower rank on ties; every rank keeps at least
    # one sample per micro-step; ids ascend inside a micro-batch.
    ids = np.array([10, 11, 12, 13, 14])
    lengths = np.array([1, 50, 20, 30, 2])
    parts = partition_tokens(ids, lengths, world_size=2, micro_batches=1)
    # 50 -> r0; 30 -> r1; 20 -> r1 (30 < 50); 2 -> r0 (50 = 50: the lower rank); 1 -> r1.
    assert [r[0].tolist() for r in parts] == [[11, 14], [10, 12, 13]]
    # A very long sample cannot leave a micro-step empty: once the samples left only just
    # cover the minimums (2 per rank), they go to the ranks still short of theirs.
    parts = partition_tokens(ids, np.array([1000, 1, 1, 1, 1]), world_size=2, micro_batches=2)
    assert [[m.tolist() for m in r] for r in parts] == [[[10], [14]], [[11, 13], [12]]]


# -- resume across world sizes -------------------------------------------------------------


@pytest.mark.parametrize("balance", ["samples", "tokens"])
def test_a_position_saved_at_4_ranks_resumes_at_1_2_3_6(balance: str) -> None:
    for n in SIZES:
        spec = OrderSpec(n, seed=2)
        lengths = pareto_lengths(n, seed=1) if balance == "tokens" else None
        for gbs in (12, 25, 36):
            before = walk(spec, 0, 7, gbs, 4, 1, lengths=lengths)
            saved = before[-1].end  # the whole state: one number
            reference = walk(spec, saved, 15, gbs, 4, 1, lengths=lengths)
            for world in (1, 2, 3, 6):
                resumed = walk(spec, saved, 15, gbs, world, 1, lengths=lengths)
                for ref, new in zip(reference, resumed):
                    assert new.start == ref.start
                    # The same global batch, only cut differently across ranks.
                    assert sorted(flat(new)) == sorted(flat(ref))
                    assert sorted(flat(new)) == sorted(stream_ids(spec, new, gbs))
                    assert len(new.ids) == world
                # Prefix + resumed suffix = the uninterrupted stream: none repeated or skipped.
                ids = [i for p in before + resumed for i in sorted(flat(p))]
                expected = [i for p in before + reference for i in sorted(stream_ids(spec, p, gbs))]
                assert ids == expected


def stream_ids(spec: OrderSpec, plan: StepPlan, gbs: int) -> list[int]:
    return stream_slice(spec, plan.start, gbs).tolist()


# -- token balance -------------------------------------------------------------------------


def test_token_balance_on_a_skewed_length_distribution() -> None:
    lengths = pareto_lengths(200_000)
    spec = OrderSpec(len(lengths), seed=0)
    rows = []
    for world in (2, 3, 4, 8):
        for gbs in (64, 128, 256, 512):
            balanced, bounded, naive = [], [], []
            for plan_start in range(0, 200 * gbs, gbs):
                ids = stream_slice(spec, plan_start, gbs)
                parts = partition_tokens(ids, lengths[ids], world, 1)
                value = imbalance(parts, lengths)
                bound = imbalance_bound(lengths[ids], world)
                if bound == 1.0:
                    balanced.append(value)
                else:  # one sequence alone exceeds a rank's fair share of the tokens
                    bounded.append(value / bound)
                naive.append(imbalance(partition_samples(ids, world, 1), lengths))
            rows.append((world, gbs, balanced, bounded, naive))
    print("\nmax/mean tokens per rank, Pareto(1.5) lengths capped at 2048, 200 batches each")
    print("world  batch  max(balanced)  mean  batches-at-bound  max(value/bound)  naive-mean")
    for world, gbs, balanced, bounded, naive in rows:
        print(
            f"{world:5d}  {gbs:5d}  {max(balanced):13.4f}  {np.mean(balanced):.4f}  "
            f"{len(bounded):16d}  {max(bounded, default=1.0):16.4f}  {np.mean(naive):10.4f}"
        )
        # The target of issue 3: at most 1.05 whenever the lengths allow it ...
        assert max(balanced) <= 1.05
        # ... and, when one sequence is longer than a rank's fair share, close to that floor.
        assert max(bounded, default=1.0) <= 1.1
        # Equal sample counts (DistributedSampler's split) are far worse on this data.
        assert np.mean(naive) > np.mean(balanced) + 0.05


def test_token_balance_inside_a_rank_across_micro_batches() -> None:
    lengths = pareto_lengths(10_000, seed=3)
    spec = OrderSpec(len(lengths), seed=0)
    worst = 1.0
    for start in range(0, 100 * 256, 256):
        ids = stream_slice(spec, start, 256)
        parts = partition_tokens(ids, lengths[ids], 2, 4)
        for rank in parts:
            micro_tokens = [int(lengths[m].sum()) for m in rank]
            bound = imbalance_bound(lengths[np.concatenate(rank)], 4)
            if bound == 1.0:
                worst = max(worst, max(micro_tokens) / np.mean(micro_tokens))
    assert worst <= 1.1


# -- per-rank weights ----------------------------------------------------------------------


def test_weights_give_proportional_shares_and_exactly_once() -> None:
    weights = [1.0, 2.0, 3.0, 2.0]
    n = 101
    spec = OrderSpec(n, seed=4)
    plans = walk(spec, 0, math.lcm(n, 80) // 80, 80, 4, 1, weights)
    for plan in plans:
        assert [len(np.concatenate(r)) for r in plan.ids] == [10, 20, 30, 20]
    counts = np.bincount([i for p in plans for i in flat(p)], minlength=n)
    assert counts.min() == counts.max()
    # A batch that does not divide: each share within one sample of its exact value.
    plan = plan_step(spec, 0, 81, 4, 2, weights)
    sizes = np.array([len(np.concatenate(r)) for r in plan.ids])
    assert np.all(np.abs(sizes - np.asarray(weights) / 8 * 81) < 1)
    # Token balance with weights: tokens in proportion (load / weight nearly equal).
    lengths = pareto_lengths(n * 40, seed=9)
    tspec = OrderSpec(len(lengths), seed=4)
    worst = 1.0
    for start in range(0, 50 * 512, 512):
        ids = stream_slice(tspec, start, 512)
        parts = partition_tokens(ids, lengths[ids], 4, 1, weights)
        per_weight = [int(lengths[r[0]].sum()) / w for r, w in zip(parts, weights)]
        worst = max(worst, max(per_weight) / np.mean(per_weight))
        assert sorted(np.concatenate([r[0] for r in parts]).tolist()) == sorted(ids.tolist())
    print(f"\nweighted token shares 1:2:3:2, 512 sequences: max/mean load per weight {worst:.4f}")
    assert worst <= 1.05


# -- locality-aware shuffle ----------------------------------------------------------------


def shard_misses(order: np.ndarray, shard_of: np.ndarray, cache: int) -> int:
    """Shard loads of a reader that keeps the ``cache`` most recently used shards open."""
    lru: OrderedDict[int, None] = OrderedDict()
    misses = 0
    for shard in shard_of[order].tolist():
        if shard in lru:
            lru.move_to_end(shard)
        else:
            misses += 1
            lru[shard] = None
            if len(lru) > cache:
                lru.popitem(last=False)
    return misses


@pytest.mark.parametrize("sizes", [(500,) * 100, (730, 212, 500, 999, 64, 301) * 10])
def test_locality_order_is_a_permutation_and_mostly_sequential(sizes: tuple[int, ...]) -> None:
    n = sum(sizes)
    shard_of = np.repeat(np.arange(len(sizes)), sizes)
    window = 4 * n // len(sizes)  # the default: about four shards
    local = OrderSpec(n, seed=0, shuffle="locality", shard_sizes=sizes, window=window)
    full = OrderSpec(n, seed=0, shuffle="full")
    figures = {}
    # Each shuffle window reads from about window / shard-size + 1 shards ...
    order = epoch_order(local, 1)
    per_window = [
        len(np.unique(shard_of[order[begin : begin + window]])) for begin in range(0, n, window)
    ]
    assert np.mean(per_window) <= window / np.mean(sizes) + 2
    # ... so a reader that keeps that many shards open loads each shard about once per epoch.
    cache = max(per_window) + 1
    for name, spec in (("locality", local), ("full", full)):
        order = epoch_order(spec, 1)
        assert sorted(order.tolist()) == list(range(n))
        same = float(np.mean(shard_of[order[1:]] == shard_of[order[:-1]]))
        figures[name] = (same, shard_misses(order, shard_of, cache))
    print(
        f"\nconsecutive reads in the same shard: locality {figures['locality'][0]:.3f}, "
        f"full {figures['full'][0]:.3f}; shard loads with {cache} open: locality "
        f"{figures['locality'][1]} ({len(sizes)} shards), full {figures['full'][1]}"
    )
    assert figures["locality"][1] <= 2 * len(sizes)
    assert figures["full"][1] > n / 2
    assert figures["locality"][0] > 4 * figures["full"][0]


def test_locality_without_shard_sizes_uses_virtual_shards() -> None:
    spec = OrderSpec(50_000, seed=1, shuffle="locality")
    order = epoch_order(spec, 0)
    assert sorted(order.tolist()) == list(range(50_000))
    virtual = np.arange(50_000) // 4096
    assert shard_misses(order, virtual, cache=6) <= 2 * 13


# -- evaluation ----------------------------------------------------------------------------


def test_eval_shard_counts_every_sample_exactly_once() -> None:
    for n in (*SIZES, 3, 1):
        for world in (1, 2, 3, 4, 5):
            shards = [eval_shard(n, r, world) for r in range(world)]
            ids = [i for s in shards for i in s]
            assert ids == list(range(n))  # contiguous, disjoint, complete, nothing padded
            sizes = [len(s) for s in shards]
            assert max(sizes) - min(sizes) <= 1
