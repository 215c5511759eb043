"""The pipeline's estimate: each rank holds its stages' parameters, gradients and optimizer
state (an FSDP shard of them with ``data_parallel = 'fsdp'``, a tensor-parallel slice with
``tensor_parallel``), and on each stage the activations of every micro-batch in flight (M per
step on stage s of K: gpipe M, 1f1b ``min(M, K - s)``, interleaved-1f1b the rank's warm-up
forwards plus one, as torch's schedules run them).

Each stage's pass is measured on its own. A stage after the first also keeps a receive buffer
for each micro-batch's activations, a stage before the last one for each micro-batch's
gradients (torch's ``PipelineStage`` makes them per micro-batch, once).
"""

from __future__ import annotations

from itertools import pairwise

from dtrain.config.layout import stages_per_rank
from dtrain.estimate.job import Job
from dtrain.estimate.layout import TensorInfo, tensors_of
from dtrain.estimate.passes import StagePass
from dtrain.estimate.probe import example_micro_batch
from dtrain.estimate.result import Line, MemoryEstimate


def estimate_pipeline(job: Job) -> MemoryEstimate:
    from dtrain.parallel.pipeline.plan import check_stage_count, choose_plan
    from dtrain.parallel.pipeline.stages import uniform_bounds

    cfg, dims, task = job.cfg, job.dims, job.task
    opts = cfg.strategy
    stages = dims.pp * stages_per_rank(opts) if dims.pp > 1 else 1
    rows = cfg.data.global_batch_size // (dims.dp * cfg.data.micro_batches)
    layers = job.prober.layers(task.model)
    check_stage_count(stages, len(layers), task.model)
    notes = []
    if opts.pipeline_balance == "profile" and not opts.pipeline_boundaries and stages > 1:
        bounds = list(uniform_bounds(len(layers), stages))
        notes.append(
            "pipeline_balance = 'profile' cuts where measured layer times say; estimated "
            "at equal layer counts (set pipeline_boundaries for the exact cut)"
        )
    else:  # the strategy's own cut: manual boundaries (checked against the layers) or uniform
        bounds = list(choose_plan(opts, layers, stages, None).bounds)
    spans = [range(a, b) for a, b in pairwise(bounds)]
    batch = example_micro_batch(task, rows)

    def measure(every: int) -> list[StagePass]:
        done: list[StagePass] = []
        for s, span in enumerate(spans):  # each stage receives what the one before sends
            received = done[-1].output if done else None
            done.append(job.prober.stage(batch, span, received, s == stages - 1, every))
        return done

    passes = {choice: measure(choice) for choice in {0, job.every or 1}}
    for stage_passes in passes.values():  # what a stage saves: read without checkpointing
        for stage, plain in zip(stage_passes, passes[0]):
            stage.saved = plain.saved
    best: MemoryEstimate | None = None
    for rank in range(dims.pp):
        mine = list(range(rank, stages, dims.pp))
        infos = tensors_of([layers[i] for s in mine for i in spans[s]], job.infos, task.model)
        estimate = _rank_estimate(job, rank, mine, infos, passes, spans, rows, stages)
        if best is None or estimate.peak > best.peak:
            best = estimate
    assert best is not None
    if (
        not job.built_on_meta
        and stages > 1
        and opts.pipeline_balance == "profile"
        and not opts.pipeline_boundaries
    ):
        profiled = sum(t.bytes for t in job.infos) + job.prober.whole(batch, 0).working_with_grads
        best.notes.append("set-up: profiling runs every layer's forward and backward on each rank")
        best.phases["set-up"] = max(best.phases["set-up"], profiled)
        best.other_peak = max(best.other_peak, profiled)
    best.notes = notes + best.notes
    return best


def in_flight(job: Job, stage: int, rank: int, stages: int) -> int:
    """Micro-batches whose activations ``stage`` (on pipeline rank ``rank``) holds at once."""
    schedule = job.cfg.strategy.pipeline_schedule
    micro, pp = job.cfg.data.micro_batches, job.dims.pp
    if stages == 1:  # one stage: each micro-batch's forward and backward in turn
        return 1
    if schedule == "gpipe":
        return micro
    if schedule == "1f1b":
        return min(micro, stages - stage)
    # Interleaved 1F1B (torch's _get_warmup_ops): counted in chunks, over the rank's stages.
    chunks = stages // pp
    per_round = micro // max(1, micro // pp)
    warmup = (chunks - 1) * per_round + 2 * (pp - 1 - rank)
    return min(warmup + 1, micro * chunks)


def grads_held(job: Job, mine: list[int], rank: int, stages: int) -> bool:
    """Whether a stage runs a forward with all its micro-batches in flight after its first
    backward of the step, when the step's gradients exist: GPipe never (all forwards come
    first), 1F1B where more micro-batches follow its warm-up, interleaved 1F1B counted so."""
    schedule, micro = job.cfg.strategy.pipeline_schedule, job.cfg.data.micro_batches
    if schedule == "gpipe" or stages == 1:
        return stages == 1 and micro > 1
    if schedule == "1f1b":
        return any(micro > in_flight(job, s, rank, stages) for s in mine)
    return True


