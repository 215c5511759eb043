"""The worker process: ``python -m dtrain.worker [CONFIG.toml] [--section.key=value ...]``.

``dtrain train`` starts one per rank through torch's elastic agent; plain ``torchrun -m
dtrain.worker ...`` works the same. A user mistake found here (a dataset that does not exist, a
checkpoint that does not fit) ends the worker with exit code 2 and a one-line message, which is
also written to torch elastic's error file so the launcher can repeat it; any other error ends
it with exit code 1, one line on stderr and its traceback in ``RUN_DIR/logs/rankN.log``.
"""

from __future__ import annotations

import os
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, NoReturn

from dtrain.config import Config
from dtrain.console import guard_console, say_error, say_line
from dtrain.errors import LAUNCHER_SAYS_ENV, USER_ERROR_EXIT_CODE, UserError
from dtrain.fault.error_log import append_traceback, record_error
from dtrain.fault.oom import OutOfMemory
from dtrain.fault.oom import describe as describe_oom
from dtrain.fault.preempt import catch_early, settle_early, unforwarded, unforwarded_warning
from dtrain.fsutil import local_run_dir
from dtrain.process_exit import die_with_parent, exit_without_finalizing

if TYPE_CHECKING:
    from dtrain.loop import Run
    from dtrain.metrics.summary import Summary

    OwnLoop = Callable[[Run], object]  # a loop of the user's own: main(run)

# Nothing here imports torch at module level: main() must set up its signal handling before
# the second or two that importing torch takes (see dtrain.fault.preempt.catch_early).


def load_worker_config(argv: Sequence[str]) -> Config:
    """The config, checked by its rules once: by the ``dtrain train`` that wrote this config
    file, or here, at this worker's world size (plain ``torchrun``, or overrides of ours)."""
    from dtrain.config.job import CHECKED_ENV
    from dtrain.train.job import check_at_world, load_job_config

    path = argv[0] if argv and not argv[0].startswith("--") else None
    overrides = list(argv[1:] if path else argv)
    cfg = load_job_config(path, overrides)
    if overrides or path is None or os.environ.get(CHECKED_ENV) != path:
        check_at_world(cfg)
    return cfg


def train(cfg: Config, own_loop: OwnLoop | None = None) -> Summary | None:
    """Run training in this process, as one rank of the job the environment describes
    (:func:`run_training`), and end its helper threads and process group
    (:func:`finish_worker`) however it ends."""
    try:
        return run_training(cfg, own_loop)
    finally:
        finish_worker()


def run_training(cfg: Config, own_loop: OwnLoop | None = None) -> Summary | None:
    """The plain loop, a loop of the user's own (``own_loop``, or ``run.script``'s ``main``),
    or under ``fault.recovery = 'inplace'`` the loop across membership generations (None: a
    worker of an in-place job that the run completed without)."""
    if own_loop is None and cfg.run.script:
        from dtrain.loop.script import load_main

        own_loop = load_main(cfg.run.script)
    if cfg.fault.recovery == "inplace":
        from dtrain.train.inplace_worker import TrainerLoop, train_in_place

        if own_loop is None:
            return train_in_place(cfg, TrainerLoop)
        from dtrain.loop.inplace import start_own_loop

        return train_in_place(cfg, start_own_loop(own_loop))
    return train_once(cfg, own_loop)


def finish_worker() -> None:
    """End what a run leaves of dtrain's in this process: the probe listener, the helper
    threads (each waited for a little) and the process group."""
    from dtrain.dist.reachability import close_probe_listener
    from dtrain.dist.runtime import shutdown_runtime

    close_probe_listener()  # its accept thread is one of ours: it must end first
    join_helper_threads()
    shutdown_runtime()


def train_once(cfg: Config, own_loop: OwnLoop | None = None) -> Summary:
    """The plain loop: one trainer, its process group the job's; or the user's ``own_loop``
    (:mod:`dtrain.loop`), in the same process group, given a :class:`~dtrain.loop.Run`."""
    from dtrain.checkpoint.rundir import write_config_of_record
    from dtrain.metrics.summary import print_summary
    from dtrain.train.job import build_trainer

    if own_loop is not None:
        from dtrain.loop import Run

        run = Run.join(cfg)
        runtime, fit = run.runtime, lambda: run.train(own_loop)
    else:
        trainer = build_trainer(cfg)
        runtime, fit = trainer.runtime, trainer.fit
    if runtime.is_main:
        warn_unforwarded_signals(cfg)
        write_config_of_record(cfg)
    summary = fit()
    if runtime.is_main:
        item_name = run.item_name if own_loop is not None else trainer.task.item_name
        print_summary(summary, item_name, runtime.world_size)
    return summary


def warn_unforwarded_signals(cfg: Config) -> None:
    """Under plain ``torchrun``: say which preemption signals its agent would not forward (and
    would die of), and how to fix it. ``dtrain train`` tells its agent to forward them all."""
    if names := unforwarded(cfg.fault.preempt_signals):
        say_line(f"dtrain: warning: {unforwarded_warning(names)}")


def join_helper_threads(timeout_s: float = 2.0) -> None:
    """Wait (a little) for dtrain's own threads -- data prefetch, checkpoint writer, watchdog,
    all named ``dtrain-*`` -- to end, so that a finished run leaves none behind. They are
    daemon threads and have been told to stop; one may still be on its way out. Bounded: a
    thread stuck in a collective of a failed run is left behind, and the process's exit
    (:func:`~dtrain.process_exit.exit_without_finalizing`) does not wait for it.
    """
    from dtrain.dist.store_link import in_store_calls

    # Nor for one in a store call: it ends at the call's bound, or never while the store's host
    # is stopped, and the exit needs nothing of it (a failed rank's error line waited 2 s).
    skip = in_store_calls() | {threading.current_thread()}
    deadline = time.monotonic() + timeout_s
    for thread in threading.enumerate():
        if thread not in skip and thread.name.startswith("dtrain-"):
            thread.join(max(0.0, deadline - time.monotonic()))


