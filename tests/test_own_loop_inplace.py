"""A loop of the user's own (``run.script``) under ``fault.recovery = 'inplace'``, through the
real CLI as tests/test_inplace.py runs dtrain's loop: a member killed outright (kill -9) in a
step's forward, the survivor heals from its own memory through the trainer's recovery seam and
goes on alone, and the run holds to that test's standard -- the final parameters of checkpoint
resumes at the same sequence of world sizes, every sample exactly once -- with the loop's own
registered state taken back to the dropped step's start."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import dtrain
from dtrain.errors import UserError
from dtrain.train.job import build_job_config
from tests.conftest import REPO, tiny_raw
from tests.own_loops import train_own_loop
from tests.processes import Launch
from tests.ranks import run_ranks
from tests.test_inplace import (
    JOB,
    assert_exactly_once,
    assert_rejoined_healed,
    assert_same_final_params,
    membership_events,
    reference_params,
)

SCRIPT = str(REPO / "tests" / "own_loop_counted.py")


def launch_own_loop(
    tmp_path: Path,
    steps: int,
    max_restarts: int,
    expect: int = 0,
    fault: dict[str, object] | None = None,
    strategy: str = "ddp",
    **task: object,
) -> tuple[Path, str]:
    """``dtrain train --run.script=tests/own_loop_counted.py`` under fault.recovery =
    'inplace' (and ``fault``) on 2 workers, member 0 killed in its 4th step (``task``: more of
    the task's options); the run folder and the launcher's output."""
    run_dir = tmp_path / "run"
    fault = {"recovery": "inplace", **(fault or {})}
    sections = {"run": {"script": SCRIPT}, "strategy": {"name": strategy}, "fault": fault}
    raw = tiny_raw(run_dir, JOB, train={"steps": steps}, **sections)
    raw["task"].update({"kill_member": 0, "kill_at_forward": 4, **task})
    config = tmp_path / "job.toml"
    config.write_text(build_job_config(raw).to_toml())
    launch = Launch(config, 2, "--max-restarts", str(max_restarts), cwd=REPO)
    try:
        code = launch.wait(300)
    finally:
        launch.close()
    text = launch.text()
    assert code == expect, text[-4000:]
    return run_dir, text


def begun_steps(run_dir: Path, step: int) -> int:
    """The loop's registered count of the steps it began, as checkpoint ``step`` holds it."""
    final = run_dir / f"checkpoints/step-{step:08d}/train_state.pt"
    begun: int = torch.load(final, weights_only=True)["user/begun"]["steps"]
    return begun


@pytest.mark.parametrize("strategy", ["ddp", pytest.param("allreduce", marks=[pytest.mark.slow])])
def test_kill9_of_one_of_two_an_own_loop_survives_in_place(tmp_path: Path, strategy: str) -> None:
    run_dir, text = launch_own_loop(tmp_path, steps=10, max_restarts=0, strategy=strategy)
    assert "member 1: leaving generation 0 at step 3 (the step in flight dropped)" in text
    (event,) = membership_events(run_dir)  # and no checkpoint was read
    assert (event["step"], event["left"], event["joined"]) == (3, [0], [])
    assert (event["world_size"], event["healed_from"]) == (1, 1)
    assert_exactly_once(run_dir, 10)
    reference = reference_params(tmp_path, [(2, 3), (1, 10)], strategy)
    assert_same_final_params(reference, run_dir, 10)  # tests/test_inplace.py's standard
    # ... and bit for bit (one thread per rank; two ranks' sums do not depend on the order):
    # the own loop trains what dtrain's loop trains, recovery included.
    final = "checkpoints/step-00000010/model.pt"
    expected = torch.load(reference / final, weights_only=True)
    got = torch.load(run_dir / final, weights_only=True)
    assert got.keys() == expected.keys()
    assert [key for key, value in expected.items() if not got[key].equal(value)] == []
    # The loop's registered count: 3 healed (step 4's raise taken back), then 7 steps alone.
    assert begun_steps(run_dir, 10) == 10


@pytest.mark.slow
def test_a_worker_of_an_own_loop_killed_after_the_gradient_sync_leaves_its_samples_on_record(
    tmp_path: Path,
) -> None:
    # Member 0 dies just before its 4th update: member 1 commits step 4 without it, leaves (in
    # step 4's metrics or step 5's first collective, which it drops), and its main(run) is
    # called again from step 4's end.
    run_dir, text = launch_own_loop(
        tmp_path, steps=8, max_restarts=0, kill_at_forward=0, kill_at_update=4
    )
    assert "member 1: leaving generation 0 at step 4" in text
    (event,) = membership_events(run_dir)
    assert (event["step"], event["left"], event["world_size"]) == (4, [0], 1)
    assert_exactly_once(run_dir, 8)
    assert begun_steps(run_dir, 8) == 8


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_killed_worker_restarted_joins_an_own_loop_healed_from_the_survivor(
    tmp_path: Path,
) -> None:
    # As tests/test_inplace.py's: slow steps, so that the restart joins long before the end;
    # the survivor's main(run) leaves through run.step() (the regroup) and is called again.
    steps = 400
    run_dir, _ = launch_own_loop(tmp_path, steps=steps, max_restarts=1, slow_ms=60)
    assert_rejoined_healed(tmp_path, run_dir, steps)
    assert begun_steps(run_dir, steps) == steps  # the joiner's count: the survivor's


@pytest.mark.slow
def test_an_own_loop_below_min_replicas_saves_what_the_survivor_holds_and_stops(
    tmp_path: Path,
) -> None:
    # The survivor's main(run) is called once more, to build what the state loads into; its
    # first run.batches() heals, saves step 3 and ends the job (no step trained alone).
    run_dir, text = launch_own_loop(
        tmp_path, steps=10, max_restarts=1, expect=1, fault={"min_replicas": 2}
    )
    assert "the survivors saved checkpoints/step-00000003" in text
    status = json.loads((run_dir / "status.json").read_text())
    assert (status["state"], status["step"]) == ("stopped", 3)
    assert_exactly_once(run_dir, 3)
    assert_same_final_params(reference_params(tmp_path, [(2, 3)]), run_dir, 3)
    assert begun_steps(run_dir, 3) == 3


def test_a_further_optimizer_under_inplace_is_one_line(tmp_path: Path) -> None:
    raw = tiny_raw(tmp_path / "run", train={"steps": 2}, fault={"recovery": "inplace"})
    said = run_ranks(wrap_with_optimizer, 1, raw)[0]
    assert said.startswith("run.wrap('critic', ..., optimizer=...) under fault.recovery = ")
    assert "use fault.recovery = 'restart', or wrap it frozen" in said
    assert "\n" not in said


def wrap_with_optimizer(raw: dict[str, object]) -> str:
    """The one-line error of a loop that wraps a further model with an optimizer."""

    def loop(run: dtrain.Run) -> None:
        from tests.tasks import tiny_gpt

        task = tiny_gpt(run.config)
        run.prepare(task.model, task.train_data, collate_fn=task.collate_fn)
        run.wrap("critic", torch.nn.Linear(2, 1), optimizer=torch.optim.SGD)

    try:
        train_own_loop(raw, loop)
    except UserError as exc:
        return str(exc)
    return "no error"
