"""The ``dtrain`` command line: every subcommand and its options."""

from __future__ import annotations

import argparse


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
        "can be set as --section.key=value. See docs/strategies.md.",
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
    p.add_argument(
        "out_dir",
        help="dataset folder to create, or a prefix in an object store (s3://BUCKET/data)",
    )
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
        "the vocabulary's size) instead of bytes; needs pip install -e '.[tokenizers]' in "
        "dtrain's clone",
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
        "metrics.jsonl (needs matplotlib: pip install -e '.[report]' in dtrain's clone).",
    )
    p.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="run folder(s) to report on")
    p.add_argument(
        "--out",
        default="",
        help="output folder (default: RUN_DIR/report for one run, ./report for several)",
    )
    p.add_argument(
        "--to-trackers",
        action="store_true",
        help="also send the plots and the page to the W&B and MLflow runs the run logged to "
        "(RUN_DIR/trackers.json; metrics.trackers); one run folder",
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
        "from_pretrained loads (a run of a Hugging Face model; of a PEFT model: its adapter, "
        "which PeftModel.from_pretrained loads)",
    )
    p.add_argument(
        "--merge",
        action="store_true",
        help="with --format hf, of a PEFT run: the base model with the adapter merged in",
    )
    p.add_argument(
        "--base",
        default=None,
        metavar="PATH",
        help="--merge: the base model's weights (default: the run's run.init_from)",
    )
    return parser
