"""The ``dtrain`` command: parse, validate, then hand over. No training logic lives here."""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from dtrain.errors import USER_ERROR_EXIT_CODE, UserError
from dtrain.process_exit import freeze_heap_at_exit

if TYPE_CHECKING:
    from dtrain.launch.elastic import LaunchOptions


def _train_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "train",
        help="train a task on one or more machines",
        description="Train a task. Any config key can be set as --section.key=value "
        "(see `dtrain config --list`).",
    )
    p.add_argument("config", nargs="?", help="TOML config file (default: the built-in GPT job)")
    p.add_argument(
        "--nproc",
        type=int,
        default=None,
        help="workers on this machine (default: one per GPU, else up to 4 on CPU)",
    )
    p.add_argument("--nnodes", default="1", help="machines: N, or MIN:MAX for elastic jobs")
    p.add_argument("--node-rank", type=int, default=None, help="this machine's rank")
    p.add_argument(
        "--rdzv-endpoint",
        default="",
        help="HOST:PORT of the rendezvous (needed with several machines)",
    )
    p.add_argument(
        "--local-addr",
        default="",
        help="the address this machine advertises to the others, where they reach its ranks "
        "and, if rank 0 is here, the job's store (default: the one it reaches the rendezvous "
        "host from)",
    )
    p.add_argument(
        "--iface",
        default="",
        help="network interface of the collectives (GLOO/NCCL_SOCKET_IFNAME; default: the one "
        "holding the advertised address)",
    )
    p.add_argument(
        "--rdzv-timeout",
        type=int,
        default=900,
        help="seconds to wait for the rendezvous host and the other machines",
    )
    p.add_argument(
        "--max-restarts",
        type=int,
        default=0,
        help="restarts of the worker group after a failure (resumes from the newest checkpoint)",
    )
    p.add_argument("--run-id", default="", help="rendezvous id, the same on every machine")
    p.add_argument(
        "--resume", default=None, help="auto | never | a step-N checkpoint folder (sets run.resume)"
    )
    p.add_argument(
        "--force",
        action="store_true",
        help="resume even though the config differs from the checkpoint's",
    )


