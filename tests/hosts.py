"""Several hosts on one machine, for tests and benchmarks: network namespaces made by
``scripts/hosts.sh`` (each with its own network stack and address, one bridge between them,
each link limited with ``tc``), commands run in them with ``ip netns exec``.

::

    with Hosts(2, rate="100mbit") as hosts:             # hosts.sh up 2 100mbit
        hosts.address(1)                                 # '10.77.0.2'
        hosts.run(1, ["python", "-c", "print(1)"])       # a CompletedProcess, output captured
        hosts.set_link(1, up=False)                      # host 1 cut off (a partition)
        proc = hosts.popen(0, [...])                     # a Popen, to run beside others
        Launch(config, 1, ..., exec_prefix=hosts.exec_prefix(0))  # dtrain train in host 0
    # down: everything removed, also when the body raised

Each :class:`Hosts` names its namespaces and links with its own prefix (``dt<pid>`` unless
given), so tests running at the same time, or a set made by hand with the script's default
prefix, never collide. Needs root, ``ip`` and ``tc``, and a source checkout (the script lives in
``scripts/``): :func:`hosts_unavailable` says why not, for a test to skip with.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

from tests.processes import Launch

REPO = Path(__file__).resolve().parent.parent

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "hosts.sh"
SUBNET = "10.77.0"

_probed: dict[str, str | None] = {}


class Hosts:
    """``n`` hosts ``{prefix}-h0`` .. with addresses ``{subnet}.1``, ``{subnet}.2``, ...
    (10.77.0.1, ... unless given: the tests' subnet; a benchmark beside them takes its own);
    ``rate`` per link and direction (a tc rate such as ``100mbit``, or ``none``), ``delay`` one
    way (netem; the script warns and goes on without it where the kernel lacks netem)."""

    def __init__(
        self,
        n: int,
        rate: str = "none",
        delay: str = "",
        prefix: str | None = None,
        hostnames: bool = False,
        subnet: str = SUBNET,
    ) -> None:
        """``hostnames``: each host also gets its own hostname, ``{prefix}-hI`` (a UTS
        namespace per command run in it), as separate machines have; else they share this
        machine's, and dtrain takes their ranks for ranks of one machine (whose processes it
        may look up: the hosts do share one process table)."""
        self.n = n
        self.rate = rate
        self.delay = delay
        self.prefix = prefix or f"dt{os.getpid() % 100000}"
        self.hostnames = hostnames
        self.subnet = subnet  # the first three octets of a /24 (hosts.sh checks them)
        self.up_output = ""

    # -- lifetime --------------------------------------------------------------------------

    def _script(self, *args: str) -> subprocess.CompletedProcess[str]:
        env = {**os.environ, "DTRAIN_HOSTS_PREFIX": self.prefix, "DTRAIN_HOSTS_SUBNET": self.subnet}
        return subprocess.run(
            ["bash", str(SCRIPT), *args], env=env, capture_output=True, text=True, timeout=120
        )

    def up(self) -> Hosts:
        args = [str(self.n), self.rate] + ([self.delay] if self.delay else [])
        result = self._script("up", *args)
        self.up_output = result.stdout + result.stderr
        if result.returncode != 0:
            self.down()
            raise RuntimeError(f"hosts.sh up {' '.join(args)} failed: {self.up_output.strip()}")
        return self

    def down(self) -> None:
        result = self._script("down")
        if result.returncode != 0:
            raise RuntimeError(f"hosts.sh down failed: {(result.stdout + result.stderr).strip()}")

    def __enter__(self) -> Hosts:
        return self.up()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.down()

    # -- the hosts ---------------------------------------------------------------------------

    def namespace(self, i: int) -> str:
        if not 0 <= i < self.n:
            raise IndexError(f"host {i}: there are {self.n} (0 to {self.n - 1})")
        return f"{self.prefix}-h{i}"

    def address(self, i: int) -> str:
        self.namespace(i)
        return f"{self.subnet}.{i + 1}"

    @property
    def addresses(self) -> list[str]:
        return [self.address(i) for i in range(self.n)]

    def set_link(self, i: int, up: bool) -> None:
        """Cut host ``i`` off the others (its end of the link on the bridge goes down: no
        packet in or out, nothing refused -- as a pulled cable or a partition), or connect it
        again. Connections that were open survive a short cut, as TCP's do."""
        self.namespace(i)
        state = "up" if up else "down"
        subprocess.run(["ip", "link", "set", f"{self.prefix}-v{i}", state], check=True)

    def exec_prefix(self, i: int) -> list[str]:
        """What to put before a command to run it in host ``i``."""
        prefix = ["ip", "netns", "exec", self.namespace(i)]
        if self.hostnames:
            name = self.namespace(i)
            prefix += ["unshare", "--uts", "sh", "-c", f'hostname {name} && exec "$@"', "sh"]
        return prefix

    def run(
        self, i: int, argv: Sequence[str], timeout: float = 600, **kwargs: Any
    ) -> subprocess.CompletedProcess[str]:
        """Run ``argv`` in host ``i`` and wait; output captured as text unless told otherwise."""
        kwargs.setdefault("capture_output", True)
        kwargs.setdefault("text", True)
        return subprocess.run([*self.exec_prefix(i), *argv], timeout=timeout, **kwargs)

    def popen(self, i: int, argv: Sequence[str], **kwargs: Any) -> subprocess.Popen[str]:
        """Start ``argv`` in host ``i``; output piped as text unless told otherwise."""
        kwargs.setdefault("stdout", subprocess.PIPE)
        kwargs.setdefault("stderr", subprocess.STDOUT)
        kwargs.setdefault("text", True)
        return subprocess.Popen([*self.exec_prefix(i), *argv], **kwargs)


