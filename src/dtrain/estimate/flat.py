"""The estimate of every strategy but the pipeline: whole replicas (ddp, allreduce, localsgd,
diloco), FSDP shards and tensor-parallel slices (fsdp, tensor and their products on the
mesh)."""

from __future__ import annotations

from dtrain.estimate.fsdp import Moment, Unit, fsdp_moments
from dtrain.estimate.job import Job
from dtrain.estimate.layout import TensorInfo, bucket_bytes, tensors_of
from dtrain.estimate.passes import measure_both
from dtrain.estimate.probe import example_micro_batch
from dtrain.estimate.report import human
from dtrain.estimate.result import Line, MemoryEstimate


def estimate_flat(job: Job, name: str) -> MemoryEstimate:
    """Every strategy but the pipeline: whole replicas (ddp, allreduce, localsgd, diloco),
    FSDP shards and tensor-parallel slices (fsdp, tensor and their products)."""
    cfg, dims = job.cfg, job.dims
    tp, shards = dims.tp, dims.dp_shard
    rows = -(-cfg.data.global_batch_size // (dims.dp * cfg.data.micro_batches))
    batch = example_micro_batch(job.task, rows)
    passes = measure_both(job.every, lambda every: job.prober.whole(batch, every))
    params, buffers, grads, optim, lines = job.state(tp, shards)
    notes = []
    persistent = 0  # besides the parameters, gradients and optimizer state, for the whole run
    data_parallel = job.world_size > 1
    if name == "ddp" and data_parallel:
        notes.append("ddp keeps the gradients in its all-reduce buckets from set-up on")
    if name == "allreduce" and data_parallel:
        persistent += grads
        lines.append(Line("gradient buckets (allreduce: a copy of the gradients)", grads))
    if name in ("ddp", "allreduce") and data_parallel and cfg.comm.compression == "none":
        staging = staging_bytes(job)
        persistent += staging
        lines.append(Line("staging copy of the last gradient bucket", staging))
    if name == "diloco":
        anchor = grads * (2 if cfg.comm.outer_momentum > 0 else 1)
        persistent += anchor
        lines.append(Line("diloco: the global model and its outer momentum", anchor))
    persistent += job.kernels(len(passes.runs[job.every].products), lines)
    # Gradients that exist before a micro-batch's backward: ddp's buckets, or the sum of the
    # step's earlier micro-batches. Otherwise they are made while its activations are freed.
    held = (name == "ddp" and data_parallel) or cfg.data.micro_batches > 1
    unsynced = unsynced_gradients(job, name)
    moments: list[Moment] = []
    if shards > 1:
        # FSDP's gathered units, its unsharded gradients (those of accumulation included)
        # and the sharded gradients its reduce-scatters have made, moment by moment.
        moments = fsdp_moments(
            *fsdp_units(job, tp, shards),
            reshard_after_forward=cfg.strategy.reshard_after_forward,
            accumulating=cfg.data.micro_batches > 1,
            backward_prefetch=cfg.strategy.backward_prefetch,
        )

    def fsdp_peak(every: int) -> tuple[Moment, int]:
        """The moment where what FSDP holds and the activations held then add up to the
        most, and what it adds to the pass's peak: the activations the blocks after it keep
        (not made yet in its forward, freed in its backward) are not held then."""
        everything = passes.activations(every)

        def added(moment: Moment) -> int:
            return moment.total - (everything - passes.activations(every, moment.block))

        best = max(moments, key=added)
        return best, added(best)

    if moments:
        peak, _ = fsdp_peak(job.every)
        gathered = peak.unsharded - unsynced  # accumulation's gradients: their own line
        lines.append(Line(f"fsdp at its peak ({peak.where}): units gathered whole", gathered))
        if peak.sharded_grads:
            notes.append(
                f"forward/backward counts {human(peak.sharded_grads)} of the gradients: those "
                f"the reduce-scatters have made by FSDP's peak ({peak.where})"
            )
    if unsynced:
        lines.append(Line("gradients of the accumulation micro-steps, before their sync", unsynced))

    def step(every: int) -> int:
        state = params + buffers + optim.state + persistent
        if moments:
            return state + passes.working(every) + fsdp_peak(every)[1]
        working = passes.working(every, with_grads=not held) + (grads if held else 0)
        return state + unsynced + working

    activations = passes.activations(job.every)
    lines.append(
        Line(f"activations ({rows} samples, checkpointing {job.checkpointing[0]})", activations)
    )
    lines.append(Line("forward/backward temporaries", passes.working(job.every) - activations))
    lines.append(Line("optimizer step temporaries", optim.temporary))
    relaid = shards > 1 or tp > 1
    phases = {
        # ddp's and allreduce's buckets are made at set-up
        "set-up": job.setup(params + buffers, relaid)
        + (grads if name in ("ddp", "allreduce") and data_parallel else 0),
        "forward/backward": step(job.every),
        "optimizer step": params + buffers + grads + persistent + optim.state + optim.temporary,
    }
    if name in ("localsgd", "diloco") or (
        dims.dp > 1 and shards == 1 and name in ("tensor", "fsdp")
    ):
        bucket = job.largest_bucket(job.infos, tp)
        phases["gradient sync"] = params + buffers + grads + persistent + optim.state + bucket
    other = 0 if job.every else 1
    return job.estimate(
        rank=0,
        where="the whole model" if not relaid else "its part of every layer",
        micro_batch_samples=rows,
        lines=lines,
        phases=phases,
        other_activations=passes.activations(other),
        other_peak=max({**phases, "forward/backward": step(other)}.values()),
        notes=notes,
    )


def staging_bytes(job: Job) -> int:
    """ddp and allreduce without compression: the step's agreement rides with the last
    gradient bucket in a staging copy of it that the hook keeps (``comm.hooks.MeanHook``).
    Buckets as both cut them: reverse registration order, each at most ``bucket_mb``, the
    first too (DDP rebuilds its buckets after the first step in the order gradients are
    completed in, which this approximates)."""
    buckets = bucket_bytes(job.infos, job.bucket_cap)
    return buckets[-1] if buckets else 0


def fsdp_units(job: Job, tp: int, shards: int) -> tuple[list[Unit], Unit]:
    """The model's FSDP units on one rank: its blocks, in forward order, and the root (what
    no block holds: embeddings, final norm, head)."""
    model = job.task.model
    blocks = [tensors_of([block], job.infos, model) for block in job.prober.blocks(model)]
    in_blocks = {t.name for unit in blocks for t in unit}
    root = [t for t in job.infos if t.is_parameter and t.name not in in_blocks]

    def unit(tensors: list[TensorInfo]) -> Unit:
        params = [t for t in tensors if t.is_parameter]
        trainable = [t for t in params if t.trainable]
        return Unit(
            params=sum(t.gathered_bytes(tp, shards) for t in params),
            grads=sum(t.gathered_bytes(tp, shards) for t in trainable),
            shard_grads=sum(t.local_bytes(tp, shards) for t in trainable),
        )

    return [unit(b) for b in blocks], unit(root)


def unsynced_gradients(job: Job, name: str) -> int:
    """Gradients a rank holds besides its synchronized ones while a step accumulates over
    several micro-batches: ddp's micro-steps without sync make plain gradient tensors beside
    its buckets; FSDP's keep each unit's gradients unsharded (whole) until the last one
    reduce-scatters their sum."""
    dims, micro = job.dims, job.cfg.data.micro_batches
    if micro == 1:
        return 0
    trainable = [t for t in job.infos if t.is_parameter and t.trainable]
    if dims.dp_shard > 1:
        return sum(t.gathered_bytes(dims.tp, dims.dp_shard) for t in trainable)
    if name == "ddp" and job.world_size > 1:
        return sum(t.bytes for t in trainable)
    return 0
