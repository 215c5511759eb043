"""What a step costs beside its math, and that cutting it keeps the guarantees.

The step's agreement (global item count, stop flag) rides in the gradient sync: no step makes
a collective of its own for it, whether the task declares ``Task.items_per_sample`` or not, and
both train the same, bit for bit; its packing is exact; a hook that cannot carry it leaves it
to one small all-reduce. A wrong declaration is an error naming the rank; preemption stops
every rank after the same step. Workers bound to their own cores on request
(``dist.pin_cores``). The loop's small exact shortcuts (the item count, the loss scale handed to
backward, no copy to where a tensor already is) give what the long way gives."""

from __future__ import annotations

import json
import os
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

from dtrain.comm.agreement import MAX_CARRYING_RANKS, StepAgreement
from dtrain.compute.precision import Precision
from dtrain.data.loader import split_to_device, to_device
from dtrain.dist.runtime import core_share
from dtrain.parallel.recipe import Recipe
from dtrain.task import IGNORE_INDEX, count_target_items, split_input_target
from dtrain.train.step import LossScale, run_micro_batches
from tests.conftest import tiny_raw
from tests.dist_helpers import make_trainer, params_of, signal_self_at_step, train_params
from tests.ranks import RankFailed, run_ranks

SEQ_LEN = 16  # the tiny GPT's windows: 16 targets each, none of them padding
DECLARED = {"items_per_sample": SEQ_LEN}


