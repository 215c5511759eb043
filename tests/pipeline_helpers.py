"""Functions that run inside the ranks of the pipeline tests."""

from __future__ import annotations

from typing import Any

import torch

from tests.dist_helpers import make_trainer, params_of
from tests.fsdp_census import backward_prefetch_targets, reshards_after_forward


def train_and_report(raw: dict[str, Any]) -> dict[str, Any]:
    """Train; return the full parameters (rank 0), this rank's parameter bytes, the layout,
    what each FSDP unit prefetched in backward and whether it resharded after forward, and
    what the full model gathered for the after-training hook computes."""
    trainer = make_trainer(raw)
    summary = trainer.fit()
    strategy: Any = trainer.strategy
    # the stages' chains are FSDP roots outside the pruned model
    fsdp_roots = [strategy.unwrapped, *getattr(strategy, "chains", {}).values()]
    out: dict[str, Any] = {
        "params": params_of(trainer),
        "param_bytes": strategy.parameter_bytes(),
        "dp": (strategy.data_parallel_rank, strategy.data_parallel_size),
        "val_loss": summary.val_loss,
        "train_loss": summary.train_loss,
        "bounds": getattr(getattr(strategy, "plan", None), "bounds", None),
        "prefetch": backward_prefetch_targets(fsdp_roots),
        "reshard": reshards_after_forward(fsdp_roots),
    }
    model = strategy.model_for_inference()
    if model is not None:
        idx = torch.arange(16).remainder(64).reshape(1, 16)
        with torch.no_grad():
            out["logits"] = model(idx).numpy().copy()
    return out


def resume_only(raw: dict[str, Any]) -> dict[str, Any]:
    """Load the run folder's newest checkpoint, train nothing; the step and full parameters."""
    trainer = make_trainer(raw)
    trainer.resume()
    return {"step": trainer.step, "params": params_of(trainer)}


def train_and_report_each(raws: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """:func:`train_and_report` of each config in turn, in one process."""
    return [train_and_report(raw) for raw in raws]
