"""Preemption: a signal asks every rank to save at the next step boundary and exit 0.

Ctrl-C (SIGINT) is one of them by default: the first saves at the next step, as SIGTERM does; a
second one stops at once (``KeyboardInterrupt``, Python's own answer to Ctrl-C), whatever the
first started -- a user who presses it twice wants out, not a save.

The handler only sets a flag -- no file I/O, no collectives, nothing that could deadlock inside
a signal handler; the flag rides in the step's agreement
(:class:`~dtrain.comm.agreement.StepAgreement`), so every rank stops after the same step's update
without a collective of its own (docs/fault-tolerance.md, "Preemption").
"""

from __future__ import annotations

import os
import signal
from collections.abc import Mapping, Sequence
from types import FrameType
from typing import Any

# The signals torch's elastic agent (the launcher of ``dtrain train`` and of ``torchrun``)
# catches and forwards to its workers, unless told others (torchrun --signals-to-handle,
# LaunchConfig.signals_to_handle; the agent passes its list on to the workers in
# TORCHELASTIC_SIGNALS_TO_HANDLE). Any
# other signal keeps its default action there: SIGUSR1 kills the agent (exit 138), whose
# workers then die with it (``dtrain.worker.die_with_launcher``) without saving.
AGENT_SIGNALS_ENV = "TORCHELASTIC_SIGNALS_TO_HANDLE"
AGENT_DEFAULT_SIGNALS = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT")


def agent_signals(env: Mapping[str, str]) -> list[str]:
    """The signals the elastic agent whose environment is ``env`` forwards to its workers."""
    listed = env.get(AGENT_SIGNALS_ENV)
    names = listed.split(",") if listed is not None else AGENT_DEFAULT_SIGNALS
    return [name.strip() for name in names if name.strip()]


def signals_to_forward(preempt_signals: Sequence[str], env: Mapping[str, str]) -> str:
    """The value of TORCHELASTIC_SIGNALS_TO_HANDLE that makes the agent also forward every
    preemption signal: what it handles already (its defaults, or the user's list), then the
    preemption signals it would not."""
    names = agent_signals(env)
    return ",".join([*names, *(name for name in preempt_signals if name not in names)])


def unforwarded(preempt_signals: Sequence[str], env: Mapping[str, str] | None = None) -> list[str]:
    """The preemption signals that the elastic agent this worker runs under (plain
    ``torchrun``) would not forward; empty outside an agent (a single process)."""
    env = os.environ if env is None else env
    if "TORCHELASTIC_RUN_ID" not in env:
        return []
    forwarded = set(agent_signals(env))
    return [name for name in preempt_signals if name not in forwarded]


def unforwarded_warning(names: Sequence[str]) -> str:
    """Words for :func:`unforwarded`'s answer: what happens, and what to do."""
    listed, forwarded = ", ".join(names), ", ".join(agent_signals(os.environ))
    wanted = signals_to_forward(names, os.environ)
    return (
        f"fault.preempt_signals: {listed} sent to the launcher kills it, and this job's workers "
        f"with it, unsaved (torch's launcher forwards only {forwarded}); "
        f"start torchrun with --signals-to-handle={wanted} (and --shutdown-timeout=SECONDS, "
        "the workers' time to save, default 30), or send the signal to the workers only "
        "(`dtrain train` forwards every fault.preempt_signals)"
    )


# A worker's preemption signals from its first moment until the trainer's flag takes over:
# those the default config names (catch_early, before the config is read), then the config's
# own (settle_early). A signal in between -- Slurm's --signal=USR1@N may come up to a minute
# early, during start-up -- is remembered, and the first step's agreement stops the run with
# a save, instead of the signal's default action ending the worker unsaved.
_EARLY: dict[str, Any] = {"signum": 0, "caught": set(), "previous": {}}
DEFAULT_PREEMPT_SIGNALS = ("SIGTERM", "SIGINT", "SIGUSR1")


def stop_at_once_if_again(signum: int, first: int) -> None:
    """A second Ctrl-C (``signum`` SIGINT after a ``first`` SIGINT): raise
    ``KeyboardInterrupt`` in the main thread, which ends the worker unsaved."""
    if signum == first == signal.SIGINT:
        raise KeyboardInterrupt


def _remember(signum: int, frame: FrameType | None) -> None:
    stop_at_once_if_again(signum, _EARLY["signum"])
    _EARLY["signum"] = _EARLY["signum"] or signum


def catch_early(signal_names: Sequence[str] = DEFAULT_PREEMPT_SIGNALS) -> None:
    """Remember the preemption signals that arrive before the trainer runs (a worker's main
    thread, first thing)."""
    for name in signal_names:
        sig = getattr(signal, name)
        previous = signal.signal(sig, _remember)
        if sig not in _EARLY["caught"]:
            _EARLY["previous"][sig] = previous
        _EARLY["caught"].add(sig)


def settle_early(signal_names: Sequence[str]) -> None:
    """Once the config is read: keep remembering the signals it names; give those it does not
    their handler from before back (Python's KeyboardInterrupt for SIGINT, else the default
    action) -- and apply it now, to one that came meanwhile."""
    wanted = {getattr(signal, name) for name in signal_names}
    for sig in sorted(_EARLY["caught"] - wanted):
        signal.signal(sig, _EARLY["previous"].pop(sig, signal.SIG_DFL))
        _EARLY["caught"].discard(sig)
        if _EARLY["signum"] == sig:
            _EARLY["signum"] = 0
            os.kill(os.getpid(), sig)
    catch_early([signal.Signals(sig).name for sig in wanted - _EARLY["caught"]])


def early_signal() -> int:
    """The preemption signal that came before the trainer's flag was set up (0: none)."""
    return int(_EARLY["signum"])


class PreemptionFlag:
    def __init__(self, signal_names: Sequence[str]) -> None:
        wanted = {getattr(signal, name) for name in signal_names}
        self.signum: int = early_signal() if early_signal() in wanted else 0
        self._previous: dict[int, Any] = {}
        for name in signal_names:
            sig = getattr(signal, name)
            self._previous[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        stop_at_once_if_again(signum, self.signum)
        self.signum = self.signum or signum

    @property
    def requested(self) -> bool:
        return self.signum != 0

    @property
    def signal_name(self) -> str:
        return signal.Signals(self.signum).name if self.signum else ""

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()
