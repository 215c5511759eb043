"""``dtrain train``: check what the command line and the config say, then launch."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from dtrain.errors import UserError

if TYPE_CHECKING:
    from dtrain.launch.elastic import LaunchOptions


def cmd_train(args: argparse.Namespace, overrides: list[str]) -> int:
    from dtrain.console import guard_console
    from dtrain.dist.job_env import job_environment
    from dtrain.launch.elastic import make_options

    guard_console("the launcher")  # a closed output pipe costs the output, never the run
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
    from dtrain.comm.transport import check_transport_machines
    from dtrain.launch.elastic import launch_workers
    from dtrain.parallel import strategy_class
    from dtrain.train.job import default_run_dir, load_job_config
    from dtrain.weights.init_from import check_init_from

    cfg = load_job_config(args.config, overrides)
    if cfg.metrics.tensorboard:
        from dtrain.metrics.tensorboard import check_available

        check_available()
    strategy_class(cfg.strategy.name).validate_config(cfg, opts.min_world_size)
    check_transport_machines(cfg.comm, opts.max_nodes, args.nnodes)
    if opts.max_world_size != opts.min_world_size:
        strategy_class(cfg.strategy.name).validate_config(cfg, opts.max_world_size)
    check_init_from(cfg.run.init_from)
    if cfg.fault.recovery == "inplace" and opts.max_nodes > 1:
        from dtrain.launch.inplace import check_machines

        check_machines(opts, args.nnodes)
    if cfg.fault.recovery == "inplace" and cfg.fault.min_replicas > opts.max_world_size:
        raise UserError(
            f"fault.min_replicas = {cfg.fault.min_replicas} is more than the job's "
            f"{opts.max_world_size} workers (--nproc {args.nproc}): it could never train; "
            "lower fault.min_replicas or raise --nproc"
        )
    if cfg.run.resume not in ("auto", "never"):
        # Before the run folder is made for this job.
        check_resume_folder(cfg.run.resume, cfg.run.dir)
    if not cfg.run.dir:
        cfg.run.dir = default_run_dir(args.run_id)
    # Writable, held for this job (another live job's hold is refused), and this launcher's
    # config where only its own workers read it.
    with held_run_dir(cfg, opts.run_id, opts.rdzv_endpoint) as config_path:
        check_run_dir(cfg, args.force)
        if cfg.fault.recovery == "inplace":
            from dtrain.launch.inplace import launch_in_place

            return launch_in_place(
                config_path,
                opts,
                grace_s=cfg.fault.preempt_grace_s,
                preempt_signals=cfg.fault.preempt_signals,
                collective_timeout_s=cfg.dist.timeout_s,
                min_replicas=cfg.fault.min_replicas,
            )
        return launch_workers(
            config_path,
            opts,
            grace_s=cfg.fault.preempt_grace_s,
            preempt_signals=cfg.fault.preempt_signals,
            collective_timeout_s=cfg.dist.timeout_s,
        )
