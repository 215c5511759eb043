"""The loss contract, checked: a loss that is not one value per counted item fails on its first
step with one line that names the fix, before any update -- and every correct layout passes."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from dtrain.errors import UserError
from dtrain.task import IGNORE_INDEX, count_target_items
from dtrain.train.loss_contract import LossContract
from tests.test_cli import run_cli, write_tiny_config

V = 11  # classes


def per_token(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(
        logits.reshape(-1, V), targets.reshape(-1), ignore_index=IGNORE_INDEX, reduction="none"
    )


def shifted(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return per_token(logits[:, :-1], labels[:, 1:])


def shifted_count(labels: torch.Tensor) -> int:
    return int((labels[:, 1:] != IGNORE_INDEX).sum())


def check(loss_fn, count, logits: torch.Tensor, labels: torch.Tensor) -> None:  # type: ignore[no-untyped-def]
    contract = LossContract(count)
    contract.wrap(loss_fn)(logits, labels)


def batch(padded: bool) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 8, V, generator=g)
    labels = torch.randint(0, V, (4, 8), generator=g)
    if padded:
        labels[0, 5:] = IGNORE_INDEX
    return logits, labels


@pytest.mark.parametrize("padded", [False, True])
def test_correct_layouts_pass(padded: bool) -> None:
    logits, labels = batch(padded)
    check(per_token, count_target_items, logits, labels)  # one value per target element
    check(shifted, shifted_count, logits, labels)  # a shifted loss, counted as it counts

    def kept_only(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        keep = y != IGNORE_INDEX
        return F.cross_entropy(out[keep], y[keep], reduction="none")

    check(kept_only, count_target_items, logits, labels)  # only the counted items
    one = torch.randn(1, V), torch.tensor([3])
    check(lambda o, y: F.cross_entropy(o, y), count_target_items, *one)  # a mean of one item


def test_a_mean_loss_is_named() -> None:
    logits, labels = batch(False)
    with pytest.raises(UserError, match=r'returned 1 value.*32 counted.*reduction="none"'):
        check(lambda o, y: per_token(o, y).mean(), count_target_items, logits, labels)


@pytest.mark.parametrize("padded", [False, True])
def test_a_shifted_loss_counted_unshifted_is_named(padded: bool) -> None:
    logits, labels = batch(padded)
    items = count_target_items(labels)  # 32, or 29 with 3 padded labels in one row
    with pytest.raises(UserError, match=rf"returned 28 value.*{items} counted.*labels\[:, 1:\]"):
        check(shifted, count_target_items, logits, labels)


def test_a_per_sample_loss_of_per_token_counts_is_named() -> None:
    with pytest.raises(UserError, match=r"returned 4 value.*32 counted.*Task.count_items"):
        check(lambda o, y: per_token(o, y).reshape(4, 8).mean(1), count_target_items, *batch(False))


def test_a_non_tensor_loss_is_named() -> None:
    with pytest.raises(UserError, match="returned a float"):
        check(lambda o, y: 1.0, count_target_items, *batch(False))


def test_a_mean_loss_fails_the_run_in_one_line_before_any_update(tmp_path: Path) -> None:
    """The issue's first wrong-math case through the real CLI: exit 2, one line, no checkpoint
    written (nothing trained on the wrong math). (On 2 ranks: tests/test_hf.py's shifted loss.)"""
    run_dir = tmp_path / "run"
    config = write_tiny_config(tmp_path / "mean.toml", run_dir)
    result = run_cli("train", str(config), "--nproc", "1", "--run.task=tests.tasks:mean_loss_gpt")
    assert result.returncode == 2, result.stderr[-3000:]
    # Said once: by the launcher's report (the worker said it too, and so did every rank).
    assert result.stderr.count("Task.loss_fn returned") == 1, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    assert not list((run_dir / "checkpoints").glob("step-*"))
