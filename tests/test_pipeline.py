"""Pipeline parallelism: the training math of one process, 2-D hybrids, checkpoints, and a
clear error for every input it cannot run."""

from __future__ import annotations

import datetime
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from dtrain.config import Config, validate_strategy
from dtrain.dist.runtime import Runtime
from dtrain.errors import ConfigError
from dtrain.fault.audit import AUDIT_DIR
from dtrain.models.gpt import GPT, GPTConfig
from dtrain.parallel.pipeline.batches import eval_chunks
from dtrain.parallel.pipeline.split import (
    StageChain,
    model_layers,
    prune_to_stages,
    stage_entries,
    tied_parameters,
)
from dtrain.parallel.pipeline.strategy import PipelineStrategy
from dtrain.task import Task
from tests.audit import check_stream, read_trajectory
from tests.conftest import tiny_config, tiny_raw
from tests.dist_helpers import crash_then_resume, train_params
from tests.pipeline_helpers import resume_only, train_and_report, train_and_report_each
from tests.ranks import run_ranks
from tests.test_ddp import assert_params_close
from tests.test_fault import assert_bit_equal

# 4 micro-batches of 2 samples: enough for 1F1B on 2 stages, and for 2 x 2 on 4 ranks.
DATA = {"global_batch_size": 8, "micro_batches": 4}


def pipeline(**options: object) -> dict[str, object]:
    return {"name": "pipeline", **options}


