"""Pipeline's checkpoints resumed by the other strategies and theirs by pipeline, optimizer state
included: the same parameters as a run that never changed strategy."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import tiny_raw
from tests.dist_helpers import crash_then_resume, train_params
from tests.ranks import run_ranks
from tests.test_ddp import assert_params_close

# 2 micro-batches: 1F1B on 2 stages (the tiny GPT's 4 layers: embedding, 2 blocks, head).
DATA = {"global_batch_size": 8, "micro_batches": 2}
SECTIONS: dict[str, dict[str, object]] = {
    "train": {"steps": 4, "log_every": 1},
    "checkpoint": {"every": 2},
}
# The uniform split: the profiled one follows the layers' measured times, and under load it
# put the embedding alone on rank 0's stage, whose only optimizer group is weight-decayed: the
# groups read back there (checked below) were one where the test expects two (a fresh-clone
# suite failed so; pinning the split to the first layer alone fails the same way).
PIPELINE = {"name": "pipeline", "pipeline_schedule": "1f1b", "pipeline_balance": "uniform"}
# AdamW with weight decay: two groups in ddp's optimizer (four in tensor's), one setting per
# parameter in pipeline's checkpoint; each group's matched by parameter name.
ADAMW = {"name": "adamw", "lr": 3e-3, "weight_decay": 0.1, "warmup_steps": 1}


def resume_equals_unchanged(
    tmp_path: Path,
    saved_by: dict[str, object],
    resumed_by: dict[str, object],
    optim: dict[str, object],
    ranks: int = 2,
) -> None:
    """Train 2 steps with ``saved_by``, crash, resume the 2 more with ``resumed_by``: the
    parameters are those of a ``resumed_by`` run that never changed."""
    sections = {**SECTIONS, "optim": optim}
    reference = run_ranks(
        train_params, ranks, tiny_raw(tmp_path / "ref", data=DATA, strategy=resumed_by, **sections)
    )
    saved = tiny_raw(tmp_path / "run", data=DATA, strategy=saved_by, **sections)
    resumed = tiny_raw(tmp_path / "run", data=DATA, strategy=resumed_by, **sections)
    result = run_ranks(crash_then_resume, ranks, saved, 3, resumed)[0]
    assert result["start_step"] == 2
    # The optimizer's state carried over (lost, the parameters differ by ~lr, or ~lr x
    # momentum). Under AdamW within 1e-5 absolute: the attention's key bias has a
    # roundoff-only gradient, which AdamW's normalization turns into a step of up to lr in a
    # direction the last bit picks (the strategies round differently).
    assert_params_close(reference[0], result["params"], rtol=1e-5, atol=1e-5 if optim else 1e-6)
    if optim:  # each group kept its weight decay through the regrouping
        assert sorted({s["weight_decay"] for s in result["settings"]}) == [0.0, 0.1]


@pytest.mark.parametrize(
    ("saved_by", "resumed_by", "optim"),
    [
        ({"name": "ddp"}, PIPELINE, ADAMW),  # whole files into stages (the head's copy too)
        ({"name": "tensor"}, PIPELINE, ADAMW),  # four groups, by name, onto a stage's two
        (PIPELINE, {"name": "fsdp"}, {}),  # settings per parameter into groups; SGD momentum
        (PIPELINE, {"name": "ddp"}, ADAMW),  # stages whole into a replica
    ],
    ids=["ddp-pipeline", "tensor-pipeline", "pipeline-fsdp", "pipeline-ddp"],
)
def test_pipeline_and_the_other_strategies_resume_each_other(
    tmp_path: Path,
    saved_by: dict[str, object],
    resumed_by: dict[str, object],
    optim: dict[str, object],
) -> None:
    # Each was refused before launch: pipeline keys its optimizer settings per parameter.
    resume_equals_unchanged(tmp_path, saved_by, resumed_by, optim)


def test_whole_files_resume_under_pipeline_x_tensor(tmp_path: Path) -> None:
    # A composed layout: 2 stages x 2 tensor-parallel ranks, each cutting its part of the
    # whole tensors (the last stage's copy of the tied head read as the embedding).
    composed = {**PIPELINE, "pipeline_stages": 2, "tensor_parallel": 2}
    resume_equals_unchanged(tmp_path, {"name": "ddp"}, composed, ADAMW, ranks=4)
