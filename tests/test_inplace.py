"""``fault.recovery = 'inplace'`` through the real CLI (the launcher supervising each worker,
beside its membership coordinator): a worker killed outright mid-step, the survivor goes on at
the new world size, and a restart of the killed worker heals from the survivor's memory.

Each run is checked against a reference trained with checkpoint resumes at the same sequence of
world sizes (the same global batches): equal final parameters, every sample exactly once."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from dtrain.config import Config
from dtrain.errors import ConfigError, UserError
from dtrain.train.job import build_job_config
from tests.audit import check_stream, read_trajectory
from tests.conftest import REPO, tiny_config, tiny_raw
from tests.dist_helpers import train_params
from tests.processes import Launch
from tests.ranks import run_ranks

SAMPLES = 48  # 6 steps per epoch at a global batch of 8: the runs cross epochs

JOB: dict[str, dict[str, object]] = {
    "run": {"task": "tests.tasks:member_kill_gpt"},
    "task": {"samples": SAMPLES},
    "train": {"log_every": 1},
    # A constant rate after warm-up: the reference's first leg (a shorter run) schedules the
    # same rates as the whole run.
    "optim": {"min_lr_ratio": 1.0},
    "fault": {"audit_sample_ids": True},
    # One thread everywhere: the in-place workers and the reference's single rank would
    # otherwise split their matmuls differently (last bits, grown over hundreds of steps).
    "dist": {"timeout_s": 60, "threads": 1},
}


def launch_job(
    tmp_path: Path,
    steps: int,
    max_restarts: int,
    strategy: str = "ddp",
    nproc: int = 2,
    **task: object,
) -> Path:
    """Run ``dtrain train`` with fault.recovery = 'inplace' on ``nproc`` workers, member 0
    (or the task's ``kill_member``) killed in its 4th step; returns the run folder."""
    run_dir = tmp_path / "run"
    raw = tiny_raw(
        run_dir,
        JOB,
        train={"steps": steps},
        fault={"recovery": "inplace"},
        strategy={"name": strategy},
    )
    raw["task"].update({"kill_member": 0, "kill_at_forward": 4, **task})
    cfg = build_job_config(raw)  # the task's own options (tests.tasks.MemberKillOptions)
    config = tmp_path / "job.toml"
    config.write_text(cfg.to_toml())
    launch = Launch(config, nproc, "--max-restarts", str(max_restarts), cwd=REPO)
    try:
        code = launch.wait(300)
    finally:
        launch.close()
    assert code == 0, launch.text()[-4000:]
    return run_dir


def membership_events(run_dir: Path) -> list[dict[str, Any]]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert not any(r.get("name") == "resumed" for r in records)  # no checkpoint was read
    return [r for r in records if r.get("name") == "membership"]


def reference_params(
    tmp_path: Path, sizes: list[tuple[int, int]], strategy: str = "ddp", **task: object
) -> Path:
    """Train with checkpoint resumes: ``(world size, last step)`` in order; the run folder."""
    run_dir = tmp_path / "reference"
    for world, last in sizes:
        raw = tiny_raw(run_dir, JOB, train={"steps": last}, strategy={"name": strategy}, task=task)
        run_ranks(train_params, world, raw)
    return run_dir


def assert_same_final_params(a: Path, b: Path, step: int) -> None:
    final = f"checkpoints/step-{step:08d}/model.pt"
    # Without the test wrappers' prefixes (a slowed model is wrapped once more).
    expected = {k.replace("inner.", ""): v for k, v in torch.load(a / final).items()}
    got = {k.replace("inner.", ""): v for k, v in torch.load(b / final).items()}
    assert expected.keys() == got.keys()
    for key in expected:
        torch.testing.assert_close(got[key], expected[key], rtol=1e-5, atol=1e-6)


def assert_exactly_once(run_dir: Path, steps: int) -> None:
    audit = check_stream(read_trajectory(run_dir), SAMPLES)
    assert audit.exactly_once and not audit.gaps, audit
    assert audit.positions == steps * 8


@pytest.mark.parametrize("strategy", ["ddp", pytest.param("allreduce", marks=[pytest.mark.slow])])
def test_kill9_of_one_of_two_the_survivor_goes_on_exactly_once(
    tmp_path: Path, strategy: str
) -> None:
    run_dir = launch_job(tmp_path, steps=10, max_restarts=0, strategy=strategy)
    (event,) = membership_events(run_dir)
    # Step 4 was in flight: dropped; the survivor (member 1) redoes it alone.
    assert (event["step"], event["left"], event["joined"]) == (3, [0], [])
    assert (event["world_size"], event["healed_from"]) == (1, 1)
    assert_exactly_once(run_dir, 10)
    reference = reference_params(tmp_path, [(2, 3), (1, 10)], strategy)
    assert_same_final_params(reference, run_dir, 10)


def test_a_worker_killed_after_the_gradient_sync_leaves_its_samples_on_record(
    tmp_path: Path,
) -> None:
    # Member 0 dies just before its 4th update: every rank's gradient of step 4 was summed, so
    # member 1 commits step 4 without it and goes on alone. The chaos trials caught this
    # window once in 40 kills (`step 10 delivered 6 ids for 8 positions`) while ranks recorded
    # their samples after the update; they record them before the step's first collective, and
    # its commit after the update (a step dropped in flight does not count: the min_replicas
    # test below).
    run_dir = launch_job(tmp_path, steps=8, max_restarts=0, kill_at_forward=0, kill_at_update=4)
    (event,) = membership_events(run_dir)
    assert (event["step"], event["left"], event["world_size"]) == (4, [0], 1)
    assert_exactly_once(run_dir, 8)


@pytest.mark.slow
def test_kill9_of_one_of_four_no_survivor_waits_for_its_timeout(tmp_path: Path) -> None:
    # Member 1 dies: in gloo's ring member 3 exchanges with members 0 and 2 only, which stay
    # alive; it leaves at once only because they shut their connections (dtrain.recovery.sever).
    run_dir = launch_job(tmp_path, steps=10, max_restarts=0, nproc=4, kill_member=1)
    (event,) = membership_events(run_dir)
    assert (event["step"], event["left"], event["members"]) == (3, [1], [0, 2, 3])
    # From the first survivor's ask to the state loaded: without the severing, member 3 would
    # ask only when its collective timed out (dist.timeout_s = 60).
    print(f"regroup took {event['seconds']:.2f} s")
    assert event["seconds"] < 30
    assert_exactly_once(run_dir, 10)
    reference = reference_params(tmp_path, [(4, 3), (3, 10)])
    assert_same_final_params(reference, run_dir, 10)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_killed_worker_restarted_heals_from_the_survivor(tmp_path: Path) -> None:
    # Slow steps: the restart (a new process importing torch: 5-20 s on a loaded 2-core
    # machine) joins long before the end.
    steps = 400
    run_dir = launch_job(tmp_path, steps=steps, max_restarts=1, slow_ms=60)
    assert_rejoined_healed(tmp_path, run_dir, steps)


def assert_rejoined_healed(tmp_path: Path, run_dir: Path, steps: int) -> None:
    """Member 0, killed in step 4, left member 1 alone; restarted, it joined healed from
    member 1; every sample once, and the parameters of resumes at those world sizes."""
    left, joined = membership_events(run_dir)
    assert (left["step"], left["left"], left["world_size"]) == (3, [0], 1)
    assert (joined["joined"], joined["world_size"], joined["healed_from"]) == ([0], 2, 1)
    assert 3 < joined["step"] < steps
    assert_exactly_once(run_dir, steps)
    # Member 0 is rank 0 again once it rejoins: DDP would spread its parameters, so a wrong
    # heal (or none) would change the final parameters.
    sizes = [(2, 3), (1, joined["step"]), (2, steps)]
    reference = reference_params(tmp_path, sizes, slow_ms=0)
    assert_same_final_params(reference, run_dir, steps)


@pytest.mark.slow
def test_below_min_replicas_the_survivors_save_and_the_job_stops(tmp_path: Path) -> None:
    # 2 workers, fault.min_replicas = 2: member 0 killed in its 4th step leaves 1.
    run_dir = tmp_path / "run"
    raw = tiny_raw(
        run_dir,
        JOB,
        train={"steps": 10},
        fault={"recovery": "inplace", "min_replicas": 2},
    )
    raw["task"].update({"kill_member": 0, "kill_at_forward": 4})
    config = tmp_path / "job.toml"
    config.write_text(build_job_config(raw).to_toml())
    launch = Launch(config, 2, "--max-restarts", "1", cwd=REPO)
    try:
        code = launch.wait(300)
    finally:
        launch.close()
    text = launch.text()
    assert code == 1, text[-4000:]
    # Step 4 was in flight: dropped; the survivor saves step 3 and trains no step alone.
    reason = "1 of 2 workers left at step 3 (member(s) 0 lost), fewer than fault.min_replicas = 2"
    assert (
        f"dtrain: error: the job stopped: {reason}; the survivors saved "
        "checkpoints/step-00000003; run the same command again to resume from it"
    ) in text
    status = json.loads((run_dir / "status.json").read_text())
    assert (status["state"], status["step"], status["signal"]) == ("stopped", 3, reason)
    (event,) = membership_events(run_dir)
    assert (event["step"], event["left"], event["world_size"]) == (3, [0], 1)
    assert event["stopped"] == reason
    assert_exactly_once(run_dir, 3)
    reference = reference_params(tmp_path, [(2, 3)])
    assert_same_final_params(reference, run_dir, 3)


@pytest.mark.parametrize("strategy", ["fsdp", "pipeline", "localsgd"])
def test_inplace_with_a_strategy_that_cannot_heal_is_one_config_error(
    tmp_path: Path, strategy: str
) -> None:
    with pytest.raises(ConfigError, match=r"fault.recovery = 'inplace'.*" + strategy):
        tiny_config(tmp_path, fault={"recovery": "inplace"}, strategy={"name": strategy})


def test_an_inplace_config_without_the_launcher_is_one_user_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The worker picks its loop by the config; only ``dtrain train`` hosts the membership
    coordinator, so a worker started without one (plain torchrun) says so instead of training
    as a restart job."""
    from dtrain.recovery.membership import COORDINATOR_ENV
    from dtrain.worker import train

    monkeypatch.delenv(COORDINATOR_ENV, raising=False)
    cfg = tiny_config(tmp_path, fault={"recovery": "inplace"})
    with pytest.raises(UserError, match=r"fault.recovery = 'inplace' needs `dtrain train`"):
        train(cfg)
    assert not (tmp_path / "metrics.jsonl").exists()  # nothing trained


def test_inplace_with_allreduce_is_accepted(tmp_path: Path) -> None:
    cfg: Config = tiny_config(
        tmp_path, fault={"recovery": "inplace"}, strategy={"name": "allreduce"}
    )
    assert cfg.fault.recovery == "inplace"


def train_times(run_dir: Path) -> list[tuple[int, float]]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [(r["step"], r["time"]) for r in records if r.get("kind") == "train"]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_stopped_worker_is_dropped_after_the_timeout_and_rejoins_healed(tmp_path: Path) -> None:
    timeout_s = 4.0
    run_dir = tmp_path / "run"
    raw = tiny_raw(
        run_dir,
        JOB,
        train={"steps": 600},
        fault={"recovery": "inplace"},
        dist={"timeout_s": timeout_s},
        task={"slow_ms": 30},
    )
    config = tmp_path / "job.toml"
    config.write_text(build_job_config(raw).to_toml())
    launch = Launch(config, 2, "--max-restarts", "1", cwd=REPO)
    try:
        deadline = time.monotonic() + 240
        while not any(step >= 5 for step, _ in train_times(run_dir)):
            assert time.monotonic() < deadline and launch.alive(), launch.text()[-3000:]
            time.sleep(0.1)
        victim = launch.inplace_workers()[0]
        os.kill(victim, signal.SIGSTOP)
        stopped = time.time()
        time.sleep(20)
        os.kill(victim, signal.SIGCONT)
        code = launch.wait(300)
    finally:
        launch.close()
    assert code == 0, launch.text()[-4000:]
    after = [t for _, t in train_times(run_dir) if t > stopped]
    print(f"stop -> next committed step: {after[0] - stopped:.2f} s (timeout {timeout_s} s)")
    assert after[0] - stopped <= timeout_s + 1 + 2  # 2 s: slack for a loaded machine
    left, joined = membership_events(run_dir)
    assert (left["left"], left["world_size"]) == ([0], 1)
    assert (joined["joined"], joined["world_size"], joined["healed_from"]) == ([0], 2, 1)
    assert joined["time"] > stopped + 20  # after SIGCONT: its stale state was replaced
    assert_exactly_once(run_dir, 600)
