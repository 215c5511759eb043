"""The config's checks across keys: those a whole :class:`Config` answers (at load), and
those that need the job's shape too -- the data-parallel size, the world size: what the
strategy can run (:func:`validate_strategy`, read from its capability record) -- run where
that is known. Each is a one-line :class:`ConfigError` naming the keys."""

from __future__ import annotations

import math
import signal
from collections.abc import Sequence
from itertools import pairwise
from pathlib import Path

from dtrain.config.capabilities import CAPABILITIES, capabilities
from dtrain.config.layout import INTERLEAVED, stages_per_rank, strategy_dims
from dtrain.config.sections import STORE_PIECE_BYTES, Config, OptimConfig
from dtrain.errors import ConfigError

# The strategies whose ranks each hold the whole model and optimizer: a survivor can go on
# alone and a replacement can copy a peer (fault.recovery = 'inplace').
INPLACE_STRATEGIES = tuple(name for name, can in CAPABILITIES.items() if can.heals_in_place)

# The compressions whose every collective is a summing all-reduce (what a shared-memory segment
# carries); tests/test_strategy_capabilities.py holds it to the hooks' own `sums_only`.
SUMMING_COMPRESSIONS = ("none", "fp16", "bf16", "powersgd")
# torch's PowerSGD with error feedback and warm start needs this many plain all-reduces first.
POWERSGD_MIN_START_STEP = 2


# The signals fault.preempt_signals may name: those that mean "stop" when something sends them
# to a job. SIGTERM: the usual stop (Kubernetes, systemd, SLURM's end of a job, `kill`); SIGINT:
# Ctrl-C; SIGHUP: the terminal or session went away; SIGUSR1/SIGUSR2: a scheduler's warning
# before the end (SLURM --signal=USR1@120, LSF, PBS); SIGQUIT: Ctrl-\; SIGXCPU: the CPU-time
# limit reached (a batch system's soft limit, before its SIGKILL). Every other signal is sent in
# the ordinary course of a run or stands for a fault, and a handler on it would stop a healthy
# run or hide a crash: SIGCHLD comes whenever a child process (a data loader's, a compile
# worker's) ends -- it stopped a run at step 1 -- as SIGWINCH on a terminal resize, SIGURG,
# SIGCONT, SIGALRM, SIGPIPE, SIGPROF/SIGVTALRM (profilers); SIGSEGV, SIGBUS, SIGFPE, SIGILL,
# SIGABRT are crashes; SIGTSTP/SIGTTIN/SIGTTOU pause, not stop.
PREEMPT_SIGNALS = ("SIGTERM", "SIGINT", "SIGHUP", "SIGUSR1", "SIGUSR2", "SIGQUIT", "SIGXCPU")


def validate_preempt_signals(names: list[str]) -> None:
    """Each of ``fault.preempt_signals`` is one of :data:`PREEMPT_SIGNALS`."""
    allowed = f"use any of {', '.join(PREEMPT_SIGNALS)}"
    for name in names:
        if name in PREEMPT_SIGNALS:
            continue
        if not isinstance(getattr(signal, name, None), signal.Signals):
            why = f"{name!r} is not a signal name"
        elif name in ("SIGKILL", "SIGSTOP"):
            why = f"{name} cannot be caught (no process can, so it can never make a rank save)"
        else:
            why = (
                f"{name} does not mean 'stop' (it comes in a run's ordinary course or with a fault)"
            )
        raise ConfigError(f"fault.preempt_signals: {why}; {allowed}")


