"""Optimizer and learning-rate schedule from the config."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from dtrain.config import OptimConfig


def build_optimizer(
    named_params: Iterable[tuple[str, nn.Parameter]],
    cfg: OptimConfig,
) -> torch.optim.Optimizer:
    """Weight decay on matrices and embeddings only (dim >= 2); biases and norms are exempt.

    Without weight decay the two kinds share one group: the update is the same, and AdamW
    then runs its foreach kernels once a step instead of once per group (on a small model's
    CPU step the second round of kernel launches is measurable). The parameters keep their
    order either way -- matrices first -- so the optimizer state's indices do not change."""
    decay: list[nn.Parameter] = []
    no_decay: list[nn.Parameter] = []
    for _, param in named_params:
        if not param.requires_grad:
            continue
        (decay if param.dim() >= 2 else no_decay).append(param)
    kinds = [(decay, cfg.weight_decay), (no_decay, 0.0)]
    if cfg.weight_decay == 0.0:
        kinds = [(decay + no_decay, 0.0)]
    groups = [
        {"params": part, "weight_decay": weight_decay}
        for params, weight_decay in kinds
        for part in _by_tensor_type(params)
    ]
    # foreach: one launch of each operation for all tensors instead of one per tensor (SGD:
    # where torch's default chooses it, CUDA); fused: one kernel for the whole update of a
    # tensor (opt-in: its rounding differs from foreach's).
    fused = cfg.implementation == "fused"
    optimizer: torch.optim.Optimizer
    if cfg.name == "sgd":
        optimizer = torch.optim.SGD(groups, lr=cfg.lr, momentum=cfg.momentum, fused=fused or None)
    else:
        betas = (cfg.betas[0], cfg.betas[1])
        optimizer = torch.optim.AdamW(
            groups, lr=cfg.lr, betas=betas, foreach=not fused or None, fused=fused or None
        )
    optimizer.register_load_state_dict_pre_hook(_keep_configured_settings)
    return optimizer


# A group's keys that are not the config's settings: its parameters, and the learning rate the
# schedule sets (Schedule).
SCHEDULED_KEYS = ("params", "lr", "initial_lr")


def _keep_configured_settings(
    optimizer: torch.optim.Optimizer, saved: dict[str, Any]
) -> dict[str, Any]:
    """A saved state whose groups hold this run's settings (``optim.*`` and
    ``optim.implementation``), not those of the run that saved it. torch's ``load_state_dict``
    takes the saved groups' settings whole, so a run resumed under another config
    (``--force``) would go on with the checkpoint's momentum, betas, weight decay or kernels
    without a word -- or, fused SGD saved by ddp and resumed by fsdp, fail on the DTensors
    fused SGD cannot take. Under the same config nothing changes. (Called before torch reads
    the groups, so that it also places each state tensor as the chosen kernels want it.)"""
    ours = optimizer.param_groups
    groups = [
        {**group, **{k: v for k, v in ours[i].items() if k not in SCHEDULED_KEYS}}
        if i < len(ours)
        else group  # more groups than here: torch's own check names it
        for i, group in enumerate(saved.get("param_groups", []))
    ]
    return {**saved, "param_groups": groups}


def _by_tensor_type(params: list[nn.Parameter]) -> list[list[nn.Parameter]]:
    """Parameters split by tensor type (plain tensors, DTensors), non-empty parts only: the
    fused foreach kernels take one type per call, and tensor parallelism mixes them (cut
    weights are DTensors, replicated ones plain)."""
    parts: dict[type, list[nn.Parameter]] = {}
    for param in params:
        parts.setdefault(type(param.data), []).append(param)
    return list(parts.values())


def lr_factor(
    step: int,
    total_steps: int,
    warmup_steps: int,
    min_ratio: float,
    schedule: str = "cosine",
    decay_steps: int = 0,
) -> float:
    """The learning rate of step ``step`` (0-based) as a fraction of ``optim.lr``: a linear
    warm-up to 1, then by ``schedule``:

    - ``cosine``: cosine decay to ``min_ratio`` over ``decay_steps`` (0: until
      ``total_steps``), then ``min_ratio``;
    - ``wsd`` (warm-up, stable, decay): 1 until the last ``decay_steps``, then a linear decay
      that reaches ``min_ratio`` at ``total_steps``;
    - ``constant``: 1.
    """
    if warmup_steps > 0 and step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "constant":
        return 1.0
    if schedule == "wsd":
        decay = decay_steps if decay_steps > 0 else max(1, total_steps // 5)
        begin = total_steps - decay
        if step < begin:
            return 1.0
        # The decay's last step (total_steps - 1) trains at min_ratio.
        progress = min(1.0, (step - begin + 1) / decay)
        return 1.0 - (1.0 - min_ratio) * progress
    assert schedule == "cosine", schedule
    span = max(1, decay_steps if decay_steps > 0 else total_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / span)
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


class Schedule(torch.optim.lr_scheduler.LambdaLR):
    """torch's ``LambdaLR`` with one factor for every group, whose saved state also loads where
    the optimizer has another number of groups than the run that saved it: every group starts
    from ``optim.lr`` under the same factor, so the state's per-group lists hold one value,
    repeated."""

    def __init__(self, optimizer: torch.optim.Optimizer, lr_lambda: Callable[[int], float]) -> None:
        super().__init__(optimizer, lr_lambda)
        # The optimizer's state loads after the schedule's (and carries the saved rate).
        optimizer.register_load_state_dict_post_hook(lambda _optimizer: self.set_rate())

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        groups = len(self.optimizer.param_groups)
        configured = list(self.base_lrs)
        state = dict(state_dict)
        for key in ("base_lrs", "_last_lr"):
            values = state.get(key)
            if isinstance(values, list) and len(values) != groups and len(set(values)) == 1:
                state[key] = values[:1] * groups
        super().load_state_dict(state)
        # optim.lr as this run's config gives it: a run resumed under another (--force) goes
        # on from the checkpoint's point of the schedule at its own rate, not the saved one.
        self.base_lrs = configured
        self.set_rate()

    def set_rate(self) -> None:
        """Every group's rate at the schedule's position, computed as ``step`` computes it
        (so a resume under the same config sets the very bits it saved)."""
        for group, base, factor in zip(self.optimizer.param_groups, self.base_lrs, self.lr_lambdas):
            group["initial_lr"] = base
            group["lr"] = base * factor(self.last_epoch)
        self._last_lr = [group["lr"] for group in self.optimizer.param_groups]


def build_scheduler(
    optimizer: torch.optim.Optimizer, cfg: OptimConfig, total_steps: int
) -> Schedule:
    warmup, floor, shape, decay = cfg.warmup_steps, cfg.min_lr_ratio, cfg.schedule, cfg.decay_steps
    return Schedule(
        optimizer, lambda step: lr_factor(step, total_steps, warmup, floor, shape, decay)
    )
