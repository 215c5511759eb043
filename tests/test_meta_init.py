"""Meta-device initialization: a model built on ``meta`` with ``Task.init_weights`` starts from
the same parameters under every strategy and world size, and each rank makes only its part."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from dtrain.config.load import build_config
from dtrain.data.shards import write_shards
from dtrain.errors import UserError
from dtrain.parallel.materialize import materialize, require_init
from dtrain.parallel.skeleton import meta_copy
from dtrain.tasks import gpt
from tests.conftest import tiny_raw
from tests.ranks import run_ranks
from tests.recipe_helpers import initial_state_each, set_up_peak_bytes, train_each
from tests.test_ddp import assert_params_close

META = {"meta_init": True}


def strategy_config(run_dir: Path, name: str, **options: Any) -> dict[str, Any]:
    if name == "pipeline":
        options.update(pipeline_balance="uniform", pipeline_schedule="gpipe")
    return tiny_raw(run_dir, task=META, strategy={"name": name, **options})


def test_every_strategy_and_world_size_starts_from_the_same_parameters(tmp_path: Path) -> None:
    (plain,) = run_ranks(initial_state_each, 1, [strategy_config(tmp_path / "one", "ddp")])[0]
    two = [
        strategy_config(tmp_path / "fsdp2", "fsdp"),
        strategy_config(tmp_path / "pp2", "pipeline"),
        strategy_config(tmp_path / "tp2", "tensor"),
        strategy_config(tmp_path / "ddp2", "allreduce"),
    ]
    four = [
        strategy_config(tmp_path / "fsdp4", "fsdp"),
        strategy_config(tmp_path / "pp2fsdp2", "pipeline", pipeline_stages=2, data_parallel="fsdp"),
        strategy_config(tmp_path / "tp2dp2", "tensor", tensor_parallel=2),
    ]
    states = run_ranks(initial_state_each, 2, two)[0] + run_ranks(initial_state_each, 4, four)[0]
    assert plain["head.weight"] is not None and np.array_equal(
        plain["head.weight"], plain["tok_emb.weight"]
    )  # tied, as the model built them
    for config, state in zip(two + four, states):
        assert state.keys() == plain.keys(), config["run"]["dir"]
        for key, value in plain.items():
            assert np.array_equal(state[key], value), (config["run"]["dir"], key)


def test_a_meta_built_model_trains_as_one_process_under_fsdp(tmp_path: Path) -> None:
    train = {"steps": 6}
    one = run_ranks(train_each, 1, [tiny_raw(tmp_path / "one", task=META, train=train)])[0][0]
    fsdp = tiny_raw(tmp_path / "fsdp", task=META, train=train, strategy={"name": "fsdp"})
    pair = run_ranks(train_each, 2, [fsdp])[0][0]
    assert_params_close(one["params"], pair["params"])


def test_each_rank_makes_only_its_part(tmp_path: Path) -> None:
    # A GPT of 16 M parameters (64 MB in float32): whole on one rank, a half or a quarter
    # of it on each of 2 or 4 FSDP ranks, while the model is made.
    task = {**META, "n_layer": 8, "d_model": 384, "seq_len": 16}
    peaks = {}
    for world in (1, 2, 4):
        name = "ddp" if world == 1 else "fsdp"
        config = tiny_raw(tmp_path / f"w{world}", task=task, strategy={"name": name})
        warm_up = tiny_raw(tmp_path / f"warm{world}", task=META, strategy={"name": name})
        peaks[world] = max(run_ranks(set_up_peak_bytes, world, config, warm_up))
    model_bytes = 16e6 * 4
    assert peaks[1] > 0.9 * model_bytes, peaks
    assert peaks[2] < 0.75 * peaks[1], peaks
    assert peaks[4] < 0.75 * peaks[2], peaks


class TwoLayers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(4, 8)
        self.second = nn.Linear(8, 2)
        self.register_buffer("offset", torch.zeros(2))


def test_what_init_leaves_unset_is_named() -> None:
    with torch.device("meta"):
        model = TwoLayers()

    def linear_only(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight)
            nn.init.zeros_(module.bias)

    with pytest.raises(UserError, match=r"Task\.init_weights left offset without values"):
        materialize(meta_copy(model), model, linear_only, torch.device("cpu"), seed=0)
    with pytest.raises(UserError, match=r"gives no Task\.init_weights"):
        require_init(model, None)


def test_run_init_from_fills_a_meta_built_model(tmp_path: Path) -> None:
    # The weights of a finished run, given to a meta-built model under fsdp: the new run
    # starts from exactly them (not from init_weights' values).
    first = tiny_raw(tmp_path / "first", train={"steps": 4})
    # And a plain run from them, which must say where its weights came from (it said "from
    # scratch"): its start line and start record name them.
    init = {"init_from": str(tmp_path / "first")}
    plain = tiny_raw(tmp_path / "plain", train={"steps": 1}, run=init)
    trained = run_ranks(train_each, 1, [first, plain])[0][0]["params"]
    records = map(json.loads, (tmp_path / "plain" / "metrics.jsonl").read_text().splitlines())
    assert [r["init_from"] for r in records if r["kind"] == "start"] == [init["init_from"]]
    second = tiny_raw(
        tmp_path / "second",
        task=META,
        strategy={"name": "fsdp"},
        run={"init_from": str(tmp_path / "first")},
    )
    (started,) = run_ranks(initial_state_each, 2, [second])[0]
    for key, value in trained.items():
        assert np.array_equal(started[key], value), key


def test_a_gpt_that_prints_no_samples_never_asks_for_the_whole_model(tmp_path: Path) -> None:
    # Task.after_training gets the whole model on rank 0, gathered from every rank's part: the
    # built-in GPT asks for it to print samples only, so with generate_tokens = 0 a meta-built
    # GPT larger than one rank never holds it whole (it did, after the final checkpoint).
    for split in ("train", "val"):
        write_shards([{"tokens": b"def f(x):\n    return x\n" * 4}] * 4, tmp_path / split)

    def built(tokens: int) -> Any:
        task = {"data_dir": str(tmp_path), "seq_len": 16, "n_layer": 1, "d_model": 32}
        raw = {
            "run": {"dir": str(tmp_path / "run"), "task": "dtrain.tasks.gpt:build"},
            "task": {**task, **META, "n_head": 2, "generate_tokens": tokens},
        }
        return gpt.build(build_config(raw, gpt.GPTTaskConfig))

    assert built(0).after_training is None
    assert built(8).after_training is not None
