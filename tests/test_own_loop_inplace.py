"""A loop of the user's own (``run.script``) under ``fault.recovery = 'inplace'``, through the
real CLI as tests/test_inplace.py runs dtrain's loop: a member killed outright (kill -9) in a
step's forward, the survivor heals from its own memory through the trainer's recovery seam and
goes on alone, and the run holds to that test's standard -- the final parameters of checkpoint
resumes at the same sequence of world sizes, every sample exactly once -- with the loop's own
registered state taken back to the dropped step's start."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dtrain.errors import UserError
from dtrain.train.job import build_job_config
from tests.conftest import REPO, tiny_raw
from tests.processes import Launch
from tests.test_inplace import (
    JOB,
    assert_exactly_once,
    assert_same_final_params,
    membership_events,
    reference_params,
)

SCRIPT = str(REPO / "tests" / "own_loop_counted.py")


def test_kill9_of_one_of_two_an_own_loop_survives_in_place(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    raw = tiny_raw(
        run_dir,
        JOB,
        run={"script": SCRIPT},
        train={"steps": 10},
        fault={"recovery": "inplace"},
    )
    raw["task"].update({"kill_member": 0, "kill_at_forward": 4})  # member 0, in step 4
    config = tmp_path / "job.toml"
    config.write_text(build_job_config(raw).to_toml())
    launch = Launch(config, 2, "--max-restarts", "0", cwd=REPO)
    try:
        code = launch.wait(300)
    finally:
        launch.close()
    text = launch.text()
    assert code == 0, text[-4000:]
    assert "member 1: leaving generation 0 at step 3 (the step in flight dropped)" in text
    (event,) = membership_events(run_dir)  # and no checkpoint was read
    assert (event["step"], event["left"], event["joined"]) == (3, [0], [])
    assert (event["world_size"], event["healed_from"]) == (1, 1)
    assert_exactly_once(run_dir, 10)
    reference = reference_params(tmp_path, [(2, 3), (1, 10)])
    assert_same_final_params(reference, run_dir, 10)
    # The loop's registered count: 3 healed (step 4's raise taken back), then 7 steps alone.
    final = run_dir / "checkpoints/step-00000010/train_state.pt"
    assert torch.load(final, weights_only=True)["user/begun"] == {"steps": 10}
