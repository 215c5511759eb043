"""DDP gives the training math of one process: equal parameters, not just similar losses."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tests.conftest import tiny_raw
from tests.dist_helpers import train_params
from tests.ranks import run_ranks


def assert_params_close(
    a: dict[str, np.ndarray], b: dict[str, np.ndarray], rtol: float = 1e-5, atol: float = 1e-6
) -> None:
    assert a.keys() == b.keys()
    for key in a:
        np.testing.assert_allclose(a[key], b[key], rtol=rtol, atol=atol, err_msg=key)


def test_two_ranks_equal_one_process_with_the_same_global_batch(
    tmp_path: Path, one_process: dict[str, np.ndarray]
) -> None:
    # 2 ranks x per-rank batch 4 against 1 process x batch 8, 20 steps.
    single = one_process
    pair = run_ranks(train_params, 2, tiny_raw(tmp_path / "two"))
    assert_params_close(pair[0], pair[1], rtol=0, atol=0)  # replicas stay identical
    assert_params_close(single, pair[0])
    # ... and training did move the parameters.
    initial = run_ranks(train_params, 1, tiny_raw(tmp_path / "zero", train={"steps": 1}))[0]
    assert max(np.abs(single[k] - initial[k]).max() for k in single) > 1e-3


@pytest.mark.parametrize("micro_batches", [2, 4])
def test_accumulation_equals_one_large_batch(
    tmp_path: Path, one_process: dict[str, np.ndarray], micro_batches: int
) -> None:
    big = one_process
    accumulated = run_ranks(
        train_params,
        1,
        tiny_raw(tmp_path / "acc", data={"global_batch_size": 8, "micro_batches": micro_batches}),
    )[0]
    assert_params_close(big, accumulated)


def test_accumulation_on_two_ranks_equals_one_process(
    tmp_path: Path, one_process: dict[str, np.ndarray]
) -> None:
    single = one_process
    pair = run_ranks(
        train_params,
        2,
        tiny_raw(tmp_path / "two", data={"global_batch_size": 8, "micro_batches": 2}),
    )
    assert_params_close(single, pair[0])


def test_uneven_split_is_exact(tmp_path: Path) -> None:
    # A global batch of 7 on 2 ranks: 4 + 3 samples. Normalizing by the global item count
    # keeps the update equal to one process's mean over all 7.
    data = {"global_batch_size": 7}
    single = run_ranks(train_params, 1, tiny_raw(tmp_path / "one", data=data))[0]
    pair = run_ranks(train_params, 2, tiny_raw(tmp_path / "two", data=data))
    assert_params_close(single, pair[0])


def test_token_balanced_variable_lengths_are_exact(tmp_path: Path) -> None:
    task = {"variable": True, "seq_len": 32}
    single = run_ranks(train_params, 1, tiny_raw(tmp_path / "one", task=task))[0]
    pair = run_ranks(train_params, 2, tiny_raw(tmp_path / "two", task=task))
    assert_params_close(single, pair[0])
