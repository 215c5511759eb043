"""A task's own optimizer, schedule and evaluation metrics, and the config's schedule shapes:
the runs equal a hand-written single-process loop with the same optimizer; metrics are the
exact counts over the validation set; the logged lr is the step's own; a resumed run with a
task's schedule is bit-identical; a checkpoint of another optimizer and an optimizer over
parameters the strategy does not hold are one-line errors."""

from __future__ import annotations

import contextlib
import io
import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from dtrain.checkpoint.rng import seed_everything
from dtrain.compute.optim import build_scheduler, lr_factor
from dtrain.config import OptimConfig
from dtrain.config.load import build_config
from dtrain.errors import CheckpointError, ConfigError, UserError
from dtrain.metrics.summary import print_summary
from dtrain.train.optim_choice import OptimizerKinds
from tests.byo_tasks import (
    ClassifierOptions,
    Clusters,
    accuracy,
    class_loss,
    classifier,
    mean_confidence,
    own_optimizer,
    own_scheduler,
    reference_loop,
)
from tests.dist_helpers import crash_then_resume, make_trainer, params_of
from tests.ranks import run_ranks

BATCH = 8


def classifier_raw(run_dir: Path, **sections: dict[str, Any]) -> dict[str, Any]:
    raw: dict[str, dict[str, Any]] = {
        "run": {"dir": str(run_dir), "task": "tests.byo_tasks:classifier", "seed": 0},
        "data": {"global_batch_size": BATCH, "prefetch": 0, "shuffle": "none"},
        "train": {"steps": 8, "log_every": 1, "grad_clip": 0.0},
        "optim": {"name": "sgd", "lr": 0.5, "warmup_steps": 0},
        "eval": {"every": 0, "batch_size": 8},
        "checkpoint": {"every": 4},
        "task": {},
    }
    for name, values in sections.items():
        raw.setdefault(name, {}).update(values)
    return build_config(raw, ClassifierOptions).to_dict()


def train_records(run_dir: str) -> list[dict[str, Any]]:
    lines = (Path(run_dir) / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r.get("kind") in ("train", "eval")]


