"""``localsgd`` and ``diloco`` on 2 real ranks: H = 1 is data parallelism, replicas meet every H
steps and only then, a resume mid-interval is bit-identical, and the bytes follow the formula.

Every 2-rank training runs inside one ``run_ranks`` call (the ``pair`` fixture), one after the
other in the same two processes, so the module costs one process start-up."""

from __future__ import annotations

import contextlib
import io
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from dtrain.balance.timing import FIELDS as TIMING_FIELDS
from dtrain.checkpoint.forms import Form
from dtrain.checkpoint.layout import OUTER_FILE, part_file
from dtrain.comm.accounting import all_gather_bytes, all_reduce_bytes
from dtrain.config import BalanceConfig
from dtrain.parallel.local_sgd import DiLoCoStrategy, LocalSGDStrategy
from tests.conftest import tiny_raw
from tests.dist_helpers import crash_then_resume, losses_by_step, make_trainer, train_with_nan
from tests.ranks import run_ranks

STEPS, H = 20, 8
SYNC_STEPS = [8, 16, 20]  # every H steps, and the last step: the run ends on one model
# Plain SGD and no clipping for the comparisons with ddp: SGD's update is linear in the
# gradient (so the average of replicas after one step is data parallelism's step), and
# clipping is by the replica's own norm here, by the global one in ddp.
LINEAR = {"optim": {"name": "sgd", "lr": 0.5}, "train": {"steps": 10, "grad_clip": 0.0}}
# AdamW (per-rank optimizer state to restore), a checkpoint every 5 steps (step 10 is 2 steps
# into the second interval), all kept; every step logged.
INTERVALS = {
    "train": {"steps": STEPS, "log_every": 1},
    "optim": {"name": "adamw", "lr": 3e-3, "warmup_steps": 2},
    "checkpoint": {"every": 5, "keep_last": 10},
    "comm": {"sync_every": H},
    # Timing windows of exactly balance.every steps, for the byte count below.
    "balance": {"window_s": 0},
}

# comm.local_start_step: data parallelism first, local steps after. With AdamW for the whole
# run (10 steps) against ddp; then 4 warm-up steps (replicas meet at 4 + 8 = 12 and at the last
# step) and 12 (a crash at 12 resumes from step 10, inside the warm-up).
ADAMW = {"optim": {"name": "adamw", "lr": 3e-3, "warmup_steps": 2}, "train": {"steps": 10}}
WARM4_SYNC_STEPS = [12, 20]


def warm(start: int) -> dict[str, Any]:
    return {**INTERVALS, "comm": {"sync_every": H, "local_start_step": start}}


def flat(tensors: list[torch.Tensor]) -> np.ndarray:
    return torch.cat([t.detach().reshape(-1) for t in tensors]).numpy().copy()


def train_recorded(raw: dict[str, Any]) -> dict[str, Any]:
    """Train; record after every step's hook the replica (and diloco's anchor), the bytes the
    hook and the clipping sent, and the run's total bytes."""
    trainer = make_trainer(raw)
    strategy = trainer.strategy
    assert isinstance(strategy, LocalSGDStrategy)
    out: dict[str, Any] = {"params": [], "anchor": [], "sync_bytes": [], "clip_bytes": []}
    hook, clip = strategy.after_optimizer_step, strategy.clip_grad_norm

    def recorded_hook(step: int) -> None:
        before = strategy.comm.bytes_sent
        hook(step)
        out["sync_bytes"].append(strategy.comm.bytes_sent - before)
        out["params"].append(flat(strategy.params))
        if isinstance(strategy, DiLoCoStrategy):
            out["anchor"].append(flat(strategy.anchor))

    def recorded_clip(max_norm: float) -> torch.Tensor:
        before = strategy.comm.bytes_sent
        norm = clip(max_norm)
        out["clip_bytes"].append(strategy.comm.bytes_sent - before)
        return norm

    synchronize = strategy.synchronize
    out["syncs"] = 0

    def counted_sync() -> None:  # the replicas' meetings since set-up
        synchronize()
        out["syncs"] += 1

    strategy.after_optimizer_step = recorded_hook  # type: ignore[method-assign]
    strategy.clip_grad_norm = recorded_clip  # type: ignore[method-assign]
    strategy.synchronize = counted_sync  # type: ignore[method-assign]
    trainer.fit()
    out["total_bytes"] = strategy.comm.bytes_sent
    out["param_bytes"] = strategy.parameter_bytes()
    out["param_tensors"] = len(strategy.params)
    out["final"] = params_of(trainer)
    return out


