"""The ``dtrain`` command: parse, validate, then hand over. No training logic lives here."""

from __future__ import annotations

import argparse
import os
import signal
import sys
from collections.abc import Callable, Sequence

from dtrain.cli.commands import (
    cmd_config,
    cmd_estimate,
    cmd_export,
    cmd_prepare,
    cmd_rendezvous,
    cmd_report,
    cmd_status,
    cmd_strategies,
    cmd_verify,
)
from dtrain.cli.parser import build_parser
from dtrain.cli.train import cmd_train
from dtrain.errors import USER_ERROR_EXIT_CODE, UserError
from dtrain.process_exit import freeze_heap_at_exit

# Each command takes the parsed arguments, its config overrides as ``args.overrides``.
COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {
    "train": cmd_train,
    "prepare": cmd_prepare,
    "verify": cmd_verify,
    "config": cmd_config,
    "report": cmd_report,
    "status": cmd_status,
    "export": cmd_export,
    "rendezvous": cmd_rendezvous,
    "estimate": cmd_estimate,
    "strategies": cmd_strategies,
}


def split_overrides(extra: Sequence[str]) -> list[str]:
    """``extra`` (what argparse left) when all are config overrides; else the first refused."""
    for arg in extra:
        if arg.startswith("--") and "." in arg.split("=", 1)[0] and "=" in arg:
            continue
        if arg.startswith("--") and "." in arg:
            raise UserError(f"override {arg!r} has no value; write it as {arg}=VALUE")
        raise UserError(
            f"unrecognized argument {arg!r} (config keys are set as --section.key=value)"
        )
    return list(extra)


def quiet_launcher_store_logs() -> None:
    """Before torch is imported in the launcher: its C++ store client logs every failed call
    with a stack trace of some 30 frames (the rendezvous store of a machine that has gone, a
    keep-alive during an outage, the close of a rendezvous whose host exited first at the end
    of a successful run). The launcher reports every failure itself, in a line; its workers
    start afresh with their own level (:func:`dtrain.launch.launcher.launch`)."""
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
    args, extra = build_parser().parse_known_args(argv)
    if args.command in ("train", "rendezvous"):
        quiet_launcher_store_logs()
    try:
        if extra and args.command not in ("train", "config", "estimate"):  # no config keys
            raise UserError(
                f"unrecognized arguments: {' '.join(extra)} (see dtrain {args.command} --help)"
            )
        args.overrides = split_overrides(extra)
        return COMMANDS[args.command](args)
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
