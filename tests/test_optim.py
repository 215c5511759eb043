"""The optimizer built from the config: which parameters take weight decay, and that sharing
one group when none do changes nothing but the number of kernel launches."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from dtrain.compute.optim import build_optimizer
from dtrain.config import OptimConfig
from tests.conftest import tiny_config, tiny_raw
from tests.dist_helpers import crash_then_resume, train_params
from tests.processes import metrics_records
from tests.ranks import run_ranks
from tests.recipe_helpers import train_each
from tests.test_ddp import assert_params_close


def small_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.LayerNorm(16), nn.Linear(16, 4))


def train(model: nn.Module, optimizer: torch.optim.Optimizer, steps: int = 5) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x = torch.randn(32, 8, generator=generator)
        model(x).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return [p.detach().clone() for p in model.parameters()]


def two_groups(params: Iterable[nn.Parameter], weight_decay: float = 0.0) -> list[dict[str, Any]]:
    """dtrain's groups before they could be one: matrices (with ``weight_decay``) first, then
    biases and norms without."""
    params = [p for p in params if p.requires_grad]
    return [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]


def two_groups_as_before(
    named_params: Iterable[tuple[str, nn.Parameter]], cfg: OptimConfig
) -> torch.optim.Optimizer:
    """The AdamW of a dtrain before one group (``build_optimizer``'s signature)."""
    groups = two_groups((p for _, p in named_params), cfg.weight_decay)
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.betas[0], cfg.betas[1]), foreach=True)


def test_weight_decay_goes_to_matrices_only() -> None:
    model = small_model()
    optimizer = build_optimizer(model.named_parameters(), OptimConfig(weight_decay=0.1))
    decays = {
        id(p): group["weight_decay"] for group in optimizer.param_groups for p in group["params"]
    }
    for name, param in model.named_parameters():
        assert decays[id(param)] == (0.1 if param.dim() >= 2 else 0.0), name


@pytest.mark.parametrize("name", ["adamw", "sgd"])
def test_without_weight_decay_one_group_trains_bit_identically_to_two(name: str) -> None:
    cfg = OptimConfig(name=name, weight_decay=0.0, lr=1e-2)
    one = small_model()
    optimizer = build_optimizer(one.named_parameters(), cfg)
    assert len(optimizer.param_groups) == 1
    two = small_model()
    reference: torch.optim.Optimizer
    if name == "sgd":
        reference = torch.optim.SGD(two_groups(two.parameters()), lr=cfg.lr, momentum=cfg.momentum)
    else:
        reference = two_groups_as_before(two.named_parameters(), cfg)
    for a, b in zip(train(one, optimizer), train(two, reference), strict=True):
        assert torch.equal(a, b)
    # The state's indices follow the parameters in the same order as the split's (matrices
    # first), so a state dict of either layout names the same parameter by the same index.
    ours, theirs = optimizer.state_dict()["state"], reference.state_dict()["state"]
    assert ours.keys() == theirs.keys()
    for index in ours:
        for key, value in ours[index].items():
            assert torch.equal(value, theirs[index][key]), (index, key)


def test_a_state_of_other_groups_is_refused() -> None:
    model = small_model()
    optimizer = build_optimizer(model.named_parameters(), OptimConfig(weight_decay=0.0))
    saved = torch.optim.AdamW(two_groups(small_model().parameters(), 0.1)).state_dict()
    with pytest.raises(ValueError, match="parameter groups"):
        optimizer.load_state_dict(saved)


@pytest.mark.parametrize("name", ["adamw", "sgd"])
def test_fused_kernels_compute_foreach_s_update_to_the_last_bits(name: str) -> None:
    kinds = ("foreach", "fused")
    cfgs = [OptimConfig(name=name, implementation=kind) for kind in kinds]  # type: ignore[arg-type]
    trained = []
    for cfg in cfgs:
        model = small_model()
        trained.append(train(model, build_optimizer(model.named_parameters(), cfg), steps=20))
    optimizer = build_optimizer(small_model().named_parameters(), cfgs[1])
    assert all(group["fused"] for group in optimizer.param_groups)
    for foreach, fused in zip(*trained):
        torch.testing.assert_close(fused, foreach, rtol=1e-5, atol=1e-6)


