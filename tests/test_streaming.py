"""Training on a stream in real processes: a Hugging Face streaming dataset (local JSONL, five
source shards) and a stream of dtrain's protocol, each stopped by SIGTERM on 2 ranks and
resumed on 3; the sample audit shows every item once per pass over its shard."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from dtrain.checkpoint.layout import step_dir_name
from tests.audit import read_trajectory
from tests.conftest import tiny_raw
from tests.dist_helpers import signal_self_at_step, train_params
from tests.ranks import run_ranks
from tests.stream_helpers import LENGTHS, check_units, write_jsonl_shards

REPO = Path(__file__).resolve().parent.parent
B = 6
STEPS = 10  # 60 items of 39: every shard is read again


def stream_job(run_dir: Path, stream: str, stream_dir: Path, steps: int) -> dict[str, Any]:
    raw = tiny_raw(
        run_dir,
        run={"task": "tests.stream_helpers:stream_gpt"},
        data={"global_batch_size": B},
        train={"steps": steps, "log_every": 2},
        checkpoint={"every": 3},
        fault={"audit_sample_ids": True},
    )
    raw["task"].update(stream=stream, stream_dir=str(stream_dir))
    return raw


# The Hugging Face run imports datasets in each of its 5 rank processes (~2.5 CPU-s each):
# 38 s on the shared 2-core machine, so it is a slow test; the default suite reads the same
# Hugging Face stream across a world-size change in one process (tests/test_stream_loader.py).
@pytest.mark.parametrize("stream", [pytest.param("datasets", marks=pytest.mark.slow), "protocol"])
def test_a_stream_stopped_on_2_ranks_resumes_on_3_with_each_item_once(
    tmp_path: Path, stream: str
) -> None:
    if stream == "datasets":
        pytest.importorskip("datasets")
    shards = tmp_path / "shards"
    write_jsonl_shards(shards, LENGTHS)
    run_dir = tmp_path / "run"
    # SIGTERM reaches rank 1 as step 4 starts: both ranks stop after it and save.
    stopped = run_ranks(
        signal_self_at_step, 2, stream_job(run_dir, stream, shards, STEPS), 1, 4, "SIGTERM"
    )
    assert [s["steps"] for s in stopped] == [4, 4], stopped
    run_ranks(train_params, 3, stream_job(run_dir, stream, shards, STEPS))
    final = json.loads((run_dir / "checkpoints" / step_dir_name(STEPS) / "meta.json").read_text())
    state = final["data"]
    assert state["kind"] == "stream" and state["consumed"] == STEPS * B
    assert final["world_size"] == 3
    trajectory = read_trajectory(run_dir)
    assert sorted(trajectory) == list(range(1, STEPS + 1))
    for step, record in trajectory.items():  # contiguous positions, every step full
        assert (record.start, record.end) == ((step - 1) * B, step * B)
        assert len(record.ids) == B
    ids = [i for record in trajectory.values() for i in record.ids]
    assert check_units(ids, LENGTHS, state, shuffled=True) == STEPS * B


def test_a_one_pass_iterator_is_refused_in_one_line(tmp_path: Path) -> None:
    """Found where the task is built, in the worker (the launcher never builds it), before the
    model is spread or a step runs: one line, exit code 2 (which `dtrain train` repeats, as
    for any worker's user error: tests/test_cli.py), and nothing trained."""
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "dtrain.worker",
            f"--run.dir={tmp_path / 'run'}",
            "--run.task=tests.stream_helpers:stream_gpt",
            "--task.stream=oneshot",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert result.returncode == 2, result.stderr[-2000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Task.train_data (builtins.generator) is a one-pass" in lines[0]
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