def train_all(runs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """In each rank: every run of ``runs``; a run with ``crash_at`` crashes there and resumes
    from its newest checkpoint. Rank 0's results by name."""
    out: dict[str, Any] = {}
    for name, raw in runs.items():
        crash = raw.pop("crash_at", None)
        if crash:
            out[name] = {"params": crash_then_resume(raw, crash)["params"]}
            continue
        trainer = make_trainer(raw)
        summary = trainer.fit()
        out[name] = {
            "params": params_of(trainer),
            "val_loss": summary.val_loss,
            "metrics": summary.val_metrics,
            "records": train_records(raw["run"]["dir"]),
            "dir": raw["run"]["dir"],
        }
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("task-optim")
    configs = {
        "ddp": classifier_raw(root / "ddp"),
        "fsdp": classifier_raw(root / "fsdp", strategy={"name": "fsdp"}),
        "resumed": {**classifier_raw(root / "resumed"), "crash_at": 7},
        "wsd": classifier_raw(
            root / "wsd",
            task={"own_optimizer": False, "own_scheduler": False},
            optim={"schedule": "wsd", "warmup_steps": 2, "decay_steps": 3, "min_lr_ratio": 0.2},
        ),
    }
    return run_ranks(train_all, 2, configs, timeout=240)[0]


def reference() -> tuple[dict[str, np.ndarray], list[float], torch.nn.Module]:
    """The same optimizer and schedule in a hand-written loop, one process."""
    cfg = build_config(classifier_raw(Path("unused")), ClassifierOptions)
    seed_everything(0)
    task = classifier(cfg)
    model = task.model
    optimizer = own_optimizer(list(model.named_parameters()))
    scheduler = own_scheduler(optimizer, 8)
    losses = reference_loop(model, optimizer, scheduler, task.train_data, BATCH, 8)
    params = {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}
    return params, losses, model


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_a_task_optimizer_trains_as_the_same_optimizer_in_a_hand_written_loop(
    runs: dict[str, Any], strategy: str
) -> None:
    want_params, want_losses, _ = reference()
    run = runs[strategy]
    assert want_params.keys() == run["params"].keys()
    for key, value in want_params.items():
        np.testing.assert_allclose(run["params"][key], value, rtol=1e-5, atol=1e-6, err_msg=key)
    losses = [r["loss"] for r in run["records"] if r["kind"] == "train"]
    np.testing.assert_allclose(losses, want_losses, rtol=1e-5)


def test_the_logged_lr_is_the_one_the_step_trained_with(runs: dict[str, Any]) -> None:
    # StepLR(step_size=3, gamma=0.5) over group 0's 0.5: steps 1-3 at 0.5, 4-6 at 0.25, ...
    lrs = [r["lr"] for r in runs["ddp"]["records"] if r["kind"] == "train"]
    assert lrs == [0.5, 0.5, 0.5, 0.25, 0.25, 0.25, 0.125, 0.125]
    # The config's warm-up-stable-decay: 2 warm-up steps, stable, the last 3 decay to 0.2.
    wsd = [r["lr"] for r in runs["wsd"]["records"] if r["kind"] == "train"]
    want = [0.5 * f for f in (0.5, 1.0, 1.0, 1.0, 1.0, 1 - 0.8 / 3, 1 - 1.6 / 3, 0.2)]
    np.testing.assert_allclose(wsd, want, rtol=1e-12)


def test_metrics_are_exact_counts_over_the_validation_set(runs: dict[str, Any]) -> None:
    """37 validation samples on 2 ranks (19 and 18): accuracy is the count of right answers
    over the whole set divided by 37, as one process computes it -- under ddp and fsdp (which
    pads the smaller share with uncounted batches)."""
    for strategy in ("ddp", "fsdp"):
        run = runs[strategy]
        _, _, model = reference()
        model.load_state_dict({k: torch.from_numpy(v) for k, v in run["params"].items()})
        model.eval()
        val = Clusters(37, seed=2)
        with torch.no_grad():
            logits = model(val.x)
        right, count = accuracy(logits, val.y)
        assert run["metrics"]["accuracy"] == int(right) / count
        confidence, _ = mean_confidence(logits, val.y)
        assert run["metrics"]["confidence"] == pytest.approx(float(confidence) / 37, rel=1e-6)
        loss = float(class_loss(logits, val.y).double().mean())
        assert run["val_loss"] == pytest.approx(loss, rel=1e-6)
        evals = [r for r in run["records"] if r["kind"] == "eval"]
        assert evals[-1]["val_accuracy"] == run["metrics"]["accuracy"]
        assert evals[-1]["val_items"] == 37


def test_a_run_with_a_task_schedule_resumes_bit_identically(runs: dict[str, Any]) -> None:
    straight, resumed = runs["ddp"]["params"], runs["resumed"]["params"]
    for key, value in straight.items():
        assert np.array_equal(value, resumed[key]), key


def bad_runs(root: str) -> dict[str, str]:
    """One rank: an optimizer over another model's parameters; a resume with another
    optimizer than the checkpoint's. The errors' messages."""
    out = {}
    try:
        make_trainer(classifier_raw(Path(root) / "foreign", task={"optimizer_over": "foreign"}))
    except UserError as exc:
        out["foreign"] = str(exc)
    first = classifier_raw(Path(root) / "other", train={"steps": 2})
    make_trainer(first).fit()
    # Run again as it is: finished, nothing trained, evaluated or written.
    records = (Path(root) / "other" / "metrics.jsonl").read_text()
    again = make_trainer(first).fit()
    assert (Path(root) / "other" / "metrics.jsonl").read_text() == records
    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer):
        print_summary(again, "samples", 1)
    out["finished"] = buffer.getvalue()
    second = classifier_raw(
        Path(root) / "other",
        train={"steps": 4},
        task={"own_optimizer": False, "own_scheduler": False},
        optim={"name": "adamw"},
    )
    try:
        make_trainer(second).fit()
    except CheckpointError as exc:
        out["other"] = str(exc)
    return out


