"""What a launcher puts in its environment for the workers it starts, for as long as its job
runs: the job's secret, and on one machine the collectives' interface (loopback).

Restored when the job ends: a process that runs several jobs (a test session, a notebook)
must not hand one job's secret, or its loopback interface, to the next -- a multi-machine job
started after a single-machine one put its collectives on loopback.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

from dtrain.dist.network import IFNAME_VARIABLES
from dtrain.dist.secret import SECRET_ENV, SECRET_FILE_ENV, JobSecret, launcher_secret
from dtrain.dist.stores import keep_collectives_on_loopback


@contextmanager
def job_environment(multi_machine: bool) -> Iterator[JobSecret]:
    """The job's secret (:func:`dtrain.dist.secret.launcher_secret`: a :class:`UserError` for
    a multi-machine job without one) in the environment, and on one machine the collectives
    on loopback, until the block ends."""
    names = (SECRET_ENV, SECRET_FILE_ENV, *IFNAME_VARIABLES)
    saved = {name: os.environ.get(name) for name in names}
    try:
        secret = launcher_secret(multi_machine)
        if not multi_machine:
            keep_collectives_on_loopback()
        yield secret
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
