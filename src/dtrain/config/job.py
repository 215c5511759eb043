"""The rules that need the job's shape -- how many workers on how many machines -- besides the
config: run by ``dtrain train`` before any worker starts, and by a worker that no dtrain
launcher checked for (plain ``torchrun -m dtrain.worker``), once, at its world size.

A launcher that has checked says so to its workers (:data:`CHECKED_ENV`), and they trust it:
the same checks in every worker would cost each its start-up time for nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

from dtrain.config.checks import validate_strategy
from dtrain.config.sections import Config
from dtrain.errors import ConfigError

# Set by `dtrain train` for its workers once validate_job has passed: the config file it hands
# them is the one it checked (cli/train.py). Plain torchrun sets none.
CHECKED_ENV = "DTRAIN_CONFIG_CHECKED"


@dataclass(frozen=True)
class JobShape:
    """What the command line says of the job, as the rules need it."""

    nproc: int  # workers per machine
    min_nodes: int = 1
    max_nodes: int = 1
    nnodes: str = "1"  # --nnodes as given (N, or MIN:MAX), for the messages
    node_rank: int | None = None
    rdzv_endpoint: str = ""
    # This machine is node 0 and has rdzv_endpoint's address: it can host the in-place
    # membership coordinator there (the launcher knows its addresses; the rules do not).
    hosts_endpoint: bool = False

    @property
    def min_world_size(self) -> int:
        return self.nproc * self.min_nodes

    @property
    def max_world_size(self) -> int:
        return self.nproc * self.max_nodes

    @classmethod
    def of_world(cls, world_size: int) -> JobShape:
        """A job of ``world_size`` workers on one machine, as plain torchrun's worker sees it."""
        return cls(nproc=world_size)


def validate_job(cfg: Config, job: JobShape) -> None:
    """Every rule of a config at this shape: the strategy at the smallest and the largest world
    an elastic job may have, the ranks the config names, what needs one machine, and what
    in-place recovery needs of the machines."""
    validate_strategy(cfg, job.min_world_size)
    if job.max_world_size != job.min_world_size:
        validate_strategy(cfg, job.max_world_size)
    if cfg.fault.recovery != "inplace":
        return
    if job.max_nodes > 1:
        validate_in_place_machines(job)
    if cfg.fault.min_replicas > job.max_world_size:
        raise ConfigError(
            f"fault.min_replicas = {cfg.fault.min_replicas} is more than the job's "
            f"{job.max_world_size} workers (--nproc {job.nproc}): it could never train; "
            "lower fault.min_replicas or raise --nproc"
        )


def validate_in_place_machines(job: JobShape) -> None:
    """Across machines, what in-place recovery cannot do there is one line each."""
    if job.min_nodes != job.max_nodes:
        raise ConfigError(
            f"--nnodes {job.nnodes}: fault.recovery = 'inplace' needs a fixed number of machines "
            "(a lost worker rejoins in place); use --nnodes N, or fault.recovery = 'restart' "
            "for an elastic range"
        )
    if job.node_rank is None:
        raise ConfigError(
            "fault.recovery = 'inplace' across machines needs --node-rank K on each (0 hosts "
            "the membership coordinator at --rdzv-endpoint; the others number their workers "
            "after it)"
        )
    if job.node_rank == 0 and not job.hosts_endpoint:
        raise ConfigError(
            f"--rdzv-endpoint {job.rdzv_endpoint} is not an address of this machine: with "
            "fault.recovery = 'inplace' the machine with --node-rank 0 hosts the membership "
            "coordinator there (a rendezvous apart from the machines, `dtrain rendezvous`, is "
            "for fault.recovery = 'restart')"
        )
