"""What tests, system tests and benchmarks share, each in its own module:

- :mod:`~dtrain.testing.ranks`: :func:`run_ranks`, a function on N real ranks (processes, gloo
  on loopback), the multi-process test helper;
- :mod:`~dtrain.testing.processes`: :class:`Launch`, the real ``dtrain train`` started as a user
  would, and what ``/proc`` says about its processes;
- :mod:`~dtrain.testing.chains`: a chain of deliberately unequal layers for the stage balancer.
"""

from dtrain.testing.processes import (
    Launch,
    children_of,
    metrics_records,
    pid_alive,
    processes_of,
    rank_of,
    started_at,
    wait_gone,
    worker_pids,
)
from dtrain.testing.ranks import RankFailed, free_port, loopback_store, run_ranks

__all__ = [
    "Launch",
    "RankFailed",
    "children_of",
    "free_port",
    "loopback_store",
    "metrics_records",
    "pid_alive",
    "processes_of",
    "rank_of",
    "run_ranks",
    "started_at",
    "wait_gone",
    "worker_pids",
]
