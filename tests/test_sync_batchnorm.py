"""``strategy.sync_batchnorm``: a small CNN with BatchNorm trains on 2 ranks as one process
does (ddp, allreduce, fsdp; gloo on CPU, where torch's SyncBatchNorm refuses to run), and
the val_loss a run reports is the saved model's, with or without the option. Without it the
ranks' BatchNorm normalizes over half the batch each: the same test then fails."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from dtrain.checkpoint.rng import seed_everything
from dtrain.config import validate_strategy
from dtrain.config.load import build_config
from dtrain.errors import ConfigError, UserError
from dtrain.parallel.sync_batchnorm import apply_sync_batchnorm
from dtrain.weights.init_from import load_weights
from tests.byo_tasks import CNNOptions, Images, SmallCNN, class_loss, cnn, reference_loop
from tests.dist_helpers import make_trainer, params_of
from tests.ranks import run_ranks

BATCH, STEPS, LR = 16, 6, 0.2


def cnn_raw(run_dir: Path, **sections: dict[str, Any]) -> dict[str, Any]:
    raw: dict[str, dict[str, Any]] = {
        "run": {"dir": str(run_dir), "task": "tests.byo_tasks:cnn", "seed": 0},
        "data": {"global_batch_size": BATCH, "prefetch": 0, "shuffle": "none"},
        "train": {"steps": STEPS, "log_every": 1, "grad_clip": 0.0},
        "optim": {"name": "sgd", "lr": LR, "momentum": 0.9, "weight_decay": 0.0},
        "eval": {"every": 3, "batch_size": 8, "max_samples": 0},
        "checkpoint": {"every": 0},
        "strategy": {"sync_batchnorm": True},
        "task": {},
    }
    raw["optim"].update(schedule="constant", warmup_steps=0)
    for name, values in sections.items():
        raw.setdefault(name, {}).update(values)
    return build_config(raw, CNNOptions).to_dict()


def train_all(configs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    out = {}
    for name, raw in configs.items():
        trainer = make_trainer(raw)
        summary = trainer.fit()
        lines = (Path(raw["run"]["dir"]) / "metrics.jsonl").read_text().splitlines()
        records = [json.loads(line) for line in lines]
        out[name] = {
            "params": params_of(trainer),
            "losses": [r["loss"] for r in records if r["kind"] == "train"],
            "val_loss": summary.val_loss,
        }
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    root = tmp_path_factory.mktemp("sync-bn")
    configs = {
        name: cnn_raw(root / name, strategy={"name": strategy, "sync_batchnorm": sync})
        for name, strategy, sync in (
            ("ddp", "ddp", True),
            ("allreduce", "allreduce", True),
            ("fsdp", "fsdp", True),
            ("ddp-local", "ddp", False),
            ("allreduce-local", "allreduce", False),
        )
    }
    return root, run_ranks(train_all, 2, configs, timeout=240)[0]


def one_process() -> tuple[dict[str, np.ndarray], list[float]]:
    """The same SGD on the whole global batch, in a hand-written loop."""
    seed_everything(0)
    task = cnn(build_config(cnn_raw(Path("unused")), CNNOptions))
    model = task.model
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    losses = reference_loop(model, optimizer, None, task.train_data, BATCH, STEPS)
    return {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}, losses


def max_difference(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> float:
    assert a.keys() == b.keys()
    return max(float(np.abs(a[k].astype(np.float64) - b[k]).max()) for k in a)


@pytest.mark.parametrize("strategy", ["ddp", "allreduce", "fsdp"])
def test_synced_batchnorm_on_two_ranks_equals_one_process(
    runs: tuple[Path, dict[str, Any]], strategy: str
) -> None:
    want_params, want_losses = one_process()
    run = runs[1][strategy]
    # Parameters and running statistics (the buffers, num_batches_tracked included).
    assert max_difference(run["params"], want_params) < 1e-5
    np.testing.assert_allclose(run["losses"], want_losses, rtol=1e-5)


def test_without_it_each_rank_normalizes_over_its_own_half(
    runs: tuple[Path, dict[str, Any]],
) -> None:
    want_params, want_losses = one_process()
    local = runs[1]["ddp-local"]
    assert max_difference(local["params"], want_params) > 1e-3
    assert abs(local["losses"][0] - want_losses[0]) > 1e-4


@pytest.mark.parametrize("name", ["ddp", "fsdp", "ddp-local", "allreduce-local"])
def test_the_reported_val_loss_is_the_saved_models(
    runs: tuple[Path, dict[str, Any]], name: str
) -> None:
    """Evaluated in one process from the final checkpoint: the loss the run reported (under
    allreduce without the option, rank 1's running statistics differ from rank 0's, which the
    checkpoint holds)."""
    root, results = runs
    model = load_weights(SmallCNN(), root / name)
    model.eval()
    val = Images(27, seed=2)
    with torch.no_grad():
        loss = float(class_loss(model(val.x), val.y).double().mean())
    assert results[name]["val_loss"] == pytest.approx(loss, rel=1e-6)


def test_a_model_without_batchnorm_or_a_strategy_that_cannot_is_one_line() -> None:
    with pytest.raises(UserError, match=r"^strategy.sync_batchnorm = true, but the model has no"):
        apply_sync_batchnorm(nn.Sequential(nn.Linear(2, 2)), None)
    cfg = build_config({"strategy": {"name": "pipeline", "sync_batchnorm": True}}, CNNOptions)
    with pytest.raises(ConfigError, match="ddp, allreduce and fsdp only"):
        validate_strategy(cfg, 2)
    cfg = build_config(
        {"strategy": {"sync_batchnorm": True}, "balance": {"mode": "throughput"}}, CNNOptions
    )
    with pytest.raises(ConfigError, match=r"balance\.mode"):
        validate_strategy(cfg, 2)


def test_a_copy_of_a_synced_model_is_a_plain_batchnorm() -> None:
    """after_training may copy the model, e.g. to run it on rank 0 alone: no collective."""
    import copy

    model = SmallCNN()
    apply_sync_batchnorm(model, None)
    twin = copy.deepcopy(model)
    twin.train()
    torch.manual_seed(0)
    x = torch.randn(4, 3, 8, 8)
    reference = SmallCNN()
    reference.load_state_dict(model.state_dict())
    torch.testing.assert_close(twin(x), reference(x))


def test_sync_batchnorm_on_a_model_without_batchnorm_stops_the_run_in_one_line(
    tmp_path: Path,
) -> None:
    """Through the real CLI on 2 ranks: exit 2, the message, no traceback, no checkpoint."""
    from tests.test_cli import run_cli

    config = tmp_path / "cnn.toml"
    config.write_text(build_config(cnn_raw(tmp_path / "run"), CNNOptions).to_toml())
    result = run_cli(
        "train", str(config), "--nproc", "2", "--task.batchnorm=false", "--train.steps=2"
    )
    assert result.returncode == 2, result.stderr[-3000:]
    assert "the model has no BatchNorm layer" in result.stderr
    assert "Traceback" not in result.stderr
    assert not list((tmp_path / "run" / "checkpoints").glob("step-*"))
