"""Token-balanced batches keep the update of one process: each rank sums its per-token losses
and divides by the global token count (the trainer's ``scale = dp / count`` before DDP averages
the gradients), which equals the single-process mean over the whole batch however the tokens
are cut across ranks and micro-batches -- also when the scale assumed another count and the
gradients are rescaled after the sync (:mod:`dtrain.train.step`). A pure test, on the step function
every strategy runs."""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from dtrain.compute.precision import Precision
from dtrain.data.partition import partition_tokens
from dtrain.data.text import collate_padded
from dtrain.models.gpt import GPT, GPTConfig
from dtrain.parallel.recipe import Recipe
from dtrain.task import count_target_items
from dtrain.train.step import run_micro_batches
from tests.data_helpers import partition_samples
from tests.tasks import VariableTokens, lm_loss


def grads(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.grad.detach().clone() for p in model.parameters() if p.grad is not None]


@pytest.mark.parametrize("assumed", [1.0, 0.7])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_per_rank_sums_over_the_global_count_equal_the_single_process_mean(
    dtype: torch.dtype, assumed: float
) -> None:
    # ``assumed``: the count the scale assumed, as a share of the true one (1: exact; 0.7: the
    # step before held fewer tokens, so the gradients are rescaled once the count is agreed).
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, seq_len=48, n_layer=1, n_head=2, d_model=16)).to(dtype)
    data = VariableTokens(96, 48, seed=3)
    lengths = data.sample_lengths()
    ids = np.arange(96)

    # One process: the mean loss over every target token of the batch.
    inputs, targets = collate_padded([data[i] for i in ids])
    model.zero_grad()
    loss = lm_loss(model(inputs), targets).sum() / count_target_items(targets)
    loss.backward()
    single = loss.item()
    single_grads = grads(model)

    fake = SimpleNamespace(
        model=model,
        runtime=SimpleNamespace(device=torch.device("cpu")),
        recipe=Recipe(Precision("fp32", torch.device("cpu"))),
    )
    worst_loss, worst_grad, naive_gap = 0.0, 0.0, 0.0
    for world, micro, split in itertools.product((2, 3, 4), (1, 2), ("tokens", "samples")):
        if split == "tokens":
            parts = partition_tokens(ids, lengths[ids], world, micro)
        else:  # equal sample counts: ranks hold very different numbers of tokens
            parts = partition_samples(ids, world, micro)
        batches = [[collate_padded([data[i] for i in m]) for m in rank] for rank in parts]
        count = sum(count_target_items(t) for rank in batches for _, t in rank)
        assert count == int(lengths.sum())
        expected = round(assumed * count)
        scale = torch.tensor(world / expected, dtype=dtype)  # what ForwardBackward computes
        loss_total = 0.0
        summed = [torch.zeros_like(g) for g in single_grads]
        rank_means = []
        for rank in batches:
            model.zero_grad()
            loss_sum = run_micro_batches(fake, rank, lm_loss, scale)  # type: ignore[arg-type]
            loss_total += float(loss_sum)
            rank_means.append(float(loss_sum) / sum(count_target_items(t) for _, t in rank))
            summed = [s + g for s, g in zip(summed, grads(model))]
        averaged = [s / world for s in summed]  # DDP's all-reduce mean
        if expected != count:  # rescale_gradients, after the sync
            averaged = [a * (expected / count) for a in averaged]
        worst_loss = max(worst_loss, abs(loss_total / count - single))
        worst_grad = max(
            worst_grad, max(float((a - b).abs().max()) for a, b in zip(averaged, single_grads))
        )
        # Averaging per-rank means instead would weight tokens unequally.
        naive_gap = max(naive_gap, abs(float(np.mean(rank_means)) - single))
        if split == "tokens":
            tokens = [sum(count_target_items(t) for _, t in rank) for rank in batches]
            assert max(tokens) / np.mean(tokens) < 1.05
    print(
        f"\n{dtype}: |loss - single| max {worst_loss:.2e}, |grad - single| max {worst_grad:.2e};"
        f" mean of per-rank means is off by up to {naive_gap:.2e}"
    )
    assert worst_loss <= 1e-6
    assert worst_grad <= 1e-6
    # The tolerance above can tell a wrong normalization apart (by a factor of 100 or more).
    assert naive_gap > 100 * 1e-6