def _estimate_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "estimate",
        help="the memory each rank needs to train a config, without allocating the model",
        description="Estimate the memory one rank needs to train CONFIG on --nproc x --nnodes "
        "ranks: parameters, gradients, optimizer state and activations (one micro-batch, "
        "with and without activation checkpointing) for the rank that holds the most, under "
        "the configured strategy, mesh and train.precision. The model is built on the meta "
        "device and its forward and backward run on fake tensors: nothing of its size is "
        "allocated. Not counted: the runtime's own memory (torch, the process group, a GPU's "
        "CUDA context, the kernels' workspaces; on a CPU under bf16-mixed oneDNN's kernels for "
        "the step's bfloat16 products are counted), the data, allocator slack. Any config key "
        "can be set as "
        "--section.key=value. See docs/strategies.md.",
    )
    p.add_argument("config", nargs="?", help="TOML config file (default: the built-in GPT job)")
    p.add_argument("--nproc", type=int, required=True, help="workers per machine")
    p.add_argument("--nnodes", type=int, default=1, help="machines (default 1)")
    p.add_argument(
        "--memory",
        default=None,
        help="per-rank budget to check the peak against, e.g. 80GB (10^9 bytes) or 80GiB",
    )
    p.add_argument("--json", action="store_true", help="print the estimate as JSON")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dtrain", description="Distributed training for PyTorch.")
    sub = parser.add_subparsers(dest="command", required=True)
    _train_parser(sub)
    p = sub.add_parser("prepare", help="turn raw data into a sharded dataset")
    p.add_argument("source", help="text file or folder, JSONL, .npy file/folder, Parquet")
    p.add_argument("out_dir", help="dataset folder to create")
    p.add_argument("--format", default="auto", choices=["auto", "text", "jsonl", "npy", "parquet"])
    p.add_argument("--field", default="text", help="JSONL/Parquet field holding the text")
    p.add_argument("--columns", default="", help="Parquet columns to keep (comma separated)")
    p.add_argument("--shard-mb", type=float, default=64.0, help="target shard size in MB")
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="replace OUT when it is a dtrain dataset (nothing else is replaced)",
    )
    p.add_argument(
        "--tokenizer",
        default="",
        help="a Hugging Face tokenizer.json: text becomes its token ids (uint16 or uint32 by "
        "the vocabulary's size) instead of bytes; needs pip install 'dtrain[tokenizers]'",
    )
    p.add_argument(
        "--eos",
        default=None,
        help="with --tokenizer: a token of its vocabulary appended to every document "
        "(e.g. '<|endoftext|>')",
    )
    p = sub.add_parser("verify", help="check a dataset's files against its manifest")
    p.add_argument("data_dir")
    p = sub.add_parser("config", help="print the resolved config (or every option with --list)")
    p.add_argument("config", nargs="?")
    p.add_argument("--list", action="store_true", help="list every option with its default")
    p.add_argument(
        "--markdown", action="store_true", help="every option as a Markdown table (docs/config.md)"
    )
    sub.add_parser("strategies", help="list the parallel strategies")
    _estimate_parser(sub)
    p = sub.add_parser(
        "report",
        help="plots and an HTML page of one or more runs (several: their curves overlaid)",
        description="Write PNG plots and one self-contained HTML page from run folders' "
        "metrics.jsonl (needs matplotlib: pip install 'dtrain[report]').",
    )
    p.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="run folder(s) to report on")
    p.add_argument(
        "--out",
        default="",
        help="output folder (default: RUN_DIR/report for one run, ./report for several)",
    )
    p = sub.add_parser(
        "rendezvous",
        help="serve a multi-machine job's rendezvous apart from the machines that train",
        description="Serve the rendezvous of a multi-machine job on this machine, so that it "
        "outlives any training machine (docs/multi-host.md). Start `dtrain train` on every "
        "machine with --rdzv-endpoint THIS_MACHINE:PORT.",
    )
    p.add_argument("--port", type=int, default=29400, help="TCP port to serve on")
    p.add_argument(
        "--bind",
        default="",
        help="the address to listen on, the one the machines reach this one at (default: the "
        "address of the default route's interface; 0.0.0.0: every address, with a warning)",
    )
    p = sub.add_parser(
        "status",
        help="a run's step, ETA, last loss and every rank's last heartbeat and speed",
    )
    p.add_argument("run_dir", metavar="RUN_DIR")
    p = sub.add_parser(
        "export",
        help="a run's model as one state dict (or a Hugging Face folder), from any strategy",
        description="Write the model of a run's newest committed checkpoint (or --step N; or "
        "of a step-N checkpoint folder) as one consolidated state dict with the model's own "
        "names, from any strategy's checkpoint at any world size. The run folder is only read.",
    )
    p.add_argument("run_dir", metavar="RUN_DIR", help="run folder or step-N checkpoint folder")
    p.add_argument("out", metavar="OUT", help="file to write (a folder for --format hf)")
    p.add_argument("--step", type=int, default=None, help="the checkpoint of this step")
    p.add_argument(
        "--format",
        default="safetensors",
        choices=["safetensors", "torch", "hf"],
        help="safetensors (default) or torch: a state dict in a file; hf: a folder "
        "from_pretrained loads (a run of a Hugging Face model)",
    )
    return parser


def split_overrides(extra: Sequence[str]) -> list[str]:
    overrides = []
    for arg in extra:
        if arg.startswith("--") and "." in arg.split("=", 1)[0] and "=" in arg:
            overrides.append(arg)
        elif arg.startswith("--") and "." in arg:
            raise UserError(f"override {arg!r} has no value; write it as {arg}=VALUE")
        else:
            raise UserError(
                f"unrecognized argument {arg!r} (config keys are set as --section.key=value)"
            )
    return overrides


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
    from dtrain.config import validate_ranks
    from dtrain.launch.elastic import launch_workers
    from dtrain.parallel import strategy_class
    from dtrain.parallel.state_form import check_state_form
    from dtrain.train.job import default_run_dir, load_job_config
    from dtrain.weights.init_from import check_init_from

    cfg = load_job_config(args.config, overrides)
    if cfg.metrics.tensorboard:
        from dtrain.metrics.tensorboard import check_available

        check_available()
    strategy_class(cfg.strategy.name).validate_config(cfg, opts.min_world_size)
    if cfg.comm.transport == "shm" and opts.max_nodes > 1:
        raise UserError(
            f"comm.transport = 'shm' needs every rank on one machine, but --nnodes {args.nnodes} "
            "allows more; use comm.transport = 'auto' (shared memory where it can be used)"
        )
    validate_ranks(cfg, opts.min_world_size)  # a rank the config names exists in every world
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
        resume_from = check_run_dir(cfg, args.force)
        if resume_from is not None:
            check_state_form(strategy_class(cfg.strategy.name), resume_from)
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