def _rank_estimate(
    job: Job,
    rank: int,
    mine: list[int],
    infos: list[TensorInfo],
    passes: dict[int, list[StagePass]],
    spans: list[range],
    rows: int,
    stages: int,
) -> MemoryEstimate:
    cfg, dims = job.cfg, job.dims
    tp, shards, micro = dims.tp, dims.dp_shard, cfg.data.micro_batches
    params, buffers, grads, optim, lines = job.state(tp, shards, infos)
    received = 0
    for s in mine:
        if s > 0:
            received += micro * passes[0][s].input_bytes
        if s < stages - 1:
            received += micro * passes[0][s].output_bytes
    if received:
        lines.append(Line("receive buffers (activations, their gradients)", received))
    flying = max(in_flight(job, s, rank, stages) for s in mine)
    held = grads_held(job, mine, rank, stages)
    # FSDP inside the stages: torch's schedule runs every micro-batch's backward without
    # resharding or reducing (PipelineStage.backward_maybe_with_nosync) and reduces once at
    # the end of the step: from a stage's first backward on, its layers stay gathered and
    # their gradients unsharded (whole). A layer resharded after a later forward is gathered
    # again in its backward, and its flat all-gather buffer stays until the next layer's
    # parameters are copied out: one layer more. Before the first backward, forward gathers
    # a layer at a time (and prefetches the next): two layers. Without resharding after
    # forward (strategy.reshard_after_forward = false) every layer stays gathered from its
    # first forward on, and none is gathered again.
    fsdp_first = 0  # what FSDP holds until the stage's first backward ends
    fsdp_later: tuple[int, int] | None = None  # (gathered, gradients) from then on
    if shards > 1:
        layers = job.prober.layers(job.task.model)
        gathered = [
            sum(
                t.gathered_bytes(tp, shards)
                for t in tensors_of([layers[i]], infos, job.task.model)
                if t.is_parameter
            )
            for s in mine
            for i in spans[s]
        ]
        trainable = [t for t in infos if t.is_parameter and t.trainable]
        reshard = cfg.strategy.reshard_after_forward
        fsdp_later = (
            sum(gathered) + (max(gathered, default=0) if reshard else 0),
            sum(t.gathered_bytes(tp, shards) for t in trainable),
        )
        fsdp_first = 2 * max(gathered, default=0) if reshard else sum(gathered)

    def peak_of(every: int) -> tuple[int, int, int, bool]:
        """(micro-batches whose activations are held at the peak, their activations, the
        step's forward/backward peak above the rest, whether it is after the stage's first
        backward with FSDP's layers all gathered and its gradients whole)."""
        stage_passes = [passes[every][s] for s in mine]
        kept = max(p.kept for p in stage_passes)
        if fsdp_later is not None and held:  # gradients and layers counted in fsdp_later
            step = (flying - 1) * kept + max(p.working for p in stage_passes)
            return flying, flying * kept, sum(fsdp_later) + step, True
        if held:
            working = max(p.working for p in stage_passes) + grads
            return flying, flying * kept, (flying - 1) * kept + working, False
        # The gradients are made while the micro-batches' activations are freed.
        working = max(p.working_with_grads for p in stage_passes)
        first = (flying, flying * kept, fsdp_first + (flying - 1) * kept + working, False)
        if fsdp_later is None or flying == 1:
            return first
        # FSDP: from the end of the first micro-batch's backward on, the others' backward.
        later = (flying - 2) * kept + max(p.working for p in stage_passes)
        after = (flying - 1, (flying - 1) * kept, sum(fsdp_later) + later, True)
        return max(first, after, key=lambda moment: moment[2])

    products = frozenset().union(*(passes[job.every][s].run.products for s in mine))
    kernels = job.kernels(len(products), lines)
    base = params + buffers + optim.state + received + kernels
    counted, activations, step, after_first = peak_of(job.every)
    if after_first:
        assert fsdp_later is not None
        lines.append(
            Line(
                "fsdp: the stages' layers gathered, and one layer's all-gather buffer, from "
                "the first backward on",
                fsdp_later[0],
            )
        )
        lines.append(
            Line("fsdp: the stages' gradients, unsharded until the step ends", fsdp_later[1])
        )
    elif fsdp_first:
        what = "two layers" if cfg.strategy.reshard_after_forward else "the stages' layers"
        lines.append(Line(f"fsdp: {what} gathered whole", fsdp_first))
    fsdp = sum(fsdp_later) if after_first and fsdp_later else fsdp_first
    schedule = cfg.strategy.pipeline_schedule
    lines.append(
        Line(
            f"activations ({counted} micro-batches of {rows} samples in flight, {schedule}, "
            f"checkpointing {job.checkpointing[0]})",
            activations,
        )
    )
    lines.append(Line("forward/backward temporaries", step - fsdp - activations))
    lines.append(Line("optimizer step temporaries", optim.temporary))
    phases = {
        "set-up": job.setup(params + buffers, shards > 1 or tp > 1),
        "forward/backward": base + step,
        "optimizer step": params + buffers + grads + optim.state + optim.temporary + kernels,
    }
    if dims.dp > 1 and shards == 1:
        bucket = job.largest_bucket(infos, tp)
        phases["gradient sync"] = params + buffers + grads + optim.state + bucket + kernels
    _, other_activations, other_step, _ = peak_of(0 if job.every else 1)
    first, last = spans[mine[0]], spans[mine[-1]]
    where = f"stage {mine[0]} (layers {first.start}-{first.stop - 1})"
    if len(mine) > 1:
        where = f"stages {', '.join(map(str, mine))} (layers {first.start}-{last.stop - 1})"
    return job.estimate(
        rank=dims.rank_of(pp=rank),
        where=f"pipeline {where}",
        micro_batch_samples=rows,
        lines=lines,
        phases=phases,
        other_activations=other_activations,
        other_peak=max({**phases, "forward/backward": base + other_step}.values()),
        notes=[],
    )