def validate_cross_fields(cfg: Config) -> None:
    """Checks that need more than one key; those that need the world size live in
    :func:`validate_for_world`."""
    if len(cfg.optim.betas) != 2 or not all(0 <= b < 1 for b in cfg.optim.betas):
        raise ConfigError(f"optim.betas = {cfg.optim.betas!r}: expected two numbers in [0, 1)")
    validate_schedule(cfg)
    if cfg.data.micro_batches > cfg.data.global_batch_size:
        raise ConfigError(
            f"data.micro_batches = {cfg.data.micro_batches} is larger than "
            f"data.global_batch_size = {cfg.data.global_batch_size}: "
            "every micro-step needs a sample"
        )
    if cfg.data.cache_bytes < STORE_PIECE_BYTES:  # the unit fetched: a smaller cache reads nothing
        raise ConfigError(
            f"data.cache_bytes = {cfg.data.cache_bytes} is less than one piece of a shard "
            f"({STORE_PIECE_BYTES} bytes, the unit read from an object store); use at least "
            f"{STORE_PIECE_BYTES}"
        )
    validate_preempt_signals(cfg.fault.preempt_signals)
    twice = sorted({name for name in cfg.metrics.trackers if cfg.metrics.trackers.count(name) > 1})
    if twice:
        raise ConfigError(f"metrics.trackers names {twice[0]!r} twice: name each tracker once")
    if cfg.run.resume not in ("auto", "never") and not cfg.run.resume:
        raise ConfigError("run.resume is empty: use 'auto', 'never' or a checkpoint folder")
    parse_activation_checkpointing(cfg.train.activation_checkpointing)
    validate_profile(cfg)
    if not math.log2(cfg.train.loss_scale_init).is_integer():
        raise ConfigError(
            f"train.loss_scale_init = {cfg.train.loss_scale_init!r}: expected a power of two "
            "(scaling by one, and dividing by it again, is then exact)"
        )
    if cfg.fault.recovery == "inplace" and cfg.strategy.name not in INPLACE_STRATEGIES:
        raise ConfigError(
            f"fault.recovery = 'inplace' does not work with strategy.name = "
            f"{cfg.strategy.name!r}: only {' and '.join(INPLACE_STRATEGIES)} keep a whole "
            "replica on every rank to heal from; use fault.recovery = 'restart'"
        )
    if cfg.run.script:
        validate_own_loop(cfg)
        if not Path(cfg.run.script).is_file():
            raise ConfigError(
                f"run.script = {cfg.run.script!r}: no such file (a path from the folder dtrain "
                "runs in)"
            )
    if cfg.fault.min_replicas != 1 and cfg.fault.recovery != "inplace":
        raise ConfigError(
            f"fault.min_replicas = {cfg.fault.min_replicas} applies to fault.recovery = "
            "'inplace' only (restart mode restarts every worker after any failure); remove it "
            "or set fault.recovery = 'inplace'"
        )


def validate_own_loop(cfg: Config) -> None:
    """A loop of the user's own (``run.script``, or ``dtrain.run_main`` under torchrun) runs
    what dtrain's own loop runs, but for a strategy that owns the step."""
    if capabilities(cfg.strategy.name).owns_step:
        raise ConfigError(
            f"strategy.name = {cfg.strategy.name!r} cannot run in a loop of your own: its "
            "schedule runs each step's micro-batches across the stages itself; use dtrain's "
            "loop (run.task) for it, or ddp, allreduce, fsdp or tensor in your own loop"
        )


def validate_schedule(cfg: Config) -> None:
    """The schedule's phases fit in the run: a warm-up-stable-decay schedule's warm-up and
    decay together within ``train.steps``."""
    optim, steps = cfg.optim, cfg.train.steps
    if optim.schedule == "wsd" and optim.warmup_steps + wsd_decay_steps(optim, steps) > steps:
        raise ConfigError(
            f"optim.schedule = 'wsd': optim.warmup_steps = {optim.warmup_steps} and "
            f"optim.decay_steps = {wsd_decay_steps(optim, steps)} add up to more than "
            f"train.steps = {steps}; shorten one of them"
        )


