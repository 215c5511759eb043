"""Tensor parallelism on gloo: the training math of one process, and clear errors."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from torch import nn

from dtrain.config import validate_strategy
from dtrain.errors import ConfigError
from dtrain.models.gpt import GPT, GPTConfig
from dtrain.parallel.tensor_plan import check_no_dropout, model_plan
from tests.conftest import tiny_config, tiny_raw
from tests.dist_helpers import crash_then_resume, train_params
from tests.matrix import SHARDS_RESUMES, Resume, cases
from tests.pipeline_helpers import train_and_report
from tests.ranks import run_ranks
from tests.test_cross_form import resume_equals_unchanged
from tests.test_ddp import assert_params_close
from tests.test_fault import assert_bit_equal

DATA = {"global_batch_size": 8, "micro_batches": 2}


def test_two_way_tensor_parallel_equals_one_process(tmp_path: Path) -> None:
    one = tiny_raw(tmp_path / "one", data=DATA)
    single: dict[str, Any] = run_ranks(train_and_report, 1, one)[0]
    ranks = run_ranks(
        train_and_report, 2, tiny_raw(tmp_path / "tp", data=DATA, strategy={"name": "tensor"})
    )
    assert ranks[1]["params"] == {}
    assert_params_close(single["params"], ranks[0]["params"], rtol=1e-5, atol=1e-6)
    assert ranks[0]["val_loss"] == pytest.approx(single["val_loss"], rel=1e-5)
    np.testing.assert_allclose(ranks[0]["logits"], single["logits"], rtol=1e-4, atol=1e-5)
    # The cut weights (attention and MLP) are halved; embeddings and norms are replicated.
    total = sum(v.nbytes for k, v in single["params"].items() if k != "head.weight")
    cut = sum(
        v.nbytes
        for k, v in single["params"].items()
        if any(part in k for part in ("attn.qkv", "attn.proj.weight", "mlp.0", "mlp.2.weight"))
    )
    assert ranks[0]["param_bytes"] == ranks[1]["param_bytes"] == total - cut // 2


def test_the_degree_must_divide_the_world_and_the_model() -> None:
    cfg = tiny_config(Path("/nonexistent"), strategy={"name": "tensor", "tensor_parallel": 3})
    with pytest.raises(ConfigError, match=r"tensor_parallel = 3 does not divide the world size 4"):
        validate_strategy(cfg, 4)
    gpt = GPT(GPTConfig(vocab_size=64, seq_len=16, n_layer=2, n_head=2, d_model=32))
    with pytest.raises(ConfigError, match=r"n_head = 2 .* multiples of the tensor-parallel"):
        model_plan(gpt, 4)
    with pytest.raises(ConfigError, match=r"cannot split Sequential: expected a model with a"):
        model_plan(nn.Sequential(nn.Linear(2, 2)), 2)
    with pytest.raises(ConfigError, match=r"needs a model without dropout, but drop drops p = 0.1"):
        check_no_dropout(GPT(GPTConfig(vocab_size=64, seq_len=16, n_layer=1, dropout=0.1)))


def test_checkpoint_resume_is_bit_identical(tmp_path: Path) -> None:
    sections: dict[str, dict[str, object]] = {
        "strategy": {"name": "tensor"},
        "train": {"steps": 12, "log_every": 1},
        "checkpoint": {"every": 4},
        "optim": {"name": "adamw", "lr": 3e-3, "warmup_steps": 2},
    }
    reference = run_ranks(train_params, 2, tiny_raw(tmp_path / "ref", data=DATA, **sections))
    crashed = run_ranks(
        crash_then_resume, 2, tiny_raw(tmp_path / "crash", data=DATA, **sections), 7
    )
    assert crashed[0]["start_step"] == 4
    assert_bit_equal(reference[0], crashed[0]["params"])


@pytest.mark.parametrize("row", cases(SHARDS_RESUMES))
def test_a_sharded_checkpoint_resumes_under_another_strategy(tmp_path: Path, row: Resume) -> None:
    # SGD's momentum buffers carried over (lost, the parameters differ by ~lr x momentum).
    resume_equals_unchanged(tmp_path, row)


def test_a_sharded_checkpoint_resumes_under_diloco(tmp_path: Path) -> None:
    # diloco's anchor, from a checkpoint without its outer state, is the model every rank
    # read: from shards there is no model.pt to read it from (it was a CheckpointError).
    sections: dict[str, dict[str, object]] = {
        "train": {"steps": 4, "log_every": 1},
        "checkpoint": {"every": 2},
    }
    saved = tiny_raw(tmp_path / "run", data=DATA, strategy={"name": "fsdp"}, **sections)
    resumed = tiny_raw(tmp_path / "run", data=DATA, strategy={"name": "diloco"}, **sections)
    ranks = run_ranks(crash_then_resume, 2, saved, 3, resumed)
    assert ranks[0]["start_step"] == 2
    assert_params_close(ranks[0]["params"], ranks[1]["params"], rtol=0, atol=0)
