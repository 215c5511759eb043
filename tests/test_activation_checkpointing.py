"""train.activation_checkpointing: blocks recomputed in backward give the same numbers, bit for
bit (dropout included), keep less for backward, and keep their parameters' names."""

from __future__ import annotations

import types
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from dtrain.compute.precision import Precision
from dtrain.config import parse_activation_checkpointing
from dtrain.errors import ConfigError, UserError
from dtrain.models.gpt import GPT, GPTConfig
from dtrain.parallel.recipe import Recipe, _checkpointed_forward, model_blocks
from dtrain.task import Task
from tests.conftest import tiny_raw
from tests.matrix import ACTIVATION_CHECKPOINTING, STRATEGIES
from tests.ranks import run_ranks
from tests.recipe_helpers import train_each


def is_checkpointed(module: nn.Module) -> bool:
    forward = module.__dict__.get("forward")
    return isinstance(forward, types.MethodType) and forward.__func__ is _checkpointed_forward


def saved_bytes(model: nn.Module, tokens: torch.Tensor) -> int:
    """Bytes of the tensors a forward keeps for backward (parameters included once)."""
    seen: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        seen[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(tokens).sum().backward()
    return sum(seen.values())


def test_the_option_s_values() -> None:
    assert [parse_activation_checkpointing(v) for v in ("none", "full", "every:3")] == [0, 1, 3]
    for bad in ("every:0", "every:", "some", "every:-1"):
        with pytest.raises(ConfigError, match=r"train\.activation_checkpointing"):
            parse_activation_checkpointing(bad)


def test_checkpointed_blocks_keep_less_and_keep_their_names() -> None:
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, seq_len=64, n_layer=4, n_head=2, d_model=64))
    tokens = torch.randint(0, 64, (8, 64))
    names = list(model.state_dict())
    plain = saved_bytes(model, tokens)
    fp32 = Precision("fp32", torch.device("cpu"))
    Recipe(fp32, checkpoint_every=2).apply(model.blocks)
    assert [is_checkpointed(b) for b in model.blocks] == [True, False, True, False]
    every_other = saved_bytes(model, tokens)
    Recipe(fp32, checkpoint_every=1).apply(model.blocks)
    full = saved_bytes(model, tokens)
    assert full < every_other < plain
    assert list(model.state_dict()) == names


def test_a_model_without_blocks_is_a_one_line_error() -> None:
    model = nn.Sequential(nn.Linear(2, 4), nn.Linear(4, 2))
    task = Task(model=model, train_data=[], loss_fn=lambda o, t: o)
    with pytest.raises(UserError, match=r"^train.activation_checkpointing: cannot find") as err:
        model_blocks(task, model, "train.activation_checkpointing")
    # It said "to shard one by one" under ddp, where nothing is sharded.
    assert "shard one by one" not in str(err.value)


def test_checkpointed_training_is_bit_identical_with_dropout(tmp_path: Path) -> None:
    runs = ACTIVATION_CHECKPOINTING
    configs = [
        tiny_raw(
            tmp_path / f"{strategy}-{mode.replace(':', '')}",
            task={"dropout": 0.1},
            strategy=STRATEGIES[strategy],
            train={"activation_checkpointing": mode, "steps": 8},
        )
        for strategy, mode in runs
    ]
    out = run_ranks(train_each, 2, configs)[0]
    by_run = dict(zip(runs, out))
    for strategy, mode in runs:
        reference = by_run[(strategy, "none")]
        result = by_run[(strategy, mode)]
        assert result["losses"] == reference["losses"], (strategy, mode)
        for key, value in reference["params"].items():
            assert np.array_equal(result["params"][key], value), (strategy, mode, key)
