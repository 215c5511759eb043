"""The one path from a config to a trainer, shared by the CLI, the worker, the tests and the
benchmarks::

    load_job_config(file, overrides)   config file + overrides -> Config, with the task's own
                                       [task] section validated by the task's dataclass
    build_job_config(raw)              the same from nested plain data (tests, benchmarks)
    build_trainer(cfg)                 (in a worker) join the process group, agree on the run
                                       folder and the config, seed, build the task, then the
                                       Trainer
    (dtrain.train.wiring.wire_trainer: the one wiring place, every component of the loop,
    each from its own config section)

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
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from dtrain.checkpoint.rng import seed_everything
from dtrain.comm.plain import broadcast_json
from dtrain.config import Config
from dtrain.config.load import apply_overrides, build_config, read_toml
from dtrain.dist.runtime import Runtime, init_runtime
from dtrain.fsutil import local_run_dir
from dtrain.task import Task, build_task, resolve_task, task_config_class
from dtrain.train.config_agreement import agree_on_config
from dtrain.weights.adapters import load_adapter_into
from dtrain.weights.init_from import init_model
from dtrain.weights.model_config import save_model_config

if TYPE_CHECKING:  # the trainer and all it imports are the worker's: the CLI loads configs here
    from dtrain.train.trainer import Trainer

RUNS_DIR = "runs"
PathLike = str | Path


def load_job_config(path: str | Path | None, overrides: Sequence[str] = ()) -> Config:
    """The job's validated config from a TOML file (None: the defaults) and overrides."""
    raw = read_toml(path) if path is not None else {}
    return build_job_config(apply_overrides(raw, overrides))


def build_job_config(raw: Mapping[str, Any]) -> Config:
    """The job's validated config from nested plain data. The task named in it declares the
    class of its ``[task]`` section: the rest is checked first (naming the task is part of
    it), then the task's section by that class."""
    probe = build_config(raw)
    return build_config(raw, task_config_class(resolve_task(probe.run.task)))


def checked_job_config(config: Config | PathLike | None, overrides: Sequence[str] = ()) -> Config:
    """The job's config from a TOML file's path or a ``Config`` (None: the defaults) and
    ``--section.key=value`` overrides, with the rules that need the job's shape checked at this
    process's world size (``WORLD_SIZE``; 1 for a plain process)."""
    raw = config.to_dict() if isinstance(config, Config) else read_toml(config) if config else {}
    return check_at_world(build_job_config(apply_overrides(raw, overrides)))


def check_at_world(cfg: Config) -> Config:
    """``cfg``'s rules that need the job's shape, at this process's world size."""
    from dtrain.comm.transport import check_transport_job
    from dtrain.config.job import JobShape, validate_job

    shape = JobShape.of_world(int(os.environ.get("WORLD_SIZE", "1")))
    validate_job(cfg, shape)
    check_transport_job(cfg, shape.max_nodes, shape.nnodes)  # an extension's own rules
    return cfg


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
    runtime = join_job(cfg)
    agree_on_config(cfg, runtime)  # one job, one config, whichever machine a rank is on
    return build_agreed_trainer(cfg, runtime)


def join_job(cfg: Config) -> Runtime:
    """Join the job's process group (none for one plain process) and agree on its run
    folder."""
    runtime = init_runtime(cfg.dist)
    agree_on_run_dir(cfg, runtime)
    return runtime


def build_agreed_trainer(cfg: Config, runtime: Runtime) -> Trainer:
    """The task and its trainer once the ranks agreed on ``cfg``: every rank seeded alike, the
    task built, its trainer wired (``fault.recovery = 'inplace'`` builds one per membership
    generation, :mod:`dtrain.train.inplace_worker`)."""
    factory = resolve_task(cfg.run.task)
    seed_everything(cfg.run.seed)
    return wire_task(cfg, build_task(factory, cfg), runtime)


def wire_task(cfg: Config, task: Task, runtime: Runtime) -> Trainer:
    """The trainer of ``task``: its model given ``run.init_from``'s weights and recorded, then
    every component wired (also the engine of a loop of the user's own, :mod:`dtrain.loop`)."""
    loaded = ""
    if cfg.run.init_from:  # before the strategy spreads the model: every rank holds it whole
        loaded = init_model(task.model, cfg.run.init_from, task.init_weights, cfg.run.seed)
    if cfg.run.init_adapter:  # a PEFT model's adapter, over its base
        load_adapter_into(task.model, cfg.run.init_adapter)
    if runtime.is_main:
        # Into this machine's folder; a store's run folder gets a copy with the records.
        save_model_config(task.model, local_run_dir(cfg.run.dir, cfg.run.local_dir))
    from dtrain.train.wiring import wire_trainer  # the worker's loop: not the CLI's import

    trainer = wire_trainer(cfg, task, runtime)
    trainer.run_log.init_from = loaded  # the start line names the checkpoint it came from
    return trainer
