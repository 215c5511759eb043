"""The one wiring place: every component of a worker's training loop built from the config,
each given its own section and the few things it works on, and handed to the
:class:`~dtrain.train.trainer.Trainer`, which only keeps them (torchtitan's habit: one place
to read how a run is put together)."""

from __future__ import annotations

from typing import Any

from dtrain.balance.balancer import LoadBalancer
from dtrain.balance.timing import StepTimer
from dtrain.checkpoint.resume import starts_afresh
from dtrain.checkpoint.state import TrainingState
from dtrain.checkpoint.write import Checkpointer
from dtrain.comm.plain import all_gather_json
from dtrain.compute.precision import LossScaler
from dtrain.config import Config
from dtrain.data.build import build_train_loader, check_task_data
from dtrain.data.loader import RankLoader, StepLoader
from dtrain.dist.runtime import Runtime
from dtrain.errors import UserError
from dtrain.fault.watchdog import Watchdog
from dtrain.fsutil import local_run_dir
from dtrain.metrics import records
from dtrain.metrics.run_log import RunLog
from dtrain.metrics.tensorboard import check_available as check_tensorboard
from dtrain.metrics.trackers import check_available as check_trackers
from dtrain.parallel import build_strategy
from dtrain.parallel.base import Strategy
from dtrain.storage.objects import Location, location
from dtrain.task import Task
from dtrain.train.evaluation import check_metrics
from dtrain.train.loss_contract import LossContract
from dtrain.train.nan_guard import NanGuard
from dtrain.train.optim_choice import OptimizerKinds, build_run_optimizer, build_run_scheduler
from dtrain.train.profile import StepProfiler
from dtrain.train.step import ForwardBackward
from dtrain.train.trainer import Counters, Trainer


def wire_trainer(cfg: Config, task: Task, runtime: Runtime) -> Trainer:
    """The one wiring place: every component of the loop built from the config, each given its
    own section and the few things it works on, and handed to the trainer, which only keeps
    them. In this order on every rank: some builds are collective (the strategy's set-up, the
    hosts' names)."""
    if cfg.metrics.tensorboard:  # every rank, before the first collective
        check_tensorboard()
    check_task_data(task, cfg)  # a stream's mistakes, before the model is spread
    check_trackers(cfg.metrics.trackers)
    strategy = build_strategy(cfg, runtime)
    dp_size = strategy.data_parallel_size
    # A stream's ranks exchange their shard positions after every step (dtrain.data.
    # stream_loader): over the whole job, where ranks of one data-parallel rank say the same.
    exchange = all_gather_json if runtime.world_size > 1 else None
    loader = build_train_loader(
        task, cfg, strategy.data_parallel_rank, dp_size, runtime.device, exchange
    )
    checkpoints = location(cfg.run.dir) / "checkpoints"
    reads_ahead = isinstance(loader, RankLoader) and loader.ahead is not None  # a store's
    if reads_ahead and starts_afresh(cfg, checkpoints):
        # The position is the start: the first steps' pieces (from a store) are fetched while
        # the model is spread and the optimizer built. Else once the checkpoint is chosen.
        loader.warm()
    try:
        return wire_components(cfg, task, runtime, strategy, loader, checkpoints)
    except BaseException:
        loader.close()  # its read-ahead stops with a wiring that failed
        raise


def wire_components(
    cfg: Config,
    task: Task,
    runtime: Runtime,
    strategy: Strategy,
    loader: StepLoader,
    checkpoints: Location,
) -> Trainer:
    """The rest of :func:`wire_trainer`, once the loader (maybe reading ahead) is built."""
    dp_size = strategy.data_parallel_size
    strategy.setup(task)
    # What the run writes: status, records to rank 0's sinks, log lines (dtrain.metrics).
    run_log = RunLog(cfg, runtime, strategy, task.item_name)
    # The task's optimizer and schedule, or the config's (dtrain.train.optim_choice).
    optimizer = build_run_optimizer(task, strategy, cfg)
    scheduler = build_run_scheduler(task, optimizer, cfg)
    if loader.notice():
        run_log.log(loader.notice())
    # Per-rank phase timing (the optimizer's step timed by its hooks), straggler reports and
    # (balance.mode) per-rank batch shares.
    timer = StepTimer(strategy.comm, optimizer, runtime.device)
    balance = LoadBalancer(
        cfg.balance, runtime, dp_size, timer, strategy.comm, run_log.log, task.item_name
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
    # loss_scaler: from a run in another precision (the scale starts afresh).
    optional = frozenset({"loss_scaler"})
    state = TrainingState(strategy, optimizer, parts, runtime, cfg, optional)
    run_dir = local_run_dir(cfg.run.dir, cfg.run.local_dir)  # this machine's
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
        checkpoints,
        rank=runtime.rank,
        world_size=runtime.world_size,
        keep_last=cfg.checkpoint.keep_last,
        keep_every=cfg.checkpoint.keep_every,
        timeout=runtime.timeout,
        background=cfg.checkpoint.async_save,
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
        # train.profile: a torch.profiler trace of a window of steps (nothing outside it).
        profiler=StepProfiler(cfg, runtime.rank, runtime.device),
    )
