"""A two-node Slurm cluster on this machine for the Slurm system test: ``scripts/slurm.sh``
driven from Python, and what the test asks of Slurm (submit, signal, wait for a job's state).

::

    with SlurmCluster() as slurm:                      # slurm.sh up; always down at the end
        job = slurm.sbatch(script, "--export=ALL,JOB=a.toml", chdir=REPO, output=log)
        slurm.wait(job, {"COMPLETED"}, timeout=120)     # the job's final state
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from types import TracebackType

from tests.hosts import hosts_unavailable

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "scripts" / "slurm.sh"
PREFIX = f"ds{os.getpid() % 100000}"
SUBNET = "10.79.0"
TOOLS = ("munged", "slurmctld", "slurmd", "sbatch", "scancel", "scontrol", "sinfo")
ENDED = frozenset({"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "PREEMPTED"})


def slurm_unavailable() -> str | None:
    """Why the cluster cannot be made here (for ``pytest.skip``), or None."""
    if not sys.platform.startswith("linux"):
        return "Slurm in network namespaces needs Linux"
    if os.geteuid() != 0:
        return "the Slurm cluster needs root (network namespaces, the Slurm daemons)"
    missing = [tool for tool in TOOLS if shutil.which(tool) is None]
    if missing:
        return (
            f"no {', '.join(missing)}: apt-get install slurmctld slurmd slurm-client munge "
            "(make test-slurm does it where it can)"
        )
    return hosts_unavailable()


class SlurmCluster:
    def __init__(self, workdir: Path) -> None:
        self.env = {
            **os.environ,
            "DTRAIN_SLURM_PREFIX": PREFIX,
            "DTRAIN_SLURM_SUBNET": SUBNET,
            "DTRAIN_SLURM_DIR": str(workdir / "slurm-state"),
        }

    def _script(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            ["bash", str(SCRIPT), *args],
            env=self.env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )

    def __enter__(self) -> SlurmCluster:
        result = self._script("up")
        if result.returncode != 0:
            self._script("down")
            raise RuntimeError(f"slurm.sh up failed: {(result.stdout + result.stderr).strip()}")
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        result = self._script("down")
        if result.returncode != 0:
            raise RuntimeError(f"slurm.sh down failed: {(result.stdout + result.stderr).strip()}")

    def namespace(self, node: int) -> str:
        return f"{PREFIX}-h{node}"

    def run(self, *argv: str, timeout: float = 60) -> str:
        """A Slurm command on host 0; its output (raises on failure)."""
        result = self._script("exec", *argv, timeout=timeout)
        if result.returncode != 0:
            said = (result.stdout + result.stderr).strip()
            raise RuntimeError(f"{' '.join(argv)} failed: {said}")
        return result.stdout

    def sbatch(self, script: Path, *options: str) -> int:
        out = self.run("sbatch", "--parsable", *options, str(script))
        return int(out.strip().split(";")[0])

    def job(self, job_id: int) -> dict[str, str]:
        """``scontrol show job``'s fields (JobState, ExitCode, ...)."""
        out = self.run("scontrol", "show", "job", "-o", str(job_id))
        return dict(re.findall(r"(\w+)=(\S*)", out))

    def wait(self, job_id: int, states: set[str] | frozenset[str], timeout: float) -> str:
        """The job's state once it is one of ``states`` (or has ended otherwise)."""
        deadline = time.monotonic() + timeout
        while True:
            state = self.job(job_id).get("JobState", "")
            if state in states or state in ENDED:
                return state
            if time.monotonic() > deadline:
                raise AssertionError(f"job {job_id} still {state} after {timeout:.0f}s")
            time.sleep(0.2)

    def pids_on(self, node: int) -> set[int]:
        """The processes running on node ``node`` (in its network namespace)."""
        result = subprocess.run(
            ["ip", "netns", "pids", self.namespace(node)], capture_output=True, text=True
        )
        return {int(p) for p in result.stdout.split()}
