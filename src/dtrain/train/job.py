"""The one path from a config to a trainer, shared by the CLI, the worker, the tests and the
benchmarks::

    load_job_config(file, overrides)   config file + overrides -> Config, with the task's own
                                       [task] section validated by the task's dataclass
    build_job_config(raw)              the same from nested plain data (tests, benchmarks)
    build_trainer(cfg)                 (in a worker) join the process group, agree on the run
                                       folder and the config, seed, build the task, then the
                                       Trainer
    wire_trainer(cfg, task, runtime)   the one wiring place: every component of the loop,
                                       each from its own config section

The run folder, when the config names none, follows one rule wherever it is chosen
(:func:`default_run_dir`): ``runs/<run id>`` when the job has an id (``--run-id``, torchrun's
``--rdzv-id``), so that every machine of the job and every restart of it land in the same
folder and resume there; else ``runs/<date-time>``, chosen once (by the CLI, or by rank 0 of a
plain ``torchrun`` job) and shared with every rank.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch.distributed as dist

from dtrain.balance.balancer import LoadBalancer
from dtrain.balance.slowdown import Slowdown
from dtrain.balance.timing import StepTimer
from dtrain.checkpoint.rng import seed_everything
from dtrain.checkpoint.state import TrainingState
from dtrain.checkpoint.write import Checkpointer
from dtrain.comm.plain import broadcast_json
from dtrain.compute.precision import LossScaler
from dtrain.config import Config, validate_balance_world, validate_ranks
from dtrain.config.load import apply_overrides, build_config, read_toml
from dtrain.data.build import build_train_loader
from dtrain.dist.runtime import Runtime, init_runtime
from dtrain.errors import UserError
from dtrain.fault.watchdog import Watchdog
from dtrain.metrics import records
from dtrain.metrics.run_log import RunLog
from dtrain.metrics.tensorboard import check_available as check_tensorboard
from dtrain.parallel import build_strategy
from dtrain.task import Task, build_task, resolve_task, task_config_class
from dtrain.train.config_agreement import agree_on_config
from dtrain.train.evaluation import check_metrics
from dtrain.train.loss_contract import LossContract
from dtrain.train.nan_guard import NanGuard
from dtrain.train.optim_choice import OptimizerKinds, build_run_optimizer, build_run_scheduler
from dtrain.train.step import ForwardBackward
from dtrain.train.trainer import Counters, Trainer
from dtrain.weights.init_from import init_model
from dtrain.weights.model_config import save_model_config

RUNS_DIR = "runs"


def load_job_config(path: str | Path | None, overrides: Sequence[str] = ()) -> Config:
    """The job's validated config from a TOML file (None: the defaults) and overrides."""
    raw = read_toml(path) if path is not None else {}
    return build_job_config(apply_overrides(raw, overrides))


def build_job_config(raw: Mapping[str, Any]) -> Config:
    """The job's validated config from nested plain data. The task named in it declares the
    class of its ``[task]`` section: the rest is checked first (naming the task is part of
    it), then the task's section by that class."""
    probe = build_config(raw)
    factory = resolve_task(probe.run.task)
    return build_config(raw, task_config_class(factory))


def default_run_dir(run_id: str = "") -> str:
    """``runs/<run id>``, or ``runs/<date-time>`` for a job without an id."""
    # torchrun without --rdzv-id calls the run "none": that names no job.
    name = run_id if run_id and run_id != "none" else time.strftime("%Y%m%d-%H%M%S")
    return str(Path(RUNS_DIR) / name)


def agree_on_run_dir(cfg: Config, runtime: Runtime) -> None:
    """Fill in ``run.dir`` when the config leaves it empty (a worker started by plain
    ``torchrun``): rank 0 picks it and every rank takes the same, so that two ranks starting
    on either side of a second boundary never write to two folders."""
    if cfg.run.dir:
        return
    chosen = default_run_dir(os.environ.get("TORCHELASTIC_RUN_ID", ""))
    if runtime.world_size > 1 and dist.is_initialized():
        chosen = broadcast_json(chosen, src=0)
    cfg.run.dir = str(chosen)


def build_trainer(cfg: Config) -> Trainer:
    """In a worker: join the job's process group, then build the task and its trainer. Every
    rank seeds the same before the task builds its model, so the replicas start equal."""
    runtime = init_runtime(cfg.dist)
    agree_on_run_dir(cfg, runtime)
    return build_trainer_on(cfg, runtime)


def build_trainer_on(cfg: Config, runtime: Runtime) -> Trainer:
    """The task and its trainer in a process group that is up (``fault.recovery = 'inplace'``
    builds one per membership generation, dtrain.recovery.inplace)."""
    agree_on_config(cfg, runtime)  # one job, one config, whichever machine a rank is on
    factory = resolve_task(cfg.run.task)
    seed_everything(cfg.run.seed)
    task = build_task(factory, cfg)
    if cfg.run.init_from:  # before the strategy spreads the model: every rank holds it whole
        init_model(task.model, cfg.run.init_from, task.init_weights, cfg.run.seed)
    if runtime.is_main:
        save_model_config(task.model, Path(cfg.run.dir))
    return wire_trainer(cfg, task, runtime)