def cmd_prepare(args: argparse.Namespace) -> int:
    from dtrain.data.prepare import prepare

    columns = [c for c in args.columns.split(",") if c] or None
    if args.shard_mb <= 0:
        raise UserError(f"--shard-mb {args.shard_mb}: must be positive")
    tokenizer = None
    if args.tokenizer:
        from dtrain.data.tokenizer import load_tokenizer

        tokenizer = load_tokenizer(args.tokenizer, args.eos)
    elif args.eos is not None:
        raise UserError(f"--eos {args.eos!r} needs --tokenizer (bytes have no end token)")
    started = time.perf_counter()
    out = prepare(
        args.source,
        args.out_dir,
        fmt=args.format,
        field=args.field,
        columns=columns,
        tokenizer=tokenizer,
        vocab_size=tokenizer.vocab_size if tokenizer is not None else None,
        shard_bytes=int(args.shard_mb * 2**20),
        overwrite=args.overwrite,
        metadata=tokenizer.metadata() if tokenizer is not None else None,
    )
    from dtrain.data.shards import read_manifest

    manifest = read_manifest(out)
    size = sum(f["bytes"] for s in manifest["shards"] for f in s["files"].values())
    elapsed = time.perf_counter() - started
    print(
        f"wrote {manifest['num_samples']} samples in {len(manifest['shards'])} shard(s), "
        f"{size / 1e6:.1f} MB, to {out} in {elapsed:.1f}s ({size / 1e6 / elapsed:.1f} MB/s)"
    )
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    from dtrain.data.shards import read_manifest, verify_dataset

    started = time.perf_counter()
    manifest = read_manifest(args.data_dir)
    bad = verify_dataset(args.data_dir)
    elapsed = time.perf_counter() - started
    if bad:
        print(f"{args.data_dir}: {len(bad)} bad file(s):", file=sys.stderr)
        for item in bad:
            print(f"  {item}", file=sys.stderr)
        return 1
    files = sum(len(s["files"]) for s in manifest["shards"])
    print(
        f"{args.data_dir}: OK ({manifest['num_samples']} samples, {files} files, "
        f"verified in {elapsed:.2f}s)"
    )
    return 0


def cmd_config(args: argparse.Namespace, overrides: list[str]) -> int:
    from dtrain.config import describe_options
    from dtrain.train.job import load_job_config

    if args.list:
        for key, default, text in describe_options():
            print(f"{key:32s} {default!r:28s} {text}")
        return 0
    if args.markdown:
        print(options_markdown(), end="")
        return 0
    cfg = load_job_config(args.config, overrides)
    from dtrain.parallel import strategy_class

    strategy_class(cfg.strategy.name)  # a name `dtrain train` would refuse, refused here too
    print(cfg.to_toml(), end="")
    return 0


def options_markdown() -> str:
    import dataclasses
    import textwrap

    from dtrain.config import describe_options
    from dtrain.tasks.gpt import GPTTaskConfig

    # The default job's own keys, from its config class (a hand-kept list fell behind).
    task_keys = ", ".join(f"`{f.name}`" for f in dataclasses.fields(GPTTaskConfig))
    intro = (
        "Generated by `dtrain config --markdown`; a test keeps it in step with the code. "
        "Set any key in a TOML file (`[section]` then `key = value`) or on the command line "
        "(`--section.key=value`). The task's own options live in `[task]` (for the default "
        f"job: {task_keys})."
    )
    lines = [
        "# Configuration reference",
        "",
        *textwrap.wrap(intro, width=96, break_on_hyphens=False),
        "",
        "| key | default | meaning |",
        "|---|---|---|",
    ]
    for key, default, text in describe_options():
        shown = repr(default).replace("|", "\\|")
        lines.append(f"| `{key}` | `{shown}` | {text} |")
    return "\n".join(lines) + "\n"