@pytest.fixture(scope="module")
def single(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One process, the same global batch (and micro-batches), 20 steps."""
    run_dir = tmp_path_factory.mktemp("single")
    result: dict[str, Any] = run_ranks(train_and_report, 1, tiny_raw(run_dir, data=DATA))[0]
    return result


def check_matches(single: dict[str, Any], ranks: list[dict[str, Any]]) -> None:
    assert all(r["params"] == {} for r in ranks[1:])  # gathered to rank 0 only
    assert_params_close(single["params"], ranks[0]["params"], rtol=1e-5, atol=1e-6)
    for r in ranks:  # every rank agrees on the losses
        assert r["val_loss"] == pytest.approx(single["val_loss"], rel=1e-5)
        assert r["train_loss"] == pytest.approx(single["train_loss"], rel=1e-5)
    # The after-training hook gets the whole trained model on rank 0.
    np.testing.assert_allclose(ranks[0]["logits"], single["logits"], rtol=1e-4, atol=1e-5)
    assert all("logits" not in r for r in ranks[1:])


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_two_stages_equal_one_process(
    single: dict[str, Any], tmp_path: Path, schedule: str
) -> None:
    ranks = run_ranks(
        train_and_report,
        2,
        tiny_raw(tmp_path, data=DATA, strategy=pipeline(pipeline_schedule=schedule)),
    )
    check_matches(single, ranks)
    # Boundaries from layer times measured on each rank, averaged: the same plan everywhere.
    assert ranks[0]["bounds"] == ranks[1]["bounds"] and len(ranks[0]["bounds"]) == 3
    # Each stage holds part of the model: together all of it, the tied weight on both ends.
    total = sum(v.nbytes for v in single["params"].values())
    assert ranks[0]["param_bytes"] < total and ranks[1]["param_bytes"] < total
    assert ranks[0]["param_bytes"] + ranks[1]["param_bytes"] == total


def test_interleaved_1f1b_two_chunks_per_rank(single: dict[str, Any], tmp_path: Path) -> None:
    # The tiny GPT has 4 layers (embeddings, 2 blocks, head): 4 stages, 2 on each rank.
    strategy = pipeline(pipeline_schedule="interleaved-1f1b", pipeline_virtual_stages=2)
    ranks = run_ranks(train_and_report, 2, tiny_raw(tmp_path, data=DATA, strategy=strategy))
    check_matches(single, ranks)


def test_data_parallel_x_pipeline_on_4_ranks(single: dict[str, Any], tmp_path: Path) -> None:
    strategy = pipeline(pipeline_stages=2, pipeline_schedule="1f1b", pipeline_balance="uniform")
    audit = {"audit_sample_ids": True}
    config = tiny_raw(tmp_path, data=DATA, strategy=strategy, fault=audit)
    ranks = run_ranks(train_and_report, 4, config)
    check_matches(single, ranks)
    assert [r["dp"] for r in ranks] == [(0, 2), (0, 2), (1, 2), (1, 2)]
    # The two copies of a stage hold the same parameters.
    assert ranks[0]["param_bytes"] == ranks[2]["param_bytes"]
    # The sample-id audit checks a pipeline run: each replica's ids are written once, by its
    # first stage (every stage wrote them, and the check found twice the ids of each step).
    files = sorted(path.name for path in (tmp_path / AUDIT_DIR).iterdir())
    assert files == ["rank00000.jsonl", "rank00002.jsonl"]
    result = check_stream(read_trajectory(tmp_path), num_samples=256)
    assert result.steps == 20 and result.positions == 20 * 8 and result.exactly_once, result


def test_fsdp_x_pipeline_on_4_ranks(single: dict[str, Any], tmp_path: Path) -> None:
    strategy = pipeline(pipeline_stages=2, pipeline_balance="uniform", data_parallel="fsdp")
    no_prefetch = {**strategy, "backward_prefetch": False}
    no_reshard = {**strategy, "reshard_after_forward": False}
    raws = [
        tiny_raw(tmp_path / "default", data=DATA, strategy=strategy),
        tiny_raw(tmp_path / "no-prefetch", data=DATA, strategy=no_prefetch),
        tiny_raw(tmp_path / "no-reshard", data=DATA, strategy=no_reshard),
    ]
    each = run_ranks(train_and_report_each, 4, raws)
    ranks = [rank[0] for rank in each]
    check_matches(single, ranks)
    # Without FSDP's backward prefetch (strategy.backward_prefetch = false), or without
    # resharding after forward (strategy.reshard_after_forward = false), each of which reached
    # every unit of every stage: the same parameters, bit for bit.
    assert_bit_equal(ranks[0]["params"], each[0][1]["params"])
    assert_bit_equal(ranks[0]["params"], each[0][2]["params"])
    for default, off, kept in each:
        assert default["prefetch"] and set(default["prefetch"]) == {"default"}
        assert off["prefetch"] == ["itself"] * len(default["prefetch"])
        assert True in default["reshard"]  # the layers (torch keeps a root's gathered)
        assert kept["reshard"] == [False] * len(default["reshard"])
    # Each stage's parameters are sharded over its 2 copies: half of a 2-stage rank's bytes.
    total = sum(v.nbytes for v in single["params"].values())
    assert sum(r["param_bytes"] for r in ranks) == total


def test_one_stage_x_fsdp_shards_the_tied_layers_with_the_stage(
    single: dict[str, Any], tmp_path: Path
) -> None:
    # One stage holds the GPT's tied embedding and head: FSDP failed at set-up ("shared with a
    # parameter already managed by another FSDP group") when each layer became its own unit.
    strategy = pipeline(pipeline_stages=1, data_parallel="fsdp")
    ranks = run_ranks(train_and_report, 2, tiny_raw(tmp_path, data=DATA, strategy=strategy))
    check_matches(single, ranks)


def test_checkpoint_resume_is_bit_identical(tmp_path: Path) -> None:
    sections: dict[str, dict[str, object]] = {
        "strategy": pipeline(pipeline_schedule="1f1b", pipeline_balance="uniform"),
        "train": {"steps": 12, "log_every": 1},
        "checkpoint": {"every": 4},
        "optim": {"name": "adamw", "lr": 3e-3, "warmup_steps": 2},
        "task": {"dropout": 0.2},
    }
    reference = run_ranks(train_params, 2, tiny_raw(tmp_path / "ref", data=DATA, **sections))
    crashed = run_ranks(
        crash_then_resume, 2, tiny_raw(tmp_path / "crash", data=DATA, **sections), 7
    )
    assert crashed[0]["start_step"] == 4  # resumed from the checkpoint before the crash
    assert_bit_equal(reference[0], crashed[0]["params"])
    files = sorted(p.name for p in (tmp_path / "crash/checkpoints/step-00000012/dcp").iterdir())
    assert files == [".metadata", "__0_0.distcp", "__1_0.distcp"]  # one file set per stage
    # Keyed by the full model's names, it loads at another layout with the same stages:
    # 2 data-parallel copies of the 2 stages, each stage FSDP-sharded over its copies.
    sections["strategy"].update(pipeline_stages=2, data_parallel="fsdp")
    loaded = run_ranks(resume_only, 4, tiny_raw(tmp_path / "crash", data=DATA, **sections))[0]
    assert loaded["step"] == 12
    assert_bit_equal(reference[0], loaded["params"])


# -- bad input -------------------------------------------------------------------------------


def config(**strategy: object) -> Config:
    data = dict(DATA)
    data.update(strategy.pop("data", {}))  # type: ignore[call-overload]
    return tiny_config(Path("/nonexistent"), strategy=pipeline(**strategy), data=data)


def validate(world_size: int, **strategy: object) -> None:
    validate_strategy(config(**strategy), world_size)


def test_world_size_must_divide_into_the_mesh() -> None:
    with pytest.raises(ConfigError, match=r"pipeline_stages = 3 does not divide the world size 4"):
        validate(4, pipeline_stages=3)
    with pytest.raises(ConfigError, match=r"mesh's dimensions must multiply to the world size"):
        validate(4, pipeline_stages=3)
    with pytest.raises(ConfigError, match=r"pipeline_stages = 4 does not divide the 2 ranks left"):
        validate(4, pipeline_stages=4, tensor_parallel=2)
    validate(4, pipeline_stages=2)


def test_1f1b_needs_a_micro_batch_per_stage() -> None:
    with pytest.raises(ConfigError, match=r"data.micro_batches = 2 is fewer than the 4 pipeline"):
        validate(4, pipeline_schedule="1f1b", data={"micro_batches": 2, "global_batch_size": 8})
    validate(4, pipeline_schedule="gpipe", data={"micro_batches": 2, "global_batch_size": 8})


def test_global_batch_must_split_into_equal_micro_batches() -> None:
    with pytest.raises(ConfigError, match=r"global_batch_size = 10 does not split into 1 data"):
        validate(2, data={"global_batch_size": 10, "micro_batches": 4})


def test_manual_boundaries_are_checked() -> None:
    with pytest.raises(ConfigError, match=r"gives 3 stages, but the job has 2"):
        validate(2, pipeline_boundaries=[1, 2])
    with pytest.raises(ConfigError, match="strictly increasing"):
        validate(4, pipeline_boundaries=[1, 1, 2])


def fake_runtime(world_size: int) -> Runtime:
    return Runtime(
        rank=0,
        world_size=world_size,
        device=torch.device("cpu"),
        timeout=datetime.timedelta(seconds=10),
    )


def tiny_task(model: nn.Module) -> Task:
    return Task(model=model, train_data=[], loss_fn=lambda out, tgt: out)


def test_more_stages_than_layers_fails_before_any_communication() -> None:
    strategy = PipelineStrategy.from_config(config(), fake_runtime(8))  # 8 stages, 4 layers
    gpt = GPT(GPTConfig(vocab_size=64, seq_len=16, n_layer=2, n_head=2, d_model=32))
    with pytest.raises(ConfigError, match="8 pipeline stages, but GPT has only 4 layers"):
        strategy.setup(tiny_task(gpt))


def test_a_model_that_cannot_be_split_is_named() -> None:
    strategy = PipelineStrategy.from_config(config(), fake_runtime(2))
    with pytest.raises(ConfigError, match=r"cannot split Bilinear into stages: expected an nn"):
        strategy.setup(tiny_task(nn.Bilinear(2, 2, 2)))


# -- splitting, without processes ------------------------------------------------------------


def test_stages_keep_the_full_models_names_and_find_the_tied_weight() -> None:
    gpt = GPT(GPTConfig(vocab_size=64, seq_len=16, n_layer=2, n_head=2, d_model=32))
    full = dict(gpt.state_dict())
    layers = model_layers(gpt)
    chains = [StageChain(layers[:2]), StageChain(layers[2:])]
    kept = [stage_entries(gpt, [chain]) for chain in chains]
    (tied,) = tied_parameters(kept)
    assert tied.stages == (0, 1) and tied.fqns == ("tok_emb.weight", "head.weight")
    idx = torch.randint(0, 64, (2, 16))
    expected, hidden = gpt(idx), chains[0](idx)
    prune_to_stages(gpt, kept[1])
    names = set(gpt.state_dict())
    assert names == {k for k in full if k.startswith(("blocks.1.", "ln_f.", "head."))}
    assert torch.equal(chains[1](hidden), expected)  # the last stage still computes its part


def test_eval_batches_split_into_equal_micro_batches() -> None:
    assert eval_chunks(8, 4, 2, False) == 4
    assert eval_chunks(6, 4, 2, False) == 3
    assert eval_chunks(7, 4, 2, False) == 1
    assert eval_chunks(3, 8, 2, True) == 3


def test_stage_boundaries_manual_uniform_and_past_the_last_layer() -> None:
    from dtrain.parallel.pipeline.plan import choose_plan

    layers = model_layers(
        GPT(GPTConfig(vocab_size=64, seq_len=16, n_layer=4, n_head=2, d_model=32))
    )
    manual = choose_plan(config(pipeline_boundaries=[1, 5]).strategy, layers, 3, None)
    assert manual.bounds == (0, 1, 5, 6)
    uniform = choose_plan(config(pipeline_balance="uniform").strategy, layers, 4, None)
    assert uniform.bounds == (0, 2, 4, 5, 6)
    with pytest.raises(ConfigError, match=r"the model has only 6 layers"):
        choose_plan(config(pipeline_boundaries=[3, 6]).strategy, layers, 3, None)