def wire_trainer(cfg: Config, task: Task, runtime: Runtime) -> Trainer:
    """The one wiring place: every component of the loop built from the config, each given its
    own section and the few things it works on, and handed to the trainer, which only keeps
    them. In this order on every rank: some builds are collective (the strategy's set-up, the
    hosts' names)."""
    if cfg.metrics.tensorboard:  # every rank, before the first collective
        check_tensorboard()
    strategy = build_strategy(cfg, runtime)
    strategy.setup(task)
    # What the run writes: status, records to rank 0's sinks, log lines (dtrain.metrics).
    run_log = RunLog(cfg, runtime, strategy, task.item_name)
    # The task's optimizer and schedule, or the config's (dtrain.train.optim_choice).
    optimizer = build_run_optimizer(task, strategy, cfg)
    scheduler = build_run_scheduler(task, optimizer, cfg)
    dp_size = strategy.data_parallel_size
    loader = build_train_loader(task, cfg, strategy.data_parallel_rank, dp_size, runtime.device)
    # A worker started without the CLI's checks (plain torchrun) meets them here.
    validate_ranks(cfg, runtime.world_size)
    validate_balance_world(cfg, runtime.world_size, dp_size)
    # Per-rank phase timing (the optimizer's step timed by its hooks), straggler reports and
    # (balance.mode) per-rank batch shares.
    timer = StepTimer(strategy.comm, optimizer, runtime.device)
    debug, slowdown = cfg.debug, None
    if debug.slowdown_rank == runtime.rank and debug.slowdown_factor > 1:
        slowdown = Slowdown(
            strategy.unwrapped,
            debug.slowdown_factor,
            debug.slowdown_from_step,
            debug.slowdown_to_step,
        )
    balance = LoadBalancer(
        cfg.balance, runtime, dp_size, timer, strategy.comm, run_log.log, task.item_name, slowdown
    )
    # fp16-mixed: the dynamic loss scale (dtrain.compute.precision), part of the training state.
    scaler = None
    if strategy.recipe.precision.scales_loss:
        scaler = LossScaler(cfg.train.loss_scale_init, cfg.train.loss_scale_growth_interval)
    contract = LossContract(task.count_items)
    # Forward and backward over a step's micro-batches, and the ranks' agreement on it.
    forward_backward = ForwardBackward(strategy, runtime.device, scaler, contract)
    counters = Counters(forward_backward)
    # What a checkpoint holds, built once: save and load see these parts, never the trainer.
    parts: dict[str, Any] = {
        # First: it refuses another optimizer's or schedule's checkpoint before any part of it
        # is loaded.
        "kinds": OptimizerKinds(optimizer, scheduler),
        "scheduler": scheduler,
        "data": loader,
        "trainer": counters,
        "balance": balance,
    }
    if scaler is not None:
        parts["loss_scaler"] = scaler
    # balance: checkpoints from before load balancing; loss_scaler: from a run in another
    # precision (the scale starts afresh); kinds: from before they were kept.
    optional = frozenset({"balance", "loss_scaler", "kinds"})
    state = TrainingState(strategy, optimizer, parts, runtime, cfg, optional)
    run_dir = Path(cfg.run.dir)
    watchdog = Watchdog(
        runtime.rank,
        runtime.world_size,
        heartbeat_s=cfg.fault.heartbeat_s,
        timeout_s=cfg.dist.timeout_s,
        run_dir=run_dir,  # RUN_DIR/liveness/rankN: this rank's liveness record
        # This rank's speed, read on the watchdog's thread (the timer replaces its `last`
        # dict whole, so reading it there is safe).
        stats=lambda: records.beat_stats(timer.last, task.item_name, runtime.device),
    )
    checkpointer = Checkpointer(
        run_dir / "checkpoints",
        rank=runtime.rank,
        world_size=runtime.world_size,
        keep_last=cfg.checkpoint.keep_last,
        keep_every=cfg.checkpoint.keep_every,
        timeout=runtime.timeout,
        log=run_log.log,
        on_progress=watchdog.tick,
    )
    check_metrics(task.metrics)  # before the first step, not at the first evaluation
    per_sample = task.items_per_sample
    if per_sample is not None and (isinstance(per_sample, bool) or per_sample < 1):
        raise UserError(f"Task.items_per_sample = {per_sample!r}: expected a positive integer")
    return Trainer(
        cfg,
        task,
        runtime,
        strategy=strategy,
        run_log=run_log,
        optimizer=optimizer,
        scheduler=scheduler,
        loader=loader,
        balance=balance,
        scaler=scaler,
        forward_backward=forward_backward,
        counters=counters,
        state=state,
        watchdog=watchdog,
        checkpointer=checkpointer,
        # Decides on a step with a non-finite gradient: skip, or roll back after N in a row.
        nan_guard=NanGuard(cfg.fault.nan_rollback_after),
    )
