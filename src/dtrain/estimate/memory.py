"""The estimate of one rank's memory for a config at a world size (``dtrain estimate``).

For the strategy's layout -- the same mesh ``dtrain train`` builds -- and the rank that holds
the most, in bytes: the parts (:class:`~.result.Line`) and the totals of the phases they add up
in (set-up, forward/backward, optimizer step, gradient sync: what each holds is
docs/strategies.md's table), the largest of which is the peak. :mod:`.flat` estimates every
strategy but the pipeline, :mod:`.pipeline` the pipeline.
"""

from __future__ import annotations

import torch

from dtrain.compute.precision import Precision
from dtrain.config import Config, parse_activation_checkpointing, validate_strategy
from dtrain.config.capabilities import capabilities
from dtrain.config.layout import strategy_dims
from dtrain.errors import UserError
from dtrain.estimate.flat import estimate_flat
from dtrain.estimate.job import CPU, Job
from dtrain.estimate.layout import model_tensors
from dtrain.estimate.passes import Prober
from dtrain.estimate.pipeline import estimate_pipeline
from dtrain.estimate.probe import build_meta_task
from dtrain.estimate.result import MemoryEstimate
from dtrain.parallel.recipe import model_blocks
from dtrain.task import Task


def estimate_memory(cfg: Config, world_size: int, budget: int | None = None) -> MemoryEstimate:
    """The estimate for ``cfg`` on ``world_size`` ranks: a config error where the strategy
    cannot lay it out, a user error where the task's model cannot be built or measured."""
    name = cfg.strategy.name
    validate_strategy(cfg, world_size)
    dims = strategy_dims(cfg.strategy, world_size)
    task = build_meta_task(cfg)
    every = parse_activation_checkpointing(cfg.train.activation_checkpointing)
    if every:  # a one-line error where the model has no blocks to checkpoint
        model_blocks(task, task.model, "train.activation_checkpointing")
    # fsdp and tensor (the composed strategies): FSDP shards block by block.
    if capabilities(name).mesh in ("fsdp", "tensor") and dims.dp_shard > 1:
        model_blocks(task, task.model, f"strategy.name = {name!r}")
    cuts = tensor_parallel_cuts(task, dims.tp)
    prober = Prober(task, Precision(cfg.train.precision, CPU), dims.tp, cuts)
    job = Job(cfg, world_size, dims, task, prober, model_tensors(task.model, cuts), every)
    try:
        estimate = estimate_pipeline(job) if name == "pipeline" else estimate_flat(job, name)
    except UserError:
        raise
    except Exception as exc:
        raise UserError(
            f"run.task = {cfg.run.task!r}: its model's forward and backward could not run on "
            f"fake (meta) tensors for an estimate: {type(exc).__name__}: {exc}"
        ) from None
    estimate.budget = budget
    samples = len(task.train_data)  # the estimate measured a micro-batch of them: it has one
    if cfg.data.global_batch_size > samples:  # estimated all the same: the shapes are known
        estimate.notes.append(
            f"data.global_batch_size = {cfg.data.global_batch_size} is more than the training "
            f"set's {samples} samples: dtrain train refuses it (at most {samples})"
        )
    if cfg.dist.device == "cuda" or (cfg.dist.device == "auto" and torch.cuda.is_available()):
        estimate.notes.append(
            "activations are measured with the CPU's kernels and autocast rules; a GPU's "
            "attention kernels may save less"
        )
    return estimate


def tensor_parallel_cuts(task: Task, tp: int) -> dict[str, str]:
    """The model's tensor-parallel plan at degree ``tp`` (module name -> 'colwise' or
    'rowwise'), checked as the strategy checks it."""
    if tp == 1:
        return {}
    from dtrain.parallel.tensor_plan import check_no_dropout, model_plan

    styles = model_plan(task.model, tp)
    check_no_dropout(task.model)
    cuts = {name: type(s).__name__.removesuffix("Parallel").lower() for name, s in styles.items()}
    other = sorted(
        {type(s).__name__ for s in styles.values()} - {"ColwiseParallel", "RowwiseParallel"}
    )
    if other:  # GPT-2's Conv1D and fused attention (dtrain.parallel.transposed)
        raise UserError(
            f"dtrain estimate: {type(task.model).__name__}'s tensor-parallel plan cuts layers "
            f"that are not nn.Linear ({', '.join(other)}), which the estimate does not lay out "
            "yet; estimate it with strategy.tensor_parallel = 1 (ddp or fsdp)"
        )
    return cuts
