"""The config's checks across keys: those a whole :class:`Config` answers (at load), and
those that need the job's shape too -- the data-parallel size, the world size -- run where
that is known. Each is a one-line :class:`ConfigError` naming the keys."""

from __future__ import annotations

import math
import signal

from dtrain.config.sections import Config, OptimConfig
from dtrain.errors import ConfigError

# The strategies whose ranks each hold the whole model and optimizer: a survivor can go on
# alone and a replacement can copy a peer (fault.recovery = 'inplace').
INPLACE_STRATEGIES = ("ddp", "allreduce")


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
    validate_preempt_signals(cfg.fault.preempt_signals)
    if cfg.run.resume not in ("auto", "never") and not cfg.run.resume:
        raise ConfigError("run.resume is empty: use 'auto', 'never' or a checkpoint folder")
    parse_activation_checkpointing(cfg.train.activation_checkpointing)
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
    if cfg.fault.min_replicas != 1 and cfg.fault.recovery != "inplace":
        raise ConfigError(
            f"fault.min_replicas = {cfg.fault.min_replicas} applies to fault.recovery = "
            "'inplace' only (restart mode restarts every worker after any failure); remove it "
            "or set fault.recovery = 'inplace'"
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
