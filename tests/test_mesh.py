"""Composable parallelism over one mesh: hybrid sharding (replicate x shard), FSDP x tensor
parallelism and pipeline x tensor parallelism on 4 ranks train as one process does, and a run
saved at one layout resumes at another."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from dtrain.config import validate_strategy
from dtrain.config.layout import ParallelDims, fit_dims
from dtrain.errors import ConfigError
from tests.conftest import tiny_config, tiny_raw
from tests.dist_helpers import crash_then_resume, train_params
from tests.pipeline_helpers import train_and_report
from tests.ranks import run_ranks
from tests.test_ddp import assert_params_close

DATA = {"global_batch_size": 8, "micro_batches": 2}
HSDP = {"name": "fsdp", "dp_replicate": 2}
FSDP_TP = {"name": "fsdp", "tensor_parallel": 2}
PP_TP = {
    "name": "pipeline",
    "pipeline_stages": 2,
    "tensor_parallel": 2,
    "pipeline_balance": "uniform",
    "pipeline_schedule": "gpipe",
}


def test_ranks_lie_on_the_mesh_tensor_parallel_innermost() -> None:
    dims = ParallelDims(dp_shard=2, pp=2, tp=2)
    assert [dims.coords(r)["tp"] for r in range(8)] == [0, 1] * 4
    assert [dims.coords(r)["pp"] for r in range(8)] == [0, 0, 1, 1] * 2
    assert [dims.dp_rank(r) for r in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert all(dims.rank_of(**dims.coords(r)) == r for r in range(8))
    assert ParallelDims(dp_replicate=2, dp_shard=2).describe() == "dp_replicate 2 x dp_shard 2"
    hybrid = fit_dims(8, "dp_shard", tp=("t", 2), dp_replicate=("r", 2))
    assert hybrid == ParallelDims(dp_replicate=2, dp_shard=2, tp=2)


def test_a_mesh_that_does_not_fit_the_world_is_a_config_error() -> None:
    def validate(world: int, **strategy: object) -> None:
        cfg = tiny_config(Path("/nonexistent"), strategy=strategy, data=DATA)
        validate_strategy(cfg, world)

    with pytest.raises(ConfigError, match=r"tensor_parallel = 3 does not divide the world size"):
        validate(4, name="fsdp", tensor_parallel=3)
    with pytest.raises(ConfigError, match=r"dp_replicate = 4 does not divide the 2 ranks left"):
        validate(4, name="fsdp", tensor_parallel=2, dp_replicate=4)
    with pytest.raises(ConfigError, match=r"dp_replicate = 2 needs strategy.data_parallel"):
        validate(4, name="tensor", tensor_parallel=2, dp_replicate=2)
    with pytest.raises(ConfigError, match=r"dp_replicate = 2 does not work with .*'ddp'"):
        validate(4, name="ddp", dp_replicate=2)


@pytest.mark.parametrize(
    "strategy",
    [HSDP, FSDP_TP, PP_TP],
    ids=["replicate2xshard2", "shard2xtp2", "pp2xtp2"],
)
def test_composed_layouts_train_as_one_process(tmp_path: Path, strategy: dict[str, Any]) -> None:
    single = run_ranks(train_and_report, 1, tiny_raw(tmp_path / "one", data=DATA))[0]
    ranks = run_ranks(
        train_and_report, 4, tiny_raw(tmp_path / "mesh", data=DATA, strategy=strategy)
    )
    assert_params_close(single["params"], ranks[0]["params"], rtol=1e-5, atol=1e-6)
    for rank in ranks:
        assert rank["val_loss"] == pytest.approx(single["val_loss"], rel=1e-5)
    assert ranks[0]["logits"] is not None  # the whole model on rank 0 after training
    # Each rank holds a part: less than the whole model.
    total = sum(v.nbytes for k, v in single["params"].items() if k != "head.weight")
    assert all(rank["param_bytes"] < total for rank in ranks)


def test_a_run_saved_at_one_layout_resumes_at_another(tmp_path: Path) -> None:
    # Hybrid sharding saves step 4; FSDP x tensor parallelism resumes it and finishes: the
    # same parameters as hybrid sharding all the way (DCP reshards by the full names).
    job = {"train": {"steps": 8}, "checkpoint": {"every": 4}}  # SGD with momentum state
    straight = run_ranks(
        train_params, 4, tiny_raw(tmp_path / "straight", data=DATA, strategy=HSDP, **job)
    )[0]
    saved = tiny_raw(tmp_path / "moved", data=DATA, strategy=HSDP, **job)
    moved = tiny_raw(tmp_path / "moved", data=DATA, strategy=FSDP_TP, **job)
    resumed = run_ranks(crash_then_resume, 4, saved, 6, moved)[0]
    assert resumed["start_step"] == 4
    assert_params_close(straight, resumed["params"], rtol=1e-5, atol=1e-6)
