"""The stream loader without processes: the ranks of a job as threads of one process, their
exchange of shard positions a barrier. Every item once per pass over its source shard, at the
same and at another world size, in each way a stream is read (own shards, dealt, unsharded,
Hugging Face), and the mistakes a stream cannot be trained with, each in one line."""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from dtrain.data.build import check_task_data
from dtrain.data.stream_loader import StreamLoader
from dtrain.data.stream_source import stream_source
from dtrain.data.stream_units import UnitMap, UnitState
from dtrain.errors import UserError
from dtrain.task import build_task, resolve_task
from dtrain.train.job import build_job_config
from tests.conftest import tiny_raw
from tests.stream_helpers import (
    LENGTHS,
    ShardStream,
    Unsharded,
    check_units,
    hf_stream,
    item_key,
    split_id,
    write_jsonl_shards,
)

B = 6


class Lockstep:
    """The exchange of ``world`` ranks run as threads: every rank's value, in rank order."""

    def __init__(self, world: int) -> None:
        self.barrier = threading.Barrier(world, timeout=10)
        self.values: list[Any] = [None] * world

    def of_rank(self, rank: int) -> Callable[[Any], list[Any]]:
        def exchange(value: Any) -> list[Any]:
            self.values[rank] = value
            self.barrier.wait()
            out = list(self.values)
            self.barrier.wait()
            return out

        return exchange


def make_loader(
    dataset: Any,
    rank: int = 0,
    world: int = 1,
    exchange: Callable[[Any], list[Any]] | None = None,
    shuffle: str = "none",
    micro_batches: int = 1,
    seed: int = 3,
) -> StreamLoader:
    return StreamLoader(
        stream_source(dataset),
        seed=seed,
        shuffle=shuffle,
        global_batch_size=B,
        micro_batches=micro_batches,
        rank=rank,
        world_size=world,
        collate_fn=list,
        exchange=exchange or Lockstep(1).of_rank(0),
    )


def run(
    dataset: Any,
    lengths: tuple[int, ...],
    world: int,
    steps: int,
    state: dict[str, Any] | None = None,
    shuffle: str = "none",
    micro_batches: int = 1,
) -> tuple[list[list[int]], dict[str, Any]]:
    """``steps`` steps on ``world`` ranks from ``state``: every step's ids (all ranks, rank
    order), checked against the items delivered; and the position after them."""
    lockstep = Lockstep(world)
    loaders = [
        make_loader(dataset, r, world, lockstep.of_rank(r), shuffle, micro_batches)
        for r in range(world)
    ]
    batches: list[list[Any]] = [[] for _ in range(world)]

    def rank_main(r: int) -> None:
        if state is not None:
            loaders[r].load_state_dict(state)
        batches[r] = [next(loaders[r]) for _ in range(steps)]

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    states = [loader.state_dict() for loader in loaders]
    assert all(s == states[0] for s in states), states  # every rank holds the whole position
    out = []
    for step in range(steps):
        ids: list[int] = []
        for r in range(world):
            batch = batches[r][step]
            assert len(batch.micro) == micro_batches
            items = [item for micro in batch.micro for item in micro]
            mine = [int(i) for part in batch.ids for i in part]
            units = UnitMap(len(lengths), 3, shuffle != "none")
            shards = [(units.locate(u)[1], k) for u, k in map(split_id, mine)]
            assert [item_key(item) for item in items] == shards
            assert (batch.plan.start, batch.plan.end) == (
                states[0]["consumed"] - (steps - step) * B,
                states[0]["consumed"] - (steps - step - 1) * B,
            )
            ids += mine
        assert len(ids) == B
        out.append(ids)
    return out, states[0]


def flat(steps: list[list[int]]) -> list[int]:
    return [i for ids in steps for i in ids]


@pytest.mark.parametrize(
    ("kind", "lengths", "before", "after", "shuffle"),
    [
        (ShardStream, LENGTHS, 2, 3, "none"),  # own shards, then own shards
        (ShardStream, LENGTHS, 3, 2, "full"),  # each pass's shard order seeded
        (ShardStream, LENGTHS[:2], 3, 2, "none"),  # dealt (2 shards, 3 ranks), then own
        (Unsharded, LENGTHS, 2, 3, "none"),  # one shard: dealt at any world size
    ],
)
def test_each_item_once_per_pass_across_a_world_size_change(
    kind: Callable[[Any], Any], lengths: tuple[int, ...], before: int, after: int, shuffle: str
) -> None:
    def make() -> Any:
        return kind(lengths)

    shards = (sum(lengths),) if kind is Unsharded else lengths
    first, state = run(make(), shards, before, 7, shuffle=shuffle)
    second, end = run(make(), shards, after, 9, state, shuffle=shuffle)
    assert end["consumed"] == 16 * B
    items = flat(first + second)
    # 96 items of 39 (or 21): every shard read more than once, each pass exactly once.
    assert check_units(items, shards, end, shuffle != "none") == 16 * B
    # The same world size resumes as if never stopped.
    whole, _ = run(make(), shards, before, 16, shuffle=shuffle)
    again, _ = run(make(), shards, before, 9, state, shuffle=shuffle)
    assert first + again == whole