def params_of(trainer: Any) -> dict[str, np.ndarray]:
    return {k: v.detach().numpy().copy() for k, v in trainer.strategy.model_state_dict().items()}


def train_final(raw: dict[str, Any]) -> dict[str, np.ndarray]:
    trainer = make_trainer(raw)
    trainer.fit()
    return params_of(trainer)


def run_suite(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Each run in turn on this rank."""
    kinds = {
        "init": lambda raw: params_of(make_trainer(raw)),
        "final": train_final,
        "recorded": train_recorded,
        "crash": lambda raw: crash_then_resume(raw, 12),  # resumes from step 10
        "nan": lambda raw: train_with_nan(raw, [40], 1),  # step 6's batch, on rank 1 only
        # Steps 11-13 bad on rank 0: a rollback to step 10, mid-interval.
        "nan3": lambda raw: train_with_nan(raw, [80, 88, 96], 0),
    }
    return {run["name"]: kinds[run["kind"]](run["raw"]) for run in runs}


def resume_only(raw: dict[str, Any]) -> dict[str, Any]:
    """Load the checkpoint ``run.resume`` names without training: what each rank starts from,
    and what rank 0 printed."""
    printed = io.StringIO()
    with contextlib.redirect_stderr(printed):
        trainer = make_trainer(raw)
        trainer.resume()
    out: dict[str, Any] = {"params": params_of(trainer), "step": trainer.step}
    out["printed"] = printed.getvalue()
    state = trainer.optimizer.state_dict()["state"]
    out["exp_avg"] = {i: s["exp_avg"].numpy().copy() for i, s in state.items()}
    if isinstance(trainer.strategy, DiLoCoStrategy):
        anchor = zip(trainer.strategy.anchor_names, trainer.strategy.anchor)
        out["anchor"] = {name: tensor.numpy().copy() for name, tensor in anchor}
    return out


def runs(tmp: Path) -> list[dict[str, Any]]:
    def run(name: str, kind: str, strategy: str, job: Any, **sections: Any) -> dict[str, Any]:
        sections["strategy"] = {"name": strategy}
        return {"name": name, "kind": kind, "raw": tiny_raw(tmp / name, job, **sections)}

    h1 = {"sync_every": 1, "outer_lr": 1.0, "outer_momentum": 0.0}
    return [
        run("init", "init", "ddp", LINEAR),
        run("ddp", "final", "ddp", LINEAR),
        run("localsgd_h1", "final", "localsgd", LINEAR, comm=h1),
        run("diloco_h1", "final", "diloco", LINEAR, comm=h1),
        run("localsgd", "recorded", "localsgd", INTERVALS),
        run("diloco", "recorded", "diloco", INTERVALS),
        run("localsgd_crash", "crash", "localsgd", INTERVALS),
        run("diloco_crash", "crash", "diloco", INTERVALS),
        run("localsgd_nan", "nan", "localsgd", INTERVALS),
        run("diloco_rollback", "nan3", "diloco", INTERVALS, fault={"nan_rollback_after": 3}),
        run("ddp_adamw", "final", "ddp", ADAMW),
        run("localsgd_all_dp", "final", "localsgd", ADAMW, comm={"local_start_step": 10}),
        run("diloco_all_dp", "final", "diloco", ADAMW, comm={"local_start_step": 10}),
        run("localsgd_w4", "recorded", "localsgd", warm(4)),
        run("diloco_w4", "recorded", "diloco", warm(4)),
        run("localsgd_w4_crash", "crash", "localsgd", warm(4)),
        run("diloco_w4_crash", "crash", "diloco", warm(4)),
        run("localsgd_w12", "final", "localsgd", warm(12)),
        run("diloco_w12", "final", "diloco", warm(12)),
        run("localsgd_w12_crash", "crash", "localsgd", warm(12)),
        run("diloco_w12_crash", "crash", "diloco", warm(12)),
    ]


@pytest.fixture(scope="module")
def tmp(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("local_sgd")


@pytest.fixture(scope="module")
def pair(tmp: Path) -> list[dict[str, Any]]:
    return run_ranks(run_suite, 2, runs(tmp), timeout=240)


def max_diff(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> float:
    assert a.keys() == b.keys()
    return max(float(np.abs(a[k] - b[k]).max()) for k in a)


# -- H = 1 is data parallelism -----------------------------------------------------------------


@pytest.mark.parametrize("strategy", ["localsgd_h1", "diloco_h1"])
def test_one_step_intervals_equal_data_parallel(pair: list[Any], strategy: str) -> None:
    # localsgd, H = 1: each replica takes an SGD step from the same parameters with its own
    # gradient, and the average of those steps is the step with the averaged gradient (SGD,
    # its momentum and weight decay are linear in the gradient; momentum buffers, kept per
    # rank, average to ddp's buffer). diloco, H = 1, outer lr 1, no momentum: the outer step
    # sets the anchor to anchor - mean(anchor - replica) = the replicas' average: the same.
    # 10 steps of 2 ranks against ddp; only the rounding of the sums differs.
    ddp = pair[0]["ddp"]
    for rank in (0, 1):
        assert max_diff(pair[rank][strategy], ddp) < 1e-6
    assert max_diff(pair[0][strategy], pair[1][strategy]) == 0.0
    # ... and the parameters did move (the comparison is not between two starting points).
    assert max_diff(ddp, pair[0]["init"]) > 1e-2


# -- replicas meet every H steps, and only then -------------------------------------------------


@pytest.mark.parametrize("strategy", ["localsgd", "diloco"])
def test_replicas_agree_right_after_each_sync_and_differ_in_between(
    pair: list[Any], strategy: str
) -> None:
    a, b = pair[0][strategy]["params"], pair[1][strategy]["params"]
    assert len(a) == len(b) == STEPS
    for step in range(1, STEPS + 1):
        same = np.array_equal(a[step - 1], b[step - 1])
        # Each rank trains on its own share between syncs: a strategy that synchronized
        # every step (or never) fails one of these.
        assert same == (step in SYNC_STEPS), f"step {step}: replicas equal = {same}"
    assert pair[0][strategy]["syncs"] == len(SYNC_STEPS)


def test_diloco_replicas_restart_from_the_anchor(pair: list[Any]) -> None:
    run = pair[0]["diloco"]
    for step in range(1, STEPS + 1):
        at_anchor = np.array_equal(run["params"][step - 1], run["anchor"][step - 1])
        assert at_anchor == (step in SYNC_STEPS), step
    # The anchor moves at syncs only, and the same on both ranks.
    anchors = np.stack(run["anchor"])
    moved = [s for s in range(2, STEPS + 1) if not np.array_equal(anchors[s - 1], anchors[s - 2])]
    assert moved == SYNC_STEPS
    assert np.array_equal(anchors, np.stack(pair[1]["diloco"]["anchor"]))


# -- bytes ---------------------------------------------------------------------------------


@pytest.mark.parametrize("strategy", ["localsgd", "diloco"])
def test_bytes_follow_the_formula(pair: list[Any], strategy: str) -> None:
    run = pair[0][strategy]
    params = run["param_bytes"]  # the tiny GPT has no floating-point buffers
    # One all-reduce of every parameter per sync, nothing on the other steps ...
    sync = all_reduce_bytes(params, 2)
    assert run["sync_bytes"] == [sync if s in SYNC_STEPS else 0 for s in range(1, STEPS + 1)]
    # ... and one 4-byte all-reduce per step for the NaN guard's agreement.
    assert run["clip_bytes"] == [all_reduce_bytes(4, 2)] * STEPS
    # The run's total: the set-up broadcast of the parameters, the syncs, the norm
    # agreement, and the trainer's own collectives: the item count (2 float64) every step,
    # the loss (1 float64) at every metrics line, the final evaluation (2 float64), and the
    # per-rank timing window (one float64 per field, all-gathered every balance.every steps).
    timing = (STEPS // BalanceConfig().every) * all_gather_bytes(8 * len(TIMING_FIELDS), 2)
    trainer_own = STEPS * all_reduce_bytes(16, 2) + STEPS * all_reduce_bytes(8, 2) + 2 * 8 + timing
    expected = params + len(SYNC_STEPS) * sync + STEPS * 4 + trainer_own
    assert run["total_bytes"] == expected


# -- resume ----------------------------------------------------------------------------------


@pytest.mark.parametrize("strategy", ["localsgd", "diloco"])
def test_resume_mid_interval_is_bit_identical(pair: list[Any], tmp: Path, strategy: str) -> None:
    for rank in (0, 1):
        crashed = pair[rank][f"{strategy}_crash"]
        assert crashed["start_step"] == 10  # 2 steps into the interval that ends at 16
        reference = pair[rank][strategy]["final"]
        assert reference.keys() == crashed["params"].keys()
        for key in reference:
            assert np.array_equal(reference[key], crashed["params"][key]), (rank, key)
    losses = losses_by_step(str(tmp / f"{strategy}_crash"))
    assert losses == losses_by_step(str(tmp / strategy))
    step_dir = tmp / f"{strategy}_crash/checkpoints/step-00000010"
    assert (step_dir / part_file("model", Form.PER_RANK, 1)).exists()
    assert (step_dir / OUTER_FILE).exists() == (strategy == "diloco")


@pytest.mark.parametrize("strategy", ["localsgd", "diloco"])
def test_resume_at_another_world_size_starts_every_rank_alike(
    pair: list[Any], tmp: Path, strategy: str
) -> None:
    step_dir = tmp / f"{strategy}_crash/checkpoints/step-00000010"
    raw = tiny_raw(
        tmp / f"{strategy}_one",
        INTERVALS,
        strategy={"name": strategy},
        run={"resume": str(step_dir)},
    )
    one = run_ranks(resume_only, 1, raw)[0]
    assert one["step"] == 10
    saved = torch.load(step_dir / "model.pt", weights_only=True)
    if strategy == "diloco":
        # The anchor (the model of the outer step at step 8), not a replica.
        outer = torch.load(step_dir / OUTER_FILE, weights_only=True)
        for name, value in outer["anchor"].items():
            assert np.array_equal(one["anchor"][name], value.numpy()), name
            assert np.array_equal(one["params"][name], value.numpy()), name
        assert max_diff(one["params"], {k: v.numpy() for k, v in saved.items()}) > 0
        assert "restarts from the anchor" in one["printed"]
    else:
        assert max_diff(one["params"], {k: v.numpy() for k, v in saved.items()}) == 0.0
        assert "starts from rank 0's replica" in one["printed"]
    assert "not carried over" in one["printed"]  # saved mid-interval
    inner = torch.load(step_dir / "optimizer.pt", weights_only=True)["state"]
    assert all(np.array_equal(one["exp_avg"][i], inner[i]["exp_avg"].numpy()) for i in inner)


# -- a data-parallel warm-up (comm.local_start_step) -----------------------------------------


@pytest.mark.parametrize("strategy", ["localsgd_all_dp", "diloco_all_dp"])
def test_warm_up_steps_are_data_parallel_steps_with_any_optimizer(
    pair: list[Any], strategy: str
) -> None:
    # Every step in the warm-up: the gradients are averaged before the step, so with AdamW
    # (not linear in the gradient, unlike the H = 1 comparison) the replicas stay one model,
    # the one ddp trains; only the rounding of the all-reduce differs (ddp divides first).
    ddp = pair[0]["ddp_adamw"]
    for rank in (0, 1):
        assert max_diff(pair[rank][strategy], ddp) < 1e-6
    assert max_diff(pair[0][strategy], pair[1][strategy]) == 0.0
    assert max_diff(ddp, pair[0]["init"]) > 1e-3


@pytest.mark.parametrize("strategy", ["localsgd_w4", "diloco_w4"])
def test_after_the_warm_up_replicas_meet_every_h_steps_counted_from_it(
    pair: list[Any], strategy: str
) -> None:
    a, b = pair[0][strategy]["params"], pair[1][strategy]["params"]
    for step in range(1, STEPS + 1):
        same = np.array_equal(a[step - 1], b[step - 1])
        assert same == (step <= 4 or step in WARM4_SYNC_STEPS), f"step {step}: equal = {same}"
    assert pair[0][strategy]["syncs"] == len(WARM4_SYNC_STEPS)
    run = pair[0][strategy]
    # The warm-up all-reduces every gradient (and a used-flag per parameter tensor) each step.
    grads = all_reduce_bytes(run["param_bytes"] + 4 * run["param_tensors"], 2)
    plain = pair[0][strategy.removesuffix("_w4")]
    warm_total = (
        plain["total_bytes"]
        + 4 * grads
        + all_reduce_bytes(run["param_bytes"], 2) * (len(WARM4_SYNC_STEPS) - len(SYNC_STEPS))
    )
    assert run["total_bytes"] == warm_total


def test_diloco_anchors_on_the_model_at_the_end_of_the_warm_up(pair: list[Any]) -> None:
    run = pair[0]["diloco_w4"]
    assert np.array_equal(run["anchor"][3], run["params"][3])  # after step 4
    anchors = np.stack(run["anchor"])
    moved = [s for s in range(2, STEPS + 1) if not np.array_equal(anchors[s - 1], anchors[s - 2])]
    assert moved == [4, *WARM4_SYNC_STEPS]


@pytest.mark.parametrize(
    ("strategy", "reference"),
    [
        ("localsgd_w4_crash", "localsgd_w4"),  # resumed at 10: 6 steps after the warm-up
        ("diloco_w4_crash", "diloco_w4"),
        ("localsgd_w12_crash", "localsgd_w12"),  # resumed at 10: inside the warm-up
        ("diloco_w12_crash", "diloco_w12"),
    ],
)
def test_resume_around_the_warm_up_is_bit_identical(
    pair: list[Any], strategy: str, reference: str
) -> None:
    for rank in (0, 1):
        crashed = pair[rank][strategy]
        assert crashed["start_step"] == 10
        done = pair[rank][reference]
        if reference.endswith("_w4"):  # a recorded run: its parameters are under "final"
            done = done["final"]
        for key in done:
            assert np.array_equal(done[key], crashed["params"][key]), (rank, key)


# -- the NaN guard -------------------------------------------------------------------------


def test_a_nan_on_one_rank_is_skipped_on_every_rank(pair: list[Any]) -> None:
    out = [pair[rank]["localsgd_nan"] for rank in (0, 1)]
    assert [o["skipped"] for o in out] == [1, 1]  # both took the same branch: no hang
    assert [o["steps"] for o in out] == [STEPS, STEPS]
    assert max_diff(out[0]["params"], out[1]["params"]) == 0.0  # the run ended on a sync
    assert all(np.isfinite(v).all() for v in out[0]["params"].values())


def test_persistent_nan_rolls_back_mid_interval(pair: list[Any]) -> None:
    out = [pair[rank]["diloco_rollback"] for rank in (0, 1)]
    assert [o["rollbacks"] for o in out] == [1, 1]
    assert [o["skipped"] for o in out] == [3, 3]
    assert [o["steps"] for o in out] == [STEPS, STEPS]
    assert max_diff(out[0]["params"], out[1]["params"]) == 0.0
    assert all(np.isfinite(v).all() for v in out[0]["params"].values())


def test_the_module_imports_on_its_own() -> None:
    # The registry (dtrain.parallel's __init__) lists these strategies and they build on its
    # base: importing this module first, in a fresh interpreter, must work.
    code = "import dtrain.parallel.local_sgd as m; print(m.DiLoCoStrategy.name)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "diloco"


def test_one_rank_is_its_own_average(tmp_path: Path) -> None:
    # A job of one rank has no process group: its first synchronization failed with torch's
    # "Default process group has not been initialized" (a run resumed at world size 1 too).
    from tests.recipe_helpers import train_each

    sections: dict[str, dict[str, object]] = {"train": {"steps": 4}, "comm": {"sync_every": 2}}
    raws = [
        tiny_raw(tmp_path / name, strategy={"name": name}, **sections)
        for name in ("ddp", "localsgd", "diloco")
    ]
    ddp, local, diloco = run_ranks(train_each, 1, raws)[0]
    for key, value in ddp["params"].items():  # one replica: its average is itself, bit for bit
        assert np.array_equal(value, local["params"][key]), key
    assert sorted(diloco["losses"]) == sorted(ddp["losses"])  # diloco's outer step ran


def test_localsgd_replicas_resumed_by_diloco_share_rank_0s_anchor(tmp_path: Path) -> None:
    # Saved 2 local steps after the start (no sync before step 10), each rank took back its own
    # replica; the checkpoint holds no diloco outer state, so the anchor is rank 0's replica on
    # every rank (each rank's own would make the outer step at the end differ between them).
    sections: dict[str, dict[str, object]] = {
        "train": {"steps": 4, "log_every": 1},
        "checkpoint": {"every": 2},
        "comm": {"sync_every": 10},
    }
    saved = tiny_raw(tmp_path / "run", strategy={"name": "localsgd"}, **sections)
    resumed = tiny_raw(tmp_path / "run", strategy={"name": "diloco"}, **sections)
    ranks = run_ranks(crash_then_resume, 2, saved, 3, resumed)
    assert ranks[0]["start_step"] == 2
    assert (tmp_path / "run" / "checkpoints" / "step-00000002" / "model-rank00001.pt").exists()
    for key, value in ranks[0]["params"].items():  # the run ends on one model
        assert np.array_equal(value, ranks[1]["params"][key]), key