def wsd_decay_steps(optim: OptimConfig, steps: int) -> int:
    """The steps a warm-up-stable-decay schedule decays over: ``optim.decay_steps``, or a
    fifth of the run when it is 0."""
    return optim.decay_steps if optim.decay_steps > 0 else max(1, steps // 5)


def parse_activation_checkpointing(value: str) -> int:
    """``train.activation_checkpointing`` as "every K-th block" (0: none, 1: every block)."""
    if value == "none":
        return 0
    if value == "full":
        return 1
    every = value.removeprefix("every:")
    if every != value and every.isdigit() and int(every) >= 1:
        return int(every)
    raise ConfigError(
        f"train.activation_checkpointing = {value!r}: expected 'none', 'full' or 'every:K' "
        "with K a positive integer (every K-th block)"
    )


def parse_profile(value: str) -> tuple[int, int] | None:
    """``train.profile``: the steps ``(A, B)`` of ``'steps:A-B'`` (``'steps:A'``: ``(A, A)``),
    or None for ``'none'``."""
    if value == "none":
        return None
    form = "expected 'steps:A-B' (the first and last step to record, 1-based) or 'none'"
    kind, _, span = value.partition(":")
    first, dash, last = span.partition("-")
    if kind != "steps" or not first.isdigit() or (dash and not last.isdigit()):
        raise ConfigError(f"train.profile = {value!r}: {form}")
    window = int(first), int(last) if dash else int(first)
    if window[0] < 1 or window[0] > window[1]:
        raise ConfigError(f"train.profile = {value!r}: steps {window[0]} to {window[1]}; {form}")
    return window


def validate_profile(cfg: Config) -> None:
    """``train.profile`` names steps the run takes."""
    window = parse_profile(cfg.train.profile)
    if window is not None and window[1] > cfg.train.steps:
        raise ConfigError(
            f"train.profile = {cfg.train.profile!r}: step {window[1]} is past the run's last "
            f"(train.steps = {cfg.train.steps}); record steps up to {cfg.train.steps}"
        )


def validate_for_world(cfg: Config, data_parallel_size: int) -> None:
    """Checks that depend on how many data-parallel ranks share a global batch."""
    if cfg.balance.mode != "off" and cfg.data.global_batch_size < data_parallel_size:
        raise ConfigError(
            f"data.global_batch_size = {cfg.data.global_batch_size} is smaller than the "
            f"{data_parallel_size} data-parallel ranks: balance.mode = {cfg.balance.mode!r} "
            "gives every rank at least one sample of each global batch"
        )
    per_step = data_parallel_size * cfg.data.micro_batches
    if cfg.data.global_batch_size < per_step:
        raise ConfigError(
            f"data.global_batch_size = {cfg.data.global_batch_size} is smaller than "
            f"{data_parallel_size} data-parallel ranks x {cfg.data.micro_batches} micro-batches = "
            f"{per_step}: every rank needs at least one sample per micro-step"
        )


def validate_strategy(cfg: Config, world_size: int) -> None:
    """Reject, in the parent process, a config its strategy cannot run at this world size:
    the mesh first (its dimensions must divide the world), then the checks at the
    data-parallel size (the other dimensions split the model, not the batch), then what the
    strategy's capability record rules out."""
    name = cfg.strategy.name
    can = capabilities(name)
    dims = strategy_dims(cfg.strategy, world_size)
    validate_for_world(cfg, dims.dp)
    if cfg.strategy.dp_replicate != 1 and not can.on_mesh:
        raise ConfigError(
            f"strategy.dp_replicate = {cfg.strategy.dp_replicate} does not work with "
            f"strategy.name = {name!r}: its data-parallel ranks all hold the whole "
            "model already; it sets the copies of a sharded model (fsdp, or tensor and "
            "pipeline with data_parallel = 'fsdp')"
        )
    if cfg.comm.compression != "none" and not can.comm_hooks:
        raise ConfigError(
            f"comm.compression = {cfg.comm.compression!r} does not work with "
            f"strategy.name = {name!r}: it takes comm.compression = 'none' only "
            "(gradient compression needs a strategy that all-reduces whole gradients "
            "through comm hooks: ddp or allreduce)"
        )
    if cfg.comm.transport != "backend" and not can.comm_hooks:
        # An opt-in transport (dtrain.ext) carries comm hooks' sums; its own rules are its.
        raise ConfigError(
            f"comm.transport = {cfg.comm.transport!r} does not work with strategy.name = "
            f"{name!r}: it carries the gradient all-reduce of ddp and allreduce only; "
            "use comm.transport = 'backend'"
        )
    if can.comm_hooks:
        validate_compression(cfg)
    fused_sgd = cfg.optim.implementation == "fused" and cfg.optim.name == "sgd"
    if fused_sgd and can.holds_dtensors(cfg.strategy):
        raise ConfigError(
            f"optim.implementation = 'fused' with optim.name = 'sgd' does not work with "
            f"strategy.name = {name!r}: torch has no fused SGD for the sharded "
            "parameters (DTensors) it trains; use optim.implementation = 'foreach', or adamw"
        )
    if cfg.strategy.sync_batchnorm:
        validate_sync_batchnorm(cfg)
    if not cfg.strategy.backward_prefetch and not can.shards_model(cfg.strategy):
        raise ConfigError(
            f"strategy.backward_prefetch = false does not work with strategy.name = {name!r}"
            + (f" and data_parallel = {cfg.strategy.data_parallel!r}" if can.on_mesh else "")
            + ": it sets when FSDP gathers a sharded model's blocks in backward (fsdp, or "
            "tensor and pipeline with data_parallel = 'fsdp'); remove it"
        )
    if cfg.balance.mode != "off" and not can.uneven_shares:
        raise ConfigError(
            f"balance.mode = {cfg.balance.mode!r} does not work with strategy.name = "
            f"{name!r}: per-rank batch shares need a strategy whose ranks may run "
            "different numbers of micro-steps (ddp or allreduce); use balance.mode = 'off'"
        )
    if can.mesh == "pipeline":
        validate_pipeline(cfg, dims.dp, dims.pp)


def validate_compression(cfg: Config) -> None:
    """The ``[comm]`` compression keys beyond their own ranges, for a strategy with comm
    hooks."""
    comm = cfg.comm
    least = POWERSGD_MIN_START_STEP
    if comm.compression == "powersgd" and comm.powersgd_start_step < least:
        raise ConfigError(
            f"comm.powersgd_start_step = {comm.powersgd_start_step} is too small for "
            f"powersgd: torch's PowerSGD with error feedback and warm start needs at least "
            f"{least} steps of plain all-reduce first; set it to {least} or more"
        )


def validate_sync_batchnorm(cfg: Config) -> None:
    """``strategy.sync_batchnorm`` where it cannot give one process's math is a config error."""
    name = cfg.strategy.name
    if not capabilities(name).syncs_batchnorm:
        raise ConfigError(
            f"strategy.sync_batchnorm = true does not work with strategy.name = {name!r}: "
            "BatchNorm's statistics are summed over the data-parallel ranks of ddp, allreduce "
            "and fsdp only"
        )
    if cfg.balance.mode != "off":
        raise ConfigError(
            f"strategy.sync_batchnorm = true does not work with balance.mode = "
            f"{cfg.balance.mode!r}: every rank must run the same micro-steps for the "
            "statistics to be summed over all of them; use balance.mode = 'off'"
        )


def validate_pipeline(cfg: Config, data_parallel: int, pp: int) -> None:
    """A pipeline's schedule and boundaries at ``data_parallel`` copies of ``pp`` stages."""
    opts, data = cfg.strategy, cfg.data
    per_step = data_parallel * data.micro_batches
    if data.global_batch_size % per_step:
        raise ConfigError(
            f"data.global_batch_size = {data.global_batch_size} does not split into "
            f"{data_parallel} data-parallel copies x {data.micro_batches} micro-batches of "
            "equal size: a pipeline sends activations of one fixed shape between stages; "
            f"use a multiple of {per_step}"
        )
    if opts.pipeline_schedule == "1f1b" and data.micro_batches < pp:
        raise ConfigError(
            f"data.micro_batches = {data.micro_batches} is fewer than the {pp} "
            "pipeline stages: 1F1B runs a micro-batch's backward as soon as it is through "
            "the last stage, which needs one micro-batch in flight per stage; use "
            f"data.micro_batches >= {pp}, or pipeline_schedule = 'gpipe'"
        )
    if opts.pipeline_schedule == INTERLEAVED:
        rounds = max(1, data.micro_batches // pp)
        if data.micro_batches % rounds:
            raise ConfigError(
                f"data.micro_batches = {data.micro_batches}: interleaved 1F1B runs the "
                f"micro-batches in rounds of the {pp} stages; use a multiple of "
                f"{pp}, or at most {pp}"
            )
    check_boundaries(opts.pipeline_boundaries, pp * stages_per_rank(opts))


def check_boundaries(boundaries: Sequence[int], num_stages: int) -> None:
    """Manual boundaries as the config gives them: the first layer of stages 1..K-1."""
    if not boundaries:
        return
    key = "strategy.pipeline_boundaries"
    if len(boundaries) != num_stages - 1:
        raise ConfigError(
            f"{key} = {list(boundaries)} gives {len(boundaries) + 1} stages, but the job has "
            f"{num_stages}: give the first layer of every stage but the first "
            f"({num_stages - 1} numbers)"
        )
    if boundaries[0] < 1 or any(b <= a for a, b in pairwise(boundaries)):
        raise ConfigError(
            f"{key} = {list(boundaries)} must be strictly increasing and start at 1 or more: "
            "every stage needs at least one layer"
        )
