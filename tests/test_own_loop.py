"""A loop of the user's own (``dtrain.Run``, docs/own-loop.md) keeps dtrain's guarantees: the
default job written as one logs dtrain train's losses bit for bit (ddp: the pinned ones; fsdp);
it trains the parameters dtrain's loop trains, bit for bit, under ddp, allreduce, fsdp, tensor
and 2 x 2 composed meshes; 2
ranks equal one process; a kill -9 resumes bit-identically; SIGTERM saves and stops every rank
at one step; mistakes are one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dtrain.config.load import build_config
from dtrain.errors import ConfigError
from dtrain.train.job import build_job_config
from dtrain.weights.init_from import read_weights
from tests.conftest import REPO, tiny_raw
from tests.dist_helpers import train_params
from tests.own_loops import (
    KILL_ENV,
    mistake,
    notebook,
    own_loop_params,
    save_after_step,
    signal_at_step,
)
from tests.ranks import run_ranks
from tests.test_cli import run_cli, write_tiny_config
from tests.test_ddp import assert_params_close
from tests.test_default_job import SHORT, assert_pinned, logged_losses
from tests.test_fault import JOB, assert_bit_equal

EXAMPLE = str(REPO / "examples" / "own_loop.py")
SCRIPT = str(REPO / "tests" / "own_loops.py")


def test_the_default_job_as_an_own_loop_logs_the_pinned_losses(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    result = run_cli(
        "train", "--nproc", "2", f"--run.script={EXAMPLE}", f"--run.dir={run_dir}", *SHORT
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert_pinned(logged_losses(run_dir), {"train": ("10", "20")})


@pytest.mark.slow  # two whole launches (~40 s loaded); the default suite checks fsdp's bits
# through both loops in one pair of processes (test_an_own_loop_trains_what_dtrain_s_loop_trains)
def test_the_default_job_as_an_own_loop_logs_dtrain_train_s_losses_under_fsdp(
    tmp_path: Path,
) -> None:
    job = ["--train.steps=10", "--train.log_every=5", "--strategy.name=fsdp", *SHORT[1:]]
    losses = []
    for name, own in (("trainer", []), ("own", [f"--run.script={EXAMPLE}"])):
        run_dir = tmp_path / name
        result = run_cli("train", "--nproc", "2", *own, f"--run.dir={run_dir}", *job)
        assert result.returncode == 0, result.stderr[-3000:]
        losses.append(logged_losses(run_dir)["train"])
    assert list(losses[0]) == ["5", "10"]
    assert losses[0] == losses[1]


@pytest.mark.parametrize("strategy", ["ddp", "allreduce", "fsdp", "tensor"])
def test_an_own_loop_trains_what_dtrain_s_loop_trains(tmp_path: Path, strategy: str) -> None:
    sections = {"strategy": {"name": strategy}, "data": {"micro_batches": 2}}
    theirs = run_ranks(train_params, 2, tiny_raw(tmp_path / "trainer", JOB, **sections))
    ours = run_ranks(own_loop_params, 2, tiny_raw(tmp_path / "own", JOB, **sections))
    assert_bit_equal(theirs[0], ours[0])
    assert_bit_equal(theirs[1], ours[1])


# 2 x 2 meshes on 4 ranks: FSDP shards x tensor-parallel pairs, and data-parallel copies x
# tensor-parallel pairs. In the slow suite: about 5 s each, loaded, for a default suite at its
# time budget; the default suite checks tensor's bits (2 ranks) above.
@pytest.mark.slow
@pytest.mark.parametrize(
    "mesh",
    [
        {"name": "fsdp", "tensor_parallel": 2},
        {"name": "tensor", "tensor_parallel": 2},
    ],
    ids=["fsdp-tensor", "copies-tensor"],
)
def test_an_own_loop_trains_what_dtrain_s_loop_trains_on_a_composed_mesh(
    tmp_path: Path, mesh: dict[str, object]
) -> None:
    sections = {"strategy": mesh, "train": {"steps": 6}}
    theirs = run_ranks(train_params, 4, tiny_raw(tmp_path / "trainer", JOB, **sections))
    ours = run_ranks(own_loop_params, 4, tiny_raw(tmp_path / "own", JOB, **sections))
    for rank in range(4):
        assert_bit_equal(theirs[rank], ours[rank])


def test_an_own_loop_on_two_ranks_equals_one_process(tmp_path: Path) -> None:
    # SGD (tiny_raw's), an uneven split (4 + 3 samples) and accumulation: the exact global mean.
    data = {"data": {"global_batch_size": 7, "micro_batches": 2}}
    single = run_ranks(own_loop_params, 1, tiny_raw(tmp_path / "one", **data))[0]
    pair = run_ranks(own_loop_params, 2, tiny_raw(tmp_path / "two", **data))
    assert_params_close(pair[0], pair[1], rtol=0, atol=0)
    assert_params_close(single, pair[0])


def test_sigterm_stops_every_rank_at_one_step_saves_and_resumes_bit_identically(
    tmp_path: Path,
) -> None:
    reference = run_ranks(own_loop_params, 2, tiny_raw(tmp_path / "ref", JOB))
    run_dir = tmp_path / "pre"
    stopped = run_ranks(signal_at_step, 2, tiny_raw(run_dir, JOB), 1, 6, "SIGTERM")
    assert [s["preempted"] for s in stopped] == ["a peer's signal", "SIGTERM"]
    assert stopped[0]["steps"] == stopped[1]["steps"] == 6
    assert json.loads((run_dir / "status.json").read_text())["state"] == "preempted"
    assert (run_dir / "checkpoints/step-00000006/COMMITTED.json").exists()
    resumed = run_ranks(own_loop_params, 2, tiny_raw(run_dir, JOB))
    assert_bit_equal(reference[0], resumed[0])


def test_a_kill_9_under_dtrain_train_resumes_bit_identically(tmp_path: Path) -> None:
    import os

    finals, outputs = [], []
    # 12 steps, a checkpoint every 3 (saved in the background): rank 1 killed as it starts
    # step 11, the job restarted from the newest checkpoint committed before.
    for name, kill in (("ref", ""), ("killed", "1:11")):
        run_dir = tmp_path / name
        config = write_tiny_config(tmp_path / f"{name}.toml", run_dir)
        os.environ[KILL_ENV] = kill
        try:
            result = run_cli(
                "train",
                str(config),
                f"--run.script={SCRIPT}",
                "--train.steps=12",
                "--nproc",
                "2",
                "--max-restarts",
                "1",
            )
        finally:
            del os.environ[KILL_ENV]
        assert result.returncode == 0, result.stderr[-3000:]
        finals.append(read_weights(run_dir / "checkpoints" / "step-00000012"))
        outputs.append(result.stderr)
    assert (tmp_path / "killed" / "killed-once").exists()  # it was killed, and restarted
    assert "resumed from step-0000000" in outputs[1]
    reference, resumed = finals
    assert reference.keys() == resumed.keys()
    for key in reference:
        assert reference[key].equal(resumed[key]), key


# 40 samples at a global batch of 8: 5 steps an epoch, so the resumed run crosses epochs.
AUDITED = {"task": {"samples": 40}, "fault": {"audit_sample_ids": True}}


@pytest.mark.parametrize(
    "launch",
    # Under `dtrain train` (the job's exit code): two launches, ~30 s loaded; the default
    # suite stops the same loop in-process (run_ranks).
    ["ranks", pytest.param("dtrain train", marks=pytest.mark.slow)],
)
def test_sigterm_saves_exits_0_and_a_resume_on_3_ranks_keeps_every_sample_once(
    tmp_path: Path, launch: str
) -> None:
    import os

    from tests.audit import check_stream, read_trajectory

    # 2 ranks: rank 1 gets SIGTERM as it starts step 5; every rank stops after it, saved.
    run_dir = tmp_path / "run"
    raw = tiny_raw(run_dir, train={"steps": 12}, **AUDITED)
    if launch == "ranks":
        stopped = run_ranks(signal_at_step, 2, raw, 1, 5, "SIGTERM")
        assert [s["steps"] for s in stopped] == [5, 5]
    else:
        config = tmp_path / "job.toml"
        config.write_text(build_job_config(raw).to_toml())
        os.environ[KILL_ENV] = "1:5:SIGTERM"
        try:
            result = run_cli("train", str(config), f"--run.script={SCRIPT}", "--nproc", "2")
        finally:
            del os.environ[KILL_ENV]
        assert result.returncode == 0, result.stderr[-3000:]
    status = json.loads((run_dir / "status.json").read_text())
    assert (status["state"], status["step"]) == ("preempted", 5)
    assert (run_dir / "checkpoints/step-00000005/COMMITTED.json").exists()
    # Resumed by the own loop on 3 ranks: each sample once per epoch, no position skipped.
    run_ranks(own_loop_params, 3, raw)
    trajectory = read_trajectory(run_dir)
    assert sorted(trajectory) == list(range(1, 13))
    assert {len(trajectory[step].ids) for step in trajectory} == {8}
    checked = check_stream(trajectory, 40)
    assert checked.exactly_once and not checked.gaps, checked
    assert checked.positions == 12 * 8


def test_one_process_runs_the_example_with_python(tmp_path: Path) -> None:
    import subprocess
    import sys

    config = write_tiny_config(tmp_path / "tiny.toml", tmp_path / "run")
    result = subprocess.run(
        [sys.executable, EXAMPLE, str(config), "--train.steps=3"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "done: 3 steps" in result.stdout
    assert (tmp_path / "run" / "checkpoints" / "step-00000003" / "COMMITTED.json").exists()


def test_run_from_config_trains_and_resumes_in_one_process_as_a_notebook_does(
    tmp_path: Path,
) -> None:
    run_dir = tmp_path / "run"
    config = write_tiny_config(tmp_path / "job.toml", run_dir)
    done = run_ranks(notebook, 1, str(config), init_group=False)[0]
    assert done["first"] == (0, 3) and done["second"] == (3, 5)
    assert (run_dir / "checkpoints/step-00000005/COMMITTED.json").exists()
    assert "steps = 5" in (run_dir / "config.toml").read_text()
    assert "train.stepz" in done["mistaken"] and "\n" not in done["mistaken"]


def test_run_save_checkpoints_between_two_steps(tmp_path: Path) -> None:
    raw = tiny_raw(tmp_path / "run", train={"steps": 4})  # checkpoint.every = 0: the end's only
    saved = run_ranks(save_after_step, 1, raw, 2)[0]
    assert saved == ["step-00000002", "step-00000004"]


@pytest.mark.parametrize(
    ("kind", "says"),
    [
        ("step before backward", ["run.step() before run.backward(): step 1 has no gradient"]),
        ("register after start", ["run.register(extra) after the loop started"]),
        ("mean loss", ["run.backward() got 1 value(s)", 'looks reduced: use reduction="none"']),
        ("leave mid step", ["rank 0 left run.batches() in the middle of step 2, before its"]),
    ],
)
def test_a_mistake_in_the_loop_is_one_line(tmp_path: Path, kind: str, says: list[str]) -> None:
    said = run_ranks(mistake, 1, tiny_raw(tmp_path / "run", train={"steps": 2}), kind)[0]
    assert [part for part in says if part not in said] == []
    assert "\n" not in said


def test_lines_of_code_count_code_only_and_the_own_loop_s_job_is_the_shortest() -> None:
    import importlib.util

    spec = importlib.util.spec_from_file_location("loc_count", REPO / "benchmarks/loc/count.py")
    assert spec is not None and spec.loader is not None
    count = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(count)
    snippet = '"""Doc.\n\nMore."""\n\nimport os  # why\n# alone\n\ndef f():\n    """Doc."""\n'
    assert count.python_lines(snippet + "    return (1,\n            2)\n") == 4
    assert count.config_lines("# a comment\n[train]\n\nsteps = 60\n") == 2
    totals = {name: sum(map(count.count, paths)) for name, paths in count.JOBS.items()}
    ours = totals.pop("dtrain own loop")
    assert len(totals) == 2 and ours < min(totals.values())


def test_a_strategy_that_owns_the_step_is_refused_before_any_worker_starts() -> None:
    raw = {"run": {"script": EXAMPLE}, "strategy": {"name": "pipeline"}}
    with pytest.raises(ConfigError, match="cannot run in a loop of your own"):
        build_config(raw)
    with pytest.raises(ConfigError, match=r"run\.script = 'nope\.py': no such file"):
        build_config({"run": {"script": "nope.py"}})
