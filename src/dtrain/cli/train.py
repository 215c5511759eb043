"""``dtrain train``: check what the command line and the config say, then launch. The config's
rules are the config package's (:func:`dtrain.config.job.validate_job`); this module hands them
the job's shape and tells the workers the config they read was checked."""

from __future__ import annotations

import argparse
import os
from typing import TYPE_CHECKING

from dtrain.config.job import CHECKED_ENV, JobShape, validate_job

if TYPE_CHECKING:
    from dtrain.launch.options import LaunchOptions


def cmd_train(args: argparse.Namespace) -> int:
    from dtrain.console import guard_console
    from dtrain.dist.job_env import job_environment
    from dtrain.launch.options import make_options

    guard_console("the launcher")  # a closed output pipe costs the output, never the run
    overrides = args.overrides
    if args.resume is not None:
        overrides = [*overrides, f"--run.resume={args.resume}"]
    opts = make_options(
        args.nproc,
        args.nnodes,
        args.node_rank,
        args.rdzv_endpoint,
        args.max_restarts,
        args.run_id,
        local_addr=args.local_addr,
        iface=args.iface,
        rdzv_timeout_s=args.rdzv_timeout,
    )
    # The job's secret (given, or made for a job on one machine) before anything else -- a
    # machine of a multi-machine job without one stops here, in one line -- and, on one
    # machine, collectives on loopback: in this process's environment, for the workers, while
    # the job runs.
    with job_environment(multi_machine=bool(opts.rdzv_endpoint)):
        return train_job(args, opts, overrides)


def train_job(args: argparse.Namespace, opts: LaunchOptions, overrides: list[str]) -> int:
    """``dtrain train`` once its options are checked and its environment is set."""
    from dtrain.checkpoint.rundir import check_resume_folder, check_run_dir, held_run_dir
    from dtrain.comm.transport import check_transport_job
    from dtrain.launch.launcher import launch
    from dtrain.launch.options import JobSettings
    from dtrain.train.job import default_run_dir, load_job_config
    from dtrain.weights.adapters import check_init_adapter
    from dtrain.weights.init_from import check_init_from

    cfg = load_job_config(args.config, overrides)
    if cfg.metrics.tensorboard:
        from dtrain.metrics.tensorboard import check_available

        check_available()
    if cfg.metrics.trackers:
        from dtrain.metrics.trackers import check_available as check_trackers

        check_trackers(cfg.metrics.trackers)
    validate_job(cfg, job_shape(opts, args.nnodes, cfg.fault.recovery == "inplace"))
    check_transport_job(cfg, opts.max_nodes, args.nnodes)  # an extension's own rules
    check_init_from(cfg.run.init_from)
    check_init_adapter(cfg.run.init_adapter)
    paths = getattr(cfg.task, "dataset_paths", None)  # a task's datasets, if it names them
    if callable(paths):
        from dtrain.data.format import check_store_datasets

        check_store_datasets(list(paths()), "task.data_dir")
    if cfg.run.resume not in ("auto", "never"):
        # Before the run folder is made for this job.
        check_resume_folder(cfg.run.resume, cfg.run.dir)
    if not cfg.run.dir:
        cfg.run.dir = default_run_dir(args.run_id)
    # Writable, held for this job (another live job's hold is refused), and this launcher's
    # config where only its own workers read it.
    with held_run_dir(cfg, opts.run_id, opts.rdzv_endpoint) as config_path:
        os.environ[CHECKED_ENV] = str(config_path)  # its workers need not check it again
        check_run_dir(cfg, args.force)
        return launch(config_path, opts, JobSettings.of(cfg))


def job_shape(opts: LaunchOptions, nnodes: str, in_place: bool) -> JobShape:
    """The rules' view of the launch options; whether this machine can host the in-place
    membership coordinator is asked of its addresses only where that is needed."""
    from dtrain.launch.options import hosts_rendezvous

    hosts = in_place and opts.max_nodes > 1 and hosts_rendezvous(opts)
    return JobShape(
        nproc=opts.nproc,
        min_nodes=opts.min_nodes,
        max_nodes=opts.max_nodes,
        nnodes=nnodes,
        node_rank=opts.node_rank,
        rdzv_endpoint=opts.rdzv_endpoint,
        hosts_endpoint=hosts,
    )