def leftovers(prefix: str) -> list[str]:
    """Namespaces and links named ``{prefix}-*`` that still exist (none after ``down``)."""
    found = []
    listing = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
    for line in listing.stdout.splitlines():
        if line.startswith(f"{prefix}-"):
            found.append(line.split()[0])
    links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True)
    for line in links.stdout.splitlines():
        name = line.split(": ")[1].split("@")[0] if ": " in line else ""
        if name.startswith(f"{prefix}-"):
            found.append(name)
    return found


def hosts_unavailable() -> str | None:
    """Why hosts cannot be made here (for ``pytest.skip``), or None when they can: checked once
    per process by bringing one host up and down."""
    if "reason" not in _probed:
        _probed["reason"] = _why_not()
    return _probed["reason"]


def _why_not() -> str | None:
    if not sys.platform.startswith("linux"):
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return "network namespaces need root"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"no '{tool}' command (iproute2)"
    if not SCRIPT.exists():
        return f"{SCRIPT} not found (needs a source checkout)"
    probe = Hosts(1, prefix=f"dq{os.getpid() % 100000}")
    try:
        probe.up()
    except (RuntimeError, OSError, subprocess.TimeoutExpired) as exc:
        return f"cannot make a network namespace here: {str(exc).splitlines()[0]}"
    probe.down()
    return None


def launch_on_host(
    hosts: Hosts,
    i: int,
    config: Path,
    endpoint: str,
    run_id: str,
    *args: str,
    nnodes: int | None = None,
) -> Launch:
    """``dtrain train CONFIG --nproc 1 --nnodes N --node-rank i --rdzv-endpoint ENDPOINT
    --run-id RUN_ID ARGS`` in host ``i``, one machine of a job across ``nnodes`` of the hosts
    (default: all of them)."""
    return Launch(
        config,
        1,
        "--nnodes",
        str(nnodes or hosts.n),
        "--node-rank",
        str(i),
        "--rdzv-endpoint",
        endpoint,
        "--run-id",
        run_id,
        *args,
        cwd=REPO,
        exec_prefix=hosts.exec_prefix(i),
    )