def test_fused_kernels_train_each_strategy_as_foreach_does(tmp_path: Path) -> None:
    # Plain tensors (ddp), DTensor shards (fsdp), DTensor cuts beside plain tensors (tensor).
    strategies = ["ddp", "fsdp", "tensor"]
    configs = [
        tiny_raw(
            tmp_path / f"{strategy}-{kind}",
            strategy={"name": strategy},
            optim={"name": "adamw", "lr": 3e-3, "implementation": kind},
            train={"steps": 8, "log_every": 1},
        )
        for strategy in strategies
        for kind in ("foreach", "fused")
    ]
    results = iter(run_ranks(train_each, 2, configs)[0])
    for strategy in strategies:
        foreach, fused = next(results), next(results)
        steps = sorted(foreach["losses"])
        assert sorted(fused["losses"]) == steps and len(steps) == 8, strategy
        losses = [[result["losses"][step] for step in steps] for result in (foreach, fused)]
        np.testing.assert_allclose(losses[1], losses[0], rtol=1e-5, err_msg=strategy)
        # AdamW divides by the gradient's own scale: a gradient that is roundoff only (the
        # attention's key bias, which softmax ignores) moves its weight by up to lr a step, in
        # a direction the last bit picks (measured: 4.3e-6 after 8 steps at lr 3e-3).
        assert_params_close(fused["params"], foreach["params"], rtol=1e-5, atol=1e-5)


def test_a_fused_run_resumes_bit_identically(tmp_path: Path) -> None:
    job = {"strategy": {"name": "fsdp"}, "optim": {"name": "adamw", "implementation": "fused"}}
    job["checkpoint"] = {"every": 4}
    straight = run_ranks(train_params, 2, tiny_raw(tmp_path / "straight", job, train={"steps": 8}))
    crashed = tiny_raw(tmp_path / "crash", job, train={"steps": 8})
    resumed = run_ranks(crash_then_resume, 2, crashed, 6)
    assert resumed[0]["start_step"] == 4
    for key, value in straight[0].items():
        assert np.array_equal(value, resumed[0]["params"][key]), key


@pytest.mark.parametrize(
    "strategy",
    [{"name": "fsdp"}, {"name": "tensor"}, {"name": "pipeline", "data_parallel": "fsdp"}],
)
def test_fused_sgd_on_sharded_parameters_is_a_config_error(
    tmp_path: Path, strategy: dict[str, Any]
) -> None:
    from dtrain.config import validate_strategy
    from dtrain.errors import ConfigError

    optim = {"name": "sgd", "implementation": "fused"}
    sharded = tiny_config(tmp_path / "run", strategy=strategy, optim=optim)
    with pytest.raises(ConfigError, match="torch has no fused SGD for the sharded parameters"):
        validate_strategy(sharded, 2)
    plain = tiny_config(tmp_path / "run", strategy={"name": "ddp"}, optim=optim)
    validate_strategy(plain, 2)  # plain tensors: fine


