"""Optimizer and learning-rate schedule from the config."""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch import nn

from dtrain.config import OptimConfig


def build_optimizer(
    named_params: Iterable[tuple[str, nn.Parameter]],
    cfg: OptimConfig,
) -> torch.optim.Optimizer:
    """Weight decay on matrices and embeddings only (dim >= 2); biases and norms are exempt."""
    decay: list[nn.Parameter] = []
    no_decay: list[nn.Parameter] = []
    for _, param in named_params:
        if not param.requires_grad:
            continue
        (decay if param.dim() >= 2 else no_decay).append(param)
    groups = [
        {"params": part, "weight_decay": weight_decay}
        for params, weight_decay in ((decay, cfg.weight_decay), (no_decay, 0.0))
        for part in _by_tensor_type(params)
    ]
    if cfg.name == "sgd":
        return torch.optim.SGD(groups, lr=cfg.lr, momentum=cfg.momentum)
    betas = (cfg.betas[0], cfg.betas[1])
    # foreach kernels: one launch for all tensors instead of one per tensor.
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=betas, foreach=True)


def _by_tensor_type(params: list[nn.Parameter]) -> list[list[nn.Parameter]]:
    """Parameters split by tensor type (plain tensors, DTensors), non-empty parts only: the
    fused foreach kernels take one type per call, and tensor parallelism mixes them (cut
    weights are DTensors, replicated ones plain)."""
    parts: dict[type, list[nn.Parameter]] = {}
    for param in params:
        parts.setdefault(type(param.data), []).append(param)
    return list(parts.values())


def lr_factor(step: int, total_steps: int, warmup_steps: int, min_ratio: float) -> float:
    """Linear warm-up to 1, then cosine decay to ``min_ratio`` at ``total_steps``."""
    if warmup_steps > 0 and step < warmup_steps:
        return (step + 1) / warmup_steps
    span = max(1, total_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / span)
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def build_scheduler(
    optimizer: torch.optim.Optimizer,
    cfg: OptimConfig,
    total_steps: int,
) -> torch.optim.lr_scheduler.LambdaLR:
    warmup, floor = cfg.warmup_steps, cfg.min_lr_ratio
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_factor(step, total_steps, warmup, floor)
    )
