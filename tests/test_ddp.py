"""DDP gives the training math of one process: equal parameters, not just similar losses."""

from __future__ import annotations

import numpy as np
import pytest

from dtrain.testing import run_ranks
from tests.conftest import tiny_raw
from tests.recipe_helpers import train_each


def assert_params_close(
    a: dict[str, np.ndarray], b: dict[str, np.ndarray], rtol: float = 1e-5, atol: float = 1e-6
) -> None:
    assert a.keys() == b.keys()
    for key in a:
        np.testing.assert_allclose(a[key], b[key], rtol=rtol, atol=atol, err_msg=key)


# Every run the tests below compare, by name: (ranks, the config's sections). The runs of
# each world size train one after another in one launch (tests.recipe_helpers.train_each):
# two starts of the ranks for the module instead of one or two per test.
RUNS: dict[str, tuple[int, dict[str, dict[str, object]]]] = {
    "zero": (1, {"train": {"steps": 1}}),  # where training starts from
    "two": (2, {}),  # 2 ranks x per-rank batch 4 against 1 process x batch 8, 20 steps
    "acc-2": (1, {"data": {"global_batch_size": 8, "micro_batches": 2}}),
    "acc-4": (1, {"data": {"global_batch_size": 8, "micro_batches": 4}}),
    "two-acc": (2, {"data": {"global_batch_size": 8, "micro_batches": 2}}),
    # A global batch of 7 on 2 ranks: 4 + 3 samples.
    "uneven-one": (1, {"data": {"global_batch_size": 7}}),
    "uneven-two": (2, {"data": {"global_batch_size": 7}}),
    "variable-one": (1, {"task": {"variable": True, "seq_len": 32}}),
    "variable-two": (2, {"task": {"variable": True, "seq_len": 32}}),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict[str, np.ndarray]]]:
    """Each run's final parameters on every rank, by the run's name."""
    root = tmp_path_factory.mktemp("ddp")
    out: dict[str, list[dict[str, np.ndarray]]] = {}
    for world in (1, 2):
        names = [name for name, (ranks, _) in RUNS.items() if ranks == world]
        raws = [tiny_raw(root / name, **RUNS[name][1]) for name in names]
        by_rank = run_ranks(train_each, world, raws)
        for index, name in enumerate(names):
            out[name] = [rank[index]["params"] for rank in by_rank]
    return out


def test_two_ranks_equal_one_process_with_the_same_global_batch(
    runs: dict[str, list[dict[str, np.ndarray]]], one_process: dict[str, np.ndarray]
) -> None:
    single = one_process
    pair = runs["two"]
    assert_params_close(pair[0], pair[1], rtol=0, atol=0)  # replicas stay identical
    assert_params_close(single, pair[0])
    # ... and training did move the parameters.
    initial = runs["zero"][0]
    assert max(np.abs(single[k] - initial[k]).max() for k in single) > 1e-3


@pytest.mark.parametrize("micro_batches", [2, 4])
def test_accumulation_equals_one_large_batch(
    runs: dict[str, list[dict[str, np.ndarray]]],
    one_process: dict[str, np.ndarray],
    micro_batches: int,
) -> None:
    big = one_process
    accumulated = runs[f"acc-{micro_batches}"][0]
    assert_params_close(big, accumulated)


def test_accumulation_on_two_ranks_equals_one_process(
    runs: dict[str, list[dict[str, np.ndarray]]], one_process: dict[str, np.ndarray]
) -> None:
    single = one_process
    pair = runs["two-acc"]
    assert_params_close(single, pair[0])


def test_uneven_split_is_exact(runs: dict[str, list[dict[str, np.ndarray]]]) -> None:
    # Normalizing by the global item count keeps the update of 4 + 3 samples equal to one
    # process's mean over all 7.
    single = runs["uneven-one"][0]
    pair = runs["uneven-two"]
    assert_params_close(single, pair[0])


def test_token_balanced_variable_lengths_are_exact(
    runs: dict[str, list[dict[str, np.ndarray]]],
) -> None:
    single = runs["variable-one"][0]
    pair = runs["variable-two"]
    assert_params_close(single, pair[0])