def die_with_launcher() -> None:
    """Ask the kernel to kill this worker when its launcher dies, so a launcher that is killed
    outright leaves no orphan worker training on alone."""
    if "TORCHELASTIC_RUN_ID" not in os.environ:
        return
    import signal

    if die_with_parent(signal.SIGKILL) and os.getppid() == 1:
        os._exit(1)  # the launcher died before the request took effect


def run_main(own_loop: OwnLoop) -> NoReturn:
    """``if __name__ == "__main__": dtrain.run_main(main)`` in a script of one's own loop:
    ``main(run)`` trains as a worker of the job the environment describes (plain ``torchrun
    script.py [CONFIG.toml] [--section.key=value ...]``, or one process), with this worker's
    set-up, errors and exit codes. (Under ``dtrain train``, ``run.script`` names the file.)"""
    exit_without_finalizing(lambda: main(None, own_loop))


def main(argv: Sequence[str] | None = None, own_loop: OwnLoop | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    catch_early()
    die_with_launcher()
    rank = os.environ.get("RANK", "0")
    # In-place recovery: each worker is supervised alone (RANK 0 on every machine); the job
    # knows it by its member id (docs/fault-tolerance.md).
    from dtrain.recovery.membership import MEMBER_ENV  # after catch_early: it imports torch

    who = f"member {os.environ[MEMBER_ENV]}" if MEMBER_ENV in os.environ else f"rank {rank}"
    guard_console(who)  # a closed output pipe costs the output, never the run
    cfg: Config | None = None
    started = peer_gone = False
    # The error is said before the helper threads are waited for (finish_worker, up to 2 s):
    # after a peer was killed, a checkpoint's commit waits in a collective with it, and every
    # rank's line came 2 s after its diagnosis.
    try:
        cfg = load_worker_config(args)
        settle_early(cfg.fault.preempt_signals)
        started = True
        run_training(cfg, own_loop)
    except UserError as exc:
        message = f"{who}: {exc}"
        record_error(message)  # where dtrain's launcher reads it
        if not os.environ.get(LAUNCHER_SAYS_ENV):
            say_error(message)
        return USER_ERROR_EXIT_CODE
    except (KeyboardInterrupt, SystemExit):
        # A second Ctrl-C (the first saves: fault.preempt_signals), or one where SIGINT is no
        # preemption signal: the launcher says the run stopped; each rank's traceback of where
        # its step was said nothing more (40 lines a rank). The worker ends by SIGINT without
        # one (exit_without_finalizing). An exit passes as it is.
        raise
    except BaseException as exc:
        where = ""  # no run folder yet: the traceback goes to stderr
        if cfg is not None and cfg.run.dir:
            where = str(local_run_dir(cfg.run.dir, cfg.run.local_dir))
        code = report_crash(exc, int(rank), where)
        from dtrain.fault.peer_failure import PeerFailure

        peer_gone = isinstance(exc, PeerFailure)
        return code
    finally:
        if started:
            finish_worker()
        if cfg is not None and peer_gone:
            from dtrain.fault.store_host import hold_store_for_peers

            hold_store_for_peers(cfg.fault.heartbeat_s)  # their diagnosis reads its store
    return 0


def lost_peer_words(error: BaseException, first: str) -> str:
    """``first`` (an error's first line), said as what it means when a peer's connection
    closed outside the training loop, whose own diagnosis names the peer: a rank whose peer
    was killed during a resume said only ``DistNetworkError: Broken pipe``."""
    from dtrain.fault.peer_failure import PeerFailure, connection_closed, is_collective_failure

    closed = is_collective_failure(error) and connection_closed(error)
    if isinstance(error, PeerFailure) or not closed:
        return first
    return (
        f"lost a peer outside the training loop (starting, resuming or ending: {first}): a "
        "rank of the job ended or was killed; its own line, or the launcher's, says why"
    )


def report_crash(error: BaseException, rank: int, run_dir: str) -> int:
    """Any other error: one line on stderr, the full traceback in the run folder's log
    (``RUN_DIR/logs/rankN.log``, named on that line), the error where the launcher reads it;
    exit code 1. A restart of many ranks then prints a line per rank, not a traceback each.
    Without a run folder to log in, the traceback goes to stderr as before."""
    from torch.distributed.elastic.multiprocessing.errors import ErrorHandler

    words = describe_oom(error, f"rank {rank} ({socket.gethostname()})", "at start-up")
    if words is not None and not isinstance(error, OutOfMemory):
        wrapped = OutOfMemory(words)  # outside the loop: building the model, say
        wrapped.__cause__ = error
        error = wrapped
    ErrorHandler().record_exception(error)
    text = f"{type(error).__name__}: {error}".strip()
    first = lost_peer_words(error, text.splitlines()[0] if text else type(error).__name__)
    log = append_traceback(run_dir, rank, error) if run_dir else None
    if log is None:
        traceback.print_exception(error)
    where = f" (traceback: {log})" if log is not None else ""
    say_error(f"rank {rank}: {first}{where}")
    return 1


if __name__ == "__main__":
    exit_without_finalizing(main)