def cmd_report(args: argparse.Namespace) -> int:
    from dtrain.report import write_report

    out = Path(args.out) if args.out else None
    page = write_report([Path(d) for d in args.run_dirs], out)
    print(f"wrote {page}")
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    from dtrain.report.status import run_status

    print(run_status(Path(args.run_dir)))
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from dtrain.weights.export import export

    model = export(args.run_dir, args.out, args.step, args.format)
    if model.note:
        print(f"note: {model.note}")
    tensors = len(model.state)
    print(f"wrote {args.out} ({args.format}): {tensors} tensors from {model.step_dir}")
    return 0


def cmd_estimate(args: argparse.Namespace, overrides: list[str]) -> int:
    from dtrain.estimate.memory import estimate_memory
    from dtrain.estimate.report import format_json, format_table, parse_bytes
    from dtrain.train.job import load_job_config

    if args.nproc < 1 or args.nnodes < 1:
        raise UserError(f"--nproc {args.nproc} --nnodes {args.nnodes}: both must be at least 1")
    budget = parse_bytes(args.memory) if args.memory is not None else None
    cfg = load_job_config(args.config, overrides)
    estimate = estimate_memory(cfg, args.nproc * args.nnodes, budget)
    print(format_json(estimate) if args.json else format_table(estimate))
    return 0


def cmd_strategies() -> int:
    from dtrain.parallel import strategy_class, strategy_names

    for name in strategy_names():
        doc = (strategy_class(name).__doc__ or "").strip().splitlines()
        print(f"{name:12s} {doc[0] if doc else ''}")
    return 0


def quiet_launcher_store_logs() -> None:
    """Before torch is imported in the launcher: its C++ store client logs every failed call
    with a stack trace of some 30 frames (the rendezvous store of a machine that has gone, a
    keep-alive during an outage, the close of a rendezvous whose host exited first at the end
    of a successful run). The launcher reports every failure itself, in a line; the workers,
    started afresh, keep torch's logging as it was."""
    if "torch" in sys.modules:
        return
    own = os.environ.get("TORCH_CPP_LOG_LEVEL")
    os.environ["TORCH_CPP_LOG_LEVEL"] = "FATAL"
    import torch  # noqa: F401  (reads the level once, as it loads)

    if own is None:
        del os.environ["TORCH_CPP_LOG_LEVEL"]
    else:
        os.environ["TORCH_CPP_LOG_LEVEL"] = own


def main(argv: Sequence[str] | None = None) -> int:
    freeze_heap_at_exit()
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if args.command in ("train", "rendezvous"):
        quiet_launcher_store_logs()
    try:
        if extra and args.command not in ("train", "config", "estimate"):  # no config keys
            raise UserError(
                f"unrecognized arguments: {' '.join(extra)} (see dtrain {args.command} --help)"
            )
        overrides = split_overrides(extra)
        if args.command == "train":
            return cmd_train(args, overrides)
        if args.command == "prepare":
            return cmd_prepare(args)
        if args.command == "verify":
            return cmd_verify(args)
        if args.command == "config":
            return cmd_config(args, overrides)
        if args.command == "report":
            return cmd_report(args)
        if args.command == "status":
            return cmd_status(args)
        if args.command == "export":
            return cmd_export(args)
        if args.command == "rendezvous":
            from dtrain.launch.rendezvous_host import serve

            return serve(args.port, args.bind)
        if args.command == "estimate":
            return cmd_estimate(args, overrides)
        return cmd_strategies()
    except UserError as exc:
        print(f"dtrain: error: {exc}", file=sys.stderr)
        return USER_ERROR_EXIT_CODE
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # The reader of the output went away (`dtrain status RUN | head -3`, `dtrain config
        # --list | less` quit early): it has what it wanted. Quiet, as other Unix tools, with
        # their exit status (SIGPIPE's). `dtrain train` guards its console itself.
        from dtrain.console import drop_stdout

        drop_stdout()
        return 128 + int(signal.SIGPIPE)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