@pytest.mark.parametrize("name", ["adamw", "sgd"])
@pytest.mark.parametrize("saved_with", ["foreach", "fused"])
def test_a_loaded_state_keeps_the_configured_kernels(name: str, saved_with: str) -> None:
    # torch's load_state_dict takes the saved groups' settings whole, fused and foreach too.
    chosen = "fused" if saved_with == "foreach" else "foreach"
    model = small_model()
    cfgs = [OptimConfig(name=name, implementation=kind) for kind in (saved_with, chosen)]  # type: ignore[arg-type]
    saving = build_optimizer(model.named_parameters(), cfgs[0])
    train(model, saving, steps=1)
    loading = build_optimizer(model.named_parameters(), cfgs[1])
    loading.load_state_dict(saving.state_dict())
    fresh = build_optimizer(model.named_parameters(), cfgs[1])
    for key in ("foreach", "fused"):
        assert [group[key] for group in loading.param_groups] == [
            group[key] for group in fresh.param_groups
        ], key


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_a_forced_resume_trains_with_the_configured_settings(tmp_path: Path, strategy: str) -> None:
    # A run resumed under another optim.* (--force) went on with the checkpoint's kernels,
    # betas and rate: torch's load_state_dict takes the saved groups whole, the schedule its
    # saved base rate. ddp: whole files; fsdp: DCP's set_optimizer_state_dict.
    job: dict[str, Any] = {
        "checkpoint": {"every": 2},
        "train": {"steps": 4, "log_every": 1},
        "strategy": {"name": strategy},
    }
    job["optim"] = {"name": "adamw", "lr": 3e-3, "schedule": "constant", "warmup_steps": 0}
    saved = tiny_raw(tmp_path / "run", job)
    changed = {"implementation": "fused", "lr": 1e-3, "betas": [0.8, 0.9], "weight_decay": 0.05}
    resumed = tiny_raw(tmp_path / "run", job, optim=changed)
    result = run_ranks(crash_then_resume, 2, saved, 3, resumed)[0]
    assert result["start_step"] == 2
    assert result["kernels"] and all(kernels == (None, True) for kernels in result["kernels"])
    for group in result["settings"]:
        assert group["lr"] == group["initial_lr"] == 1e-3
        assert group["betas"] == (0.8, 0.9)
        assert group["weight_decay"] in (0.05, 0.0)  # matrices decay, the rest not
    assert any(group["weight_decay"] == 0.05 for group in result["settings"])
    records = metrics_records(tmp_path / "run")
    rates = {r["step"]: r["lr"] for r in records if r.get("kind") == "train"}
    assert rates[1] == rates[2] == 3e-3  # before the crash
    assert rates[3] == rates[4] == 1e-3  # every resumed step at the configured rate


def test_a_loaded_schedule_takes_the_configured_rate_and_the_saved_position() -> None:
    # Under the same config a resume sets the very rate it saved (bit-identical); under
    # another optim.lr that rate at the saved position of the schedule.
    from dtrain.compute.optim import build_scheduler, lr_factor

    model = small_model()
    cfg = OptimConfig(name="sgd", lr=0.5, momentum=0.9, warmup_steps=2)
    saving = build_optimizer(model.named_parameters(), cfg)
    schedule = build_scheduler(saving, cfg, total_steps=10)
    for _ in range(5):
        train(model, saving, steps=1)
        schedule.step()
    for other in (cfg, OptimConfig(name="sgd", lr=0.1, momentum=0.5, warmup_steps=2)):
        loading = build_optimizer(model.named_parameters(), other)
        loaded = build_scheduler(loading, other, total_steps=10)
        loaded.load_state_dict(schedule.state_dict())  # the order of checkpoint.state.load
        loading.load_state_dict(saving.state_dict())
        rate = other.lr * lr_factor(5, 10, 2, other.min_lr_ratio, "cosine")
        groups = loading.param_groups
        assert len(groups) == 2  # matrices with weight decay, the rest without
        assert [group["lr"] for group in groups] == loaded.get_last_lr() == [rate, rate]
        assert loaded.base_lrs == [other.lr, other.lr]
        assert [group["momentum"] for group in groups] == [other.momentum, other.momentum]
        if other is cfg:  # the same bits as saved
            assert [group["lr"] for group in groups] == [g["lr"] for g in saving.param_groups]
        loaded.step()
        assert groups[0]["lr"] == other.lr * lr_factor(6, 10, 2, other.min_lr_ratio, "cosine")