def test_a_hugging_face_stream_across_a_world_size_change(tmp_path: Path) -> None:
    pytest.importorskip("datasets")
    write_jsonl_shards(tmp_path, LENGTHS)
    first, state = run(hf_stream(tmp_path), LENGTHS, 2, 4, micro_batches=2)
    second, end = run(hf_stream(tmp_path), LENGTHS, 3, 6, state, micro_batches=2)
    assert check_units(flat(first + second), LENGTHS, end) == 10 * B


def test_a_skipped_step_is_read_and_dropped() -> None:
    whole, _ = run(ShardStream(LENGTHS), LENGTHS, 1, 6)
    loader = make_loader(ShardStream(LENGTHS))
    loader.skip(2 * B, 3 * B)  # what the NaN guard asks after a rollback
    got = [next(loader) for _ in range(5)]
    assert [b.plan.start for b in got] == [0, B, 3 * B, 4 * B, 5 * B]
    assert [[int(i) for i in b.ids[0]] for b in got] == whole[:2] + whole[3:]
    assert loader.state_dict()["skipped"] == [[2 * B, 3 * B]]


def report(reader: int, short: bool, open: list[list[int]] = [], done: list[int] = []) -> Any:  # noqa: B006
    return {"reader": reader, "open": open, "done": done, "short": short}


def test_the_unit_state_is_plain_data_and_gives_units_in_queue_order() -> None:
    state = UnitState()
    state.deal(2)
    # Two ranks of reader 0 (a pipeline's stages) say the same: it gets one unit.
    assert state.merge([report(0, True), report(0, True), report(1, True)]) == [0, 1]
    assert state.owner == {0: 0, 1: 1} and state.next_unit == 2
    assert state.merge([report(0, False, [[0, 5]]), report(1, True, done=[1])]) == [1]
    assert state.to_plain() == {"next_unit": 3, "open": [[0, 5, 0], [2, 0, 1]], "readers": 2}
    assert UnitState.from_plain(state.to_plain()) == state
    assert state.finished() == 1
    state.deal(3)  # a resume at another world size: the open units dealt again
    assert state.owner == {0: 0, 2: 1} and state.open == {0: 5, 2: 0}


@pytest.mark.parametrize(
    ("task", "data", "message"),
    [
        ({"stream": "oneshot"}, {}, "is a one-pass iterator: dtrain reads a stream again"),
        ({"val_stream": True}, {}, "Task.val_data is a stream: evaluation gives every rank"),
        ({}, {"num_workers": 2}, "data.num_workers = 2: worker processes fetch a map-style"),
        ({}, {"split": "tokens"}, "data.split = 'tokens' needs every sample's length"),
    ],
)
def test_what_a_stream_cannot_do_is_one_line(
    tmp_path: Path, task: dict[str, Any], data: dict[str, Any], message: str
) -> None:
    raw = tiny_raw(tmp_path, run={"task": "tests.stream_helpers:stream_gpt"}, data=data)
    cfg = build_job_config({**raw, "task": {**raw["task"], **task}})
    built = build_task(resolve_task(cfg.run.task), cfg)
    with pytest.raises(UserError) as caught:
        check_task_data(built, cfg)
    assert message in str(caught.value) and "\n" not in str(caught.value)


def test_a_hugging_face_shuffle_buffer_resumes_as_it_was(tmp_path: Path) -> None:
    pytest.importorskip("datasets")
    write_jsonl_shards(tmp_path, LENGTHS)

    def loader() -> StreamLoader:
        return make_loader(hf_stream(tmp_path).shuffle(seed=5, buffer_size=4), shuffle="full")

    def keys(source: StreamLoader, steps: int) -> list[list[tuple[int, int]]]:
        return [[item_key(i) for i in next(source).micro[0]] for _ in range(steps)]

    whole = keys(loader(), 12)
    first = loader()
    head = keys(first, 5)
    resumed = loader()
    resumed.load_state_dict(first.state_dict())
    assert head + keys(resumed, 7) == whole
    # The buffer shuffles within a shard: not the stored order, the same items.
    assert whole[0] != sorted(whole[0]) and len({k for ks in whole[:6] for k in ks}) == 6 * B


def test_the_start_up_line_says_how_the_stream_is_read() -> None:
    own = make_loader(ShardStream(LENGTHS), 0, 3).notice()
    assert own.startswith("data: a stream of 5 source shard(s) (num_shards, read_shard): each ")
    assert "every shard's position is checkpointed" in own and "\n" not in own
    dealt = make_loader(ShardStream(LENGTHS[:2]), 0, 3).notice()
    assert "fewer shards than the 3 ranks: every rank reads every item" in dealt
    plain = make_loader(Unsharded(LENGTHS), shuffle="full").notice()
    assert "an unsharded iterable dataset" in plain
    assert "provided every pass yields the same items in the same order" in plain


def test_a_position_of_other_data_is_refused_in_one_line() -> None:
    _, state = run(ShardStream(LENGTHS), LENGTHS, 1, 2)
    with pytest.raises(UserError, match="the number of source shards 5, this run has 2"):
        make_loader(ShardStream(LENGTHS[:2])).load_state_dict(state)
    with pytest.raises(UserError, match=r"run\.seed 3, this run has 4"):
        make_loader(ShardStream(LENGTHS), seed=4).load_state_dict(state)
    map_style = {"consumed": 12, "seed": 3, "num_samples": 39, "shuffle": "none"}
    with pytest.raises(UserError, match="the checkpoint trained on a map-style dataset"):
        make_loader(ShardStream(LENGTHS)).load_state_dict(map_style)