def assert_bit_equal(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert np.array_equal(a[key], b[key]), key


def train_counting_collectives(raw: dict[str, Any]) -> dict[str, Any]:
    """Train; the collectives and bytes this rank's strategy counted, and the parameters."""
    trainer = make_trainer(raw)
    before = trainer.strategy.comm.collectives
    summary = trainer.fit()
    return {
        "collectives": trainer.strategy.comm.collectives - before,
        "bytes": summary.comm_bytes,
        "items": summary.items,
        "params": params_of(trainer),
    }


@pytest.mark.parametrize("strategy", ["ddp", "allreduce"])
def test_the_planned_count_trains_bit_identically_to_the_counted_one(
    tmp_path: Path, strategy: str
) -> None:
    # A global batch of 7 on 2 ranks (4 + 3 samples) and 2 micro-batches: the scale differs
    # from rank to rank's own share, and only the exact global count gives the same update.
    job = {
        "strategy": {"name": strategy},
        "data": {"global_batch_size": 7, "micro_batches": 2},
        "train": {"steps": 6, "log_every": 3},
    }
    counted = run_ranks(train_counting_collectives, 2, tiny_raw(tmp_path / "count", job))
    planned = run_ranks(
        train_counting_collectives, 2, tiny_raw(tmp_path / "plan", job, task=DECLARED)
    )
    for rank in (0, 1):
        assert_bit_equal(counted[rank]["params"], planned[rank]["params"])
        assert planned[rank]["items"] == counted[rank]["items"] == 6 * 7 * SEQ_LEN


def collectives_of_runs(raws: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Train each config in turn; the collectives this rank's strategy counted in each, and
    its gradient buckets."""
    out: dict[str, Any] = {}
    for name, raw in raws.items():
        trainer = make_trainer(raw)
        before = trainer.strategy.comm.collectives
        trainer.fit()
        buckets = len(trainer.strategy.buckets)  # type: ignore[attr-defined]
        out[name] = (trainer.strategy.comm.collectives - before, buckets)
    return out


def test_no_step_makes_a_collective_of_its_own_for_its_count_or_stop(tmp_path: Path) -> None:
    # The collectives of 12 steps: a run of 16 against one of 4 that is the same otherwise
    # (set-up, the first step, the final evaluation and save). Nothing but steps in between.
    job = {
        "strategy": {"name": "allreduce"},
        "train": {"log_every": 1000},
        "balance": {"every": 1000, "window_s": 0},
        "eval": {"every": 0},
        "checkpoint": {"every": 0},
    }
    variants: dict[str, dict[str, Any]] = {
        "counted": {},
        "declared": {"task": DECLARED},
        # fp16 buckets cannot hold the packed counts exactly: one small all-reduce a step.
        "fp16": {"comm": {"compression": "fp16"}},
    }
    raws = {
        f"{name}-{steps}": tiny_raw(
            tmp_path / f"{name}-{steps}", job, train={"steps": steps}, **sections
        )
        for name, sections in variants.items()
        for steps in (16, 4)
    }
    out = run_ranks(collectives_of_runs, 2, raws)[0]
    per_12 = {name: out[f"{name}-16"][0] - out[f"{name}-4"][0] for name in variants}
    buckets = out["counted-16"][1]
    assert buckets >= 1
    # One all-reduce per gradient bucket: the agreement rides in the last.
    assert per_12["counted"] == per_12["declared"] == 12 * buckets
    assert per_12["fp16"] == 12 * (buckets + 1)


def test_the_agreement_packs_counts_that_sum_exactly_in_float32() -> None:
    rng = np.random.default_rng(0)
    # Around each change of the packing (12-bit digits and one flags value up to 4,095 ranks;
    # narrower digits from 4,098; two flag values from 4,096) and far beyond.
    for ranks in (2, 7, 4094, 4095, 4096, 4097, 4098, 70_000):
        counts = rng.integers(0, 2**36, ranks)
        counts[: ranks // 2] = 2**36 - 1  # every digit at its largest: the sums at their edge
        stops = rng.random(ranks) < 0.01
        regroups = rng.random(ranks) < 0.01
        packed = [
            StepAgreement(int(c), bool(s), bool(g), world=ranks).pack()
            for c, s, g in zip(counts, stops, regroups)
        ]
        sums = torch.tensor(packed, dtype=torch.float32).sum(dim=0)  # as an all-reduce adds
        agreed = StepAgreement(0, False, world=ranks)
        assert sums.numel() == agreed.width
        agreed.unpack(sums.tolist())
        assert agreed.items == int(counts.sum()), ranks
        assert (agreed.stop, agreed.regroup) == (bool(stops.any()), bool(regroups.any()))
    # Up to the most ranks a float32 sum counts exactly: each digit's sum stays within 2**24.
    for ranks in (4097, 4098, 2**20, MAX_CARRYING_RANKS):
        agreed = StepAgreement(0, False, world=ranks)
        digit_max = (1 << agreed._bits) - 1
        assert ranks * digit_max <= 2**24 and agreed._bits * agreed._digits >= 36
    with pytest.raises(ValueError, match="2\\*\\*36"):
        StepAgreement(2**36, False)


def test_a_wrong_items_per_sample_is_an_error_naming_the_rank(tmp_path: Path) -> None:
    # Padded sequences of different lengths: their batches hold fewer items than declared.
    raw = tiny_raw(tmp_path / "bad", task={"variable": True, "items_per_sample": SEQ_LEN})
    with pytest.raises(RankFailed) as failure:
        run_ranks(train_params, 2, raw)
    text = str(failure.value)
    assert "Task.items_per_sample = 16, but this rank's" in text
    assert "rank " in text and "step 1" in text


def test_sigterm_with_the_planned_count_stops_every_rank_after_the_same_step(
    tmp_path: Path,
) -> None:
    job = {
        "train": {"steps": 16, "log_every": 1},
        "checkpoint": {"every": 4},
        "optim": {"name": "adamw", "lr": 3e-3, "warmup_steps": 2},
    }
    reference = run_ranks(train_params, 2, tiny_raw(tmp_path / "ref", job, task=DECLARED))
    run_dir = tmp_path / "pre"
    # SIGTERM reaches only rank 1, at the start of step 6; step 6's agreement carries it.
    stopped = run_ranks(
        signal_self_at_step, 2, tiny_raw(run_dir, job, task=DECLARED), 1, 6, "SIGTERM"
    )
    assert [s["preempted"] for s in stopped] == ["a peer's signal", "SIGTERM"]
    assert stopped[0]["steps"] == stopped[1]["steps"] == 6
    assert json.loads((run_dir / "status.json").read_text())["state"] == "preempted"
    assert (run_dir / "checkpoints/step-00000006/COMMITTED.json").exists()
    resumed = run_ranks(train_params, 2, tiny_raw(run_dir, job, task=DECLARED))
    assert_bit_equal(reference[0], resumed[0])


def test_core_share_splits_the_cores_evenly_in_local_rank_order(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {8, 9, 10, 11, 12, 13, 14, 15})
    assert [core_share(rank, 4, 1) for rank in range(4)] == [
        {8, 9},
        {10, 11},
        {12, 13},
        {14, 15},
    ]
    assert core_share(0, 3, 2) == {8, 9}  # 8 // 3: two each, the rest left to the OS
    assert core_share(0, 4, 4) is None  # 4 threads would crowd a share of 2 cores
    assert core_share(0, 16, 1) is None  # more workers than cores: nothing to share out


def affinity_after_start(raw: dict[str, Any]) -> list[int]:
    make_trainer(raw)
    return sorted(os.sched_getaffinity(0))


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 cores")
def test_with_pin_cores_each_cpu_worker_is_bound_to_its_own_cores(tmp_path: Path) -> None:
    cores = sorted(os.sched_getaffinity(0))
    bound = run_ranks(affinity_after_start, 2, tiny_raw(tmp_path / "pin", dist={"pin_cores": True}))
    half = len(cores) // 2
    assert bound == [cores[:half], cores[half : 2 * half]]
    free = run_ranks(affinity_after_start, 2, tiny_raw(tmp_path / "free"))  # the default
    assert free == [cores, cores]


@pytest.mark.parametrize(
    "targets",
    [
        torch.tensor([3, 0, 7, 1]),  # no padding: the shortcut
        torch.tensor([3, IGNORE_INDEX, 7, IGNORE_INDEX]),  # padding: counted
        torch.tensor([[2, -1], [IGNORE_INDEX, 5]], dtype=torch.int32),  # other negatives count
        torch.tensor([], dtype=torch.int64),
        torch.tensor([0, 255, 9], dtype=torch.uint8),
        torch.tensor([[0.5, 1.0], [2.0, -3.0]]),  # not class indices: every element
    ],
)
def test_counting_items_agrees_with_counting_every_non_padding_entry(
    targets: torch.Tensor,
) -> None:
    # The shortcut (no negative entry, so no padding) must give what the full count gives.
    if targets.is_floating_point():
        expected = targets.numel()
    else:
        expected = int((targets.long() != IGNORE_INDEX).sum())
    assert count_target_items(targets) == expected


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_backward_from_the_scale_equals_backward_of_the_scaled_loss_bit_for_bit(
    dtype: torch.dtype,
) -> None:
    # run_micro_batches hands the scale to backward() as the loss sum's gradient instead of
    # multiplying the loss by it: the gradients must not change by a bit.
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(12, 24), torch.nn.GELU(), torch.nn.Linear(24, 5))
    model = model.to(dtype)
    micro = [(torch.randn(16, 12, dtype=dtype), torch.randint(0, 5, (16,))) for _ in range(3)]
    scale = torch.tensor(2 / 48, dtype=torch.float32)

    def item_losses(output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(output, targets, reduction="none")

    model.zero_grad(set_to_none=True)
    for inputs, targets in micro:
        (item_losses(model(inputs), targets).sum() * scale).backward()
    expected = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    model.zero_grad(set_to_none=True)
    fake = SimpleNamespace(model=model, recipe=Recipe(Precision("fp32", torch.device("cpu"))))
    loss_sum = run_micro_batches(fake, micro, item_losses, scale)  # type: ignore[arg-type]
    got = [p.grad for p in model.parameters() if p.grad is not None]
    assert len(got) == len(expected) == 4
    assert all(torch.equal(a, b) for a, b in zip(got, expected))
    assert loss_sum.dtype == dtype


def test_to_device_hands_back_a_tensor_already_on_the_device() -> None:
    inputs, targets = torch.zeros(2, 3), torch.ones(2, dtype=torch.long)
    moved = to_device((inputs, targets), torch.device("cpu"))
    assert isinstance(moved, tuple)
    assert moved[0] is inputs and moved[1] is targets


def test_the_loss_scale_is_kept_while_its_value_stays() -> None:
    scale = LossScale(torch.device("cpu"))
    first = scale(2 / 7)
    assert scale(2 / 7) is first  # the same tensor again: no new one a step
    assert first.dtype == torch.float32 and float(first) == float(torch.tensor(2 / 7))
    other = scale(2 / 9)
    assert other is not first and float(other) == float(torch.tensor(2 / 9))
    assert float(first) == float(torch.tensor(2 / 7))  # the one handed out is not changed


def test_split_to_device_counts_the_targets_it_moves() -> None:
    task = SimpleNamespace(split_batch=split_input_target, count_items=count_target_items)
    batch = (torch.zeros(3, 2), torch.tensor([1, IGNORE_INDEX, 4]))
    (inputs, targets), items = split_to_device(task, batch, torch.device("cpu"))  # type: ignore[arg-type]
    assert items == 2
    assert inputs is batch[0] and targets is batch[1]
