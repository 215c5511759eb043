"""FSDP: the training math of one process; sharded checkpoints that reshard on load; its
options where nothing is sharded."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from dtrain.cli import main
from dtrain.config import validate_strategy
from dtrain.errors import ConfigError
from tests.conftest import tiny_config, tiny_raw
from tests.dist_helpers import load_full_state, save_and_full_state
from tests.ranks import run_ranks
from tests.test_ddp import assert_params_close


def test_fsdp_equals_one_process(tmp_path: Path, one_process: dict[str, np.ndarray]) -> None:
    single = one_process
    sharded = run_ranks(
        save_and_full_state, 2, tiny_raw(tmp_path / "fsdp", strategy={"name": "fsdp"})
    )
    assert sharded[1] == {}  # the full state is gathered to rank 0 only
    assert_params_close(single, sharded[0], rtol=1e-5, atol=1e-6)


def test_fsdp_accumulation_equals_one_process(
    tmp_path: Path, one_process: dict[str, np.ndarray]
) -> None:
    single = one_process
    sharded = run_ranks(
        save_and_full_state,
        2,
        tiny_raw(tmp_path / "fsdp", strategy={"name": "fsdp"}, data={"micro_batches": 2}),
    )
    assert_params_close(single, sharded[0], rtol=1e-5, atol=1e-6)


def test_checkpoint_saved_on_4_ranks_loads_on_2_and_1(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    fsdp = {"strategy": {"name": "fsdp"}, "optim": {"name": "adamw", "lr": 1e-3}}
    saved = run_ranks(save_and_full_state, 4, tiny_raw(run_dir, **fsdp))[0]
    files = sorted(p.name for p in (run_dir / "checkpoints/step-00000020/dcp").iterdir())
    assert files == [".metadata", "__0_0.distcp", "__1_0.distcp", "__2_0.distcp", "__3_0.distcp"]
    for world in (2, 1):
        loaded = run_ranks(load_full_state, world, tiny_raw(run_dir, **fsdp))
        for rank, rank_result in enumerate(loaded):
            assert rank_result["step"] == 20
            assert rank_result["consumed"] == 20 * 8
            assert rank_result["optimizer_steps"] == [20.0]
            if rank == 0:
                assert rank_result["params"].keys() == saved.keys()
                for key, value in saved.items():
                    assert np.array_equal(rank_result["params"][key], value), (world, key)


def test_backward_prefetch_off_without_fsdp_is_a_config_error(
    capsys: pytest.CaptureFixture[str],
) -> None:
    def validate(**strategy: object) -> None:
        cfg = tiny_config(Path("/nonexistent"), strategy={**strategy, "backward_prefetch": False})
        validate_strategy(cfg, 4)

    validate(name="fsdp")
    validate(name="tensor", tensor_parallel=2, data_parallel="fsdp")
    validate(name="pipeline", pipeline_stages=2, data_parallel="fsdp", pipeline_schedule="gpipe")
    for name in ("ddp", "allreduce", "localsgd", "diloco"):
        with pytest.raises(ConfigError, match=f"does not work with strategy.name = '{name}': "):
            validate(name=name)
    with pytest.raises(ConfigError, match="'tensor' and data_parallel = 'replicate'"):
        validate(name="tensor", tensor_parallel=2)
    # before any worker starts: one line, exit code 2
    args = ["train", "--nproc", "2", "--strategy.name=ddp", "--strategy.backward_prefetch=false"]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "strategy.backward_prefetch = false does not work" in err
