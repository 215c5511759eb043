"""Resuming at another world size: the same global batches, each sample exactly once."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.audit import check_stream, read_trajectory
from tests.conftest import tiny_raw
from tests.dist_helpers import train_params
from tests.ranks import run_ranks

SAMPLES = 40  # 5 steps per epoch at a global batch of 8: the run crosses epochs


JOB = {
    "task": {"samples": SAMPLES},
    "checkpoint": {"every": 3},
    "fault": {"audit_sample_ids": True},
}


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[int, list[int]]:
    run_dir = tmp_path_factory.mktemp("ref")
    run_ranks(train_params, 1, tiny_raw(run_dir, JOB, train={"steps": 12}))
    return {step: record.ids for step, record in read_trajectory(run_dir).items()}


@pytest.mark.parametrize(("before", "after"), [(4, 2), (2, 4), (2, 3)])
def test_resume_at_another_world_size_keeps_exactly_once(
    tmp_path: Path, reference: dict[int, list[int]], before: int, after: int
) -> None:
    # Stops after step 7 (saved at 6, 7) ...
    run_ranks(train_params, before, tiny_raw(tmp_path, JOB, train={"steps": 7}))
    # ... and resumes from step 7 at a new size.
    run_ranks(train_params, after, tiny_raw(tmp_path, JOB, train={"steps": 12}))
    trajectory = read_trajectory(tmp_path)
    assert {step: record.ids for step, record in trajectory.items()} == reference
    audit = check_stream(trajectory, SAMPLES)
    assert audit.exactly_once and not audit.gaps, audit
    assert audit.positions == 12 * 8
