"""The strategy x recipe matrix, as data: named strategy and optimizer overrides, and the rows
the tests run, each a combination of those names (torchtitan's integration tests keep such
override lists). A test parametrizes from a table here; a strategy, recipe or combination
worth checking is one more row, not one more hand-written test."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

Options = dict[str, object]

# What each name sets of [strategy]. The pipelines split uniformly: the profiled split follows
# the layers' measured times, and under load it put the embedding alone on rank 0's stage,
# whose only optimizer group is weight-decayed (a fresh-clone suite failed so).
STRATEGIES: dict[str, Options] = {
    "ddp": {"name": "ddp"},
    "allreduce": {"name": "allreduce"},
    "fsdp": {"name": "fsdp"},
    "hybrid": {"name": "fsdp", "dp_replicate": 2},  # 4 ranks: 2 copies x 2 shards
    "tensor": {"name": "tensor"},
    "pipeline": {"name": "pipeline", "pipeline_schedule": "1f1b", "pipeline_balance": "uniform"},
    "gpipe": {"name": "pipeline", "pipeline_schedule": "gpipe", "pipeline_balance": "uniform"},
    # 2 stages x 2 tensor-parallel ranks (4 ranks)
    "pipeline-tensor": {
        "name": "pipeline",
        "pipeline_schedule": "1f1b",
        "pipeline_balance": "uniform",
        "pipeline_stages": 2,
        "tensor_parallel": 2,
    },
}

# What each name sets of [optim]. AdamW with weight decay: two groups in ddp's optimizer, four
# in tensor's (plain tensors and DTensors apart), one setting per parameter in pipeline's
# checkpoint; "sgd" is the config's default (SGD with momentum).
OPTIMIZERS: dict[str, Options] = {
    "sgd": {},
    "adamw": {"name": "adamw", "lr": 3e-3, "weight_decay": 0.1, "warmup_steps": 1},
}


@dataclass(frozen=True)
class Resume:
    """A run saved under one strategy and resumed under another."""

    saved_by: str
    resumed_by: str
    optim: str
    ranks: int = 2
    why: str = ""

    @property
    def id(self) -> str:
        return f"{self.saved_by}-{self.resumed_by}"


# A replicated strategy's whole files (model.pt, optimizer.pt) resumed by a sharded one.
WHOLE_FILES_TO_SHARDS = [
    Resume("ddp", "fsdp", "sgd"),
    Resume("ddp", "tensor", "adamw"),
    Resume("allreduce", "fsdp", "adamw"),
    Resume("ddp", "hybrid", "sgd", ranks=4),  # the same global batch: the same math
]

# Pipeline's checkpoints resumed by the others and theirs by pipeline. Each was refused before
# launch: pipeline keys its optimizer settings per parameter.
PIPELINE_RESUMES = [
    Resume("ddp", "pipeline", "adamw", why="whole files into stages (the head's copy too)"),
    Resume("tensor", "pipeline", "adamw", why="four groups, by name, onto a stage's two"),
    Resume("pipeline", "fsdp", "sgd", why="settings per parameter into groups; SGD momentum"),
    Resume("pipeline", "ddp", "adamw", why="stages whole into a replica"),
    # A composed layout, each rank cutting its part of the whole tensors (the last stage's
    # copy of the tied head read as the embedding).
    Resume("ddp", "pipeline-tensor", "adamw", ranks=4, why="whole files into a composed mesh"),
]

# Shards resumed under another strategy: tensor keeps plain tensors and DTensors in optimizer
# groups of their own, fsdp 2 (DCP's load asked for groups the checkpoint did not have); into a
# whole replica every rank reads the whole state out of DCP (it was refused before the workers
# started, and by every worker before that).
SHARDS_RESUMES = [
    Resume("tensor", "fsdp", "sgd"),
    Resume("fsdp", "ddp", "sgd"),
    Resume("tensor", "ddp", "sgd"),
]

# train.precision: the strategies that compute one process's numbers in mixed precision.
MIXED_PRECISIONS = ["bf16-mixed", "fp16-mixed"]
MIXED_PRECISION_STRATEGIES = ["ddp", "fsdp", "gpipe"]

# train.activation_checkpointing: (strategy, mode); each strategy's "none" is the reference.
ACTIVATION_CHECKPOINTING = [
    ("ddp", "none"),
    ("ddp", "full"),
    ("ddp", "every:2"),
    ("fsdp", "none"),
    ("fsdp", "full"),
]

# comm.compression: the strategies whose gradient sync compresses, and those that refuse it.
COMPRESSING = ["ddp", "allreduce"]
NOT_COMPRESSING = ["fsdp", "pipeline", "tensor"]


def cases(rows: list[Resume]) -> list[object]:
    """``rows`` as pytest parameters, each named by its strategies."""
    return [pytest.param(row, id=row.id) for row in rows]