def test_bad_optimizers_are_named_in_one_line_and_a_finished_run_says_so(tmp_path: Path) -> None:
    errors = run_ranks(bad_runs, 1, str(tmp_path))[0]
    assert "over 8 parameter(s) that strategy 'ddp' does not hold" in errors["foreign"]
    assert "named parameters it is called with" in errors["foreign"]
    assert "torch.optim.sgd.SGD optimizer" in errors["other"]
    assert "torch.optim.adamw.AdamW" in errors["other"]
    assert "\n" not in errors["foreign"] + errors["other"]
    # A finished run run again (it printed "train loss nan ... samples/s").
    assert "already finished: step 2 of 2, nothing trained" in errors["finished"]
    assert "nan" not in errors["finished"]


def test_a_checkpoint_of_another_schedule_is_refused() -> None:
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    scheduler = build_scheduler(optimizer, OptimConfig(), 10)
    kinds = OptimizerKinds(optimizer, scheduler)
    assert kinds.state_dict()["scheduler"] == "dtrain.compute.optim.Schedule"
    kinds.load_state_dict(kinds.state_dict())  # its own kinds load
    with pytest.raises(CheckpointError, match=r"torch\.optim\.lr_scheduler\.StepLR scheduler"):
        kinds.load_state_dict({"scheduler": "torch.optim.lr_scheduler.StepLR"})


def test_schedule_shapes() -> None:
    # cosine with its own horizon: down to the floor at warm-up + decay_steps, flat after.
    cos = [lr_factor(s, 100, 2, 0.1, "cosine", 10) for s in range(20)]
    assert cos[:2] == [0.5, 1.0]
    assert cos[7] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert cos[12:] == [pytest.approx(0.1)] * 8
    # without it: until train.steps, as before.
    halfway = 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi / 2))
    assert lr_factor(51, 100, 2, 0.1) == pytest.approx(halfway)
    # warm-up, stable, decay (linear over the last 4 of 20 steps to 0.0).
    wsd = [lr_factor(s, 20, 2, 0.0, "wsd", 4) for s in range(20)]
    assert wsd[:16] == [0.5] + [1.0] * 15
    assert wsd[16:] == [0.75, 0.5, 0.25, 0.0]
    assert lr_factor(79, 100, 0, 0.0, "wsd") == 1.0  # decay_steps 0: the last fifth
    assert lr_factor(99, 100, 0, 0.0, "wsd") == 0.0
    assert [lr_factor(s, 10, 3, 0.1, "constant") for s in (0, 2, 3, 9)] == [1 / 3, 1.0, 1.0, 1.0]


def test_a_wsd_schedule_that_does_not_fit_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match=r"optim.schedule = 'wsd'.*train.steps = 10"):
        build_config({"train": {"steps": 10}, "optim": {"schedule": "wsd", "decay_steps": 8}})
    assert OptimConfig().schedule == "cosine"


def test_dtrain_report_shows_the_metrics(runs: dict[str, Any]) -> None:
    pytest.importorskip("matplotlib")
    from dtrain.report.plots import make_plots
    from dtrain.report.read import read_runs
    from dtrain.report.totals import format_totals, totals
    from tests.report_helpers import legend_labels

    run = read_runs([Path(runs["ddp"]["dir"])])
    table = format_totals(totals(run[0]))
    assert table["val accuracy"] == f"{runs['ddp']['metrics']['accuracy']:.4f}"
    assert "val confidence" in table
    plots = {p.name: p for p in make_plots(run, [])}
    assert legend_labels(plots["val_metrics"]) == ["accuracy", "confidence"]
