"""The control plane at thousands of ranks, simulated: the real TCPStore as dtrain hosts it, and
W simulated ranks (threads, many per process: ``control_plane_sim_ranks.py``) driving dtrain's
own client objects, no model -- to see which piece stops scaling where (issue #44).

Pieces (``--pieces``, each measured for ``--window`` seconds where it has a steady state):

- ``beats``: restart mode's steady state: every rank's Watchdog beats (and reads rank 0's beat)
  while its phase and step change as a training loop's do;
- ``words``: resume verification, every rank's ``PeerWords.gather`` at once;
- ``diagnosis``: one rank's process killed (its beats stop: it is on another machine to the
  others), then every other rank's ``Watchdog.diagnosis`` at once, as after a failed
  collective: how long until each names a rank, and how many name the killed one;
- ``waiting``: in-place members waiting for the first generation (``Member.wait``) while one
  is late, the ``Coordinator`` polling beside the store (in the store's process, as the
  launcher runs it); ``first``: from the late member's start to every member's generation;
- ``inplace``: in-place steady state: watchdogs beating and looking at the membership
  (``Member.look``), the coordinator polling;
- ``regroup``: one member's process killed, every other asks for and waits for the next
  generation;

In place, members sit on machines of ``--per-machine`` (8), the coordinator reading its own
machine's processes, the other machines' launchers (``NodeWatcher``) posting theirs, as in a
real job (``control_plane_sim_report.NOTES``).

The checkpoint commit's bookkeeping is not a piece: it runs on gloo collectives of the
checkpoint group (``checkpoint/write.py``: a gather to rank 0 and a broadcast), no store call
once that group exists -- whose creation is ``pg``.

Per piece: link calls per rank per second (``StoreLink.call``, as ``control_plane.py`` counts a
real job's) and store operations; the store host's CPU from ``/proc`` (its server thread,
``pt_tcpstore_uv``, and its whole process, which also runs the coordinator); the harness's
own CPU (when it nears the machine's cores, the ranks ran slower than asked: rates are then a
floor); the latency of a probe client's ``add`` (p50/p99), and the piece's times.

    python benchmarks/control_plane_sim.py --worlds 32,256 --window 3
    python benchmarks/control_plane_sim.py --check-real 8      # against a real 8-rank job
    python benchmarks/control_plane_sim.py --write-docs        # docs/benchmarks.md
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from _report import ROOT, machine_line, write_report_section
from control_plane_sim_report import (
    INPLACE,
    NOTES,
    PIECES,
    RESTART,
    pct,
    pg_lines,
    processes_of,
    quantile,
    rows_of,
    summary,
    table,
)

HERE = Path(__file__).resolve().parent
RANKS = HERE / "control_plane_sim_ranks.py"
TICK_S = os.sysconf("SC_CLK_TCK")


# -- the processes ---------------------------------------------------------------------------


def cpu_s(pid: int, tid: int | None = None) -> float:
    """CPU seconds (user + system) of a process, or of one of its threads: a thread's from
    its scheduler's nanoseconds (a store thread at a few ranks runs less than a clock tick a
    second), a process's in clock ticks."""
    if tid:
        try:
            return int(Path(f"/proc/{pid}/task/{tid}/schedstat").read_text().split()[0]) / 1e9
        except OSError:
            return 0.0
    path = f"/proc/{pid}/stat"
    try:
        fields = Path(path).read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / TICK_S


def store_thread(pid: int) -> int | None:
    """The TCPStore server's thread of a process (torch names it ``pt_tcpstore_uv``)."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            if Path(f"/proc/{pid}/task/{tid}/comm").read_text().strip() == "pt_tcpstore_uv":
                return int(tid)
        except OSError:
            continue
    return None


def listen_overflows() -> int:
    """The kernel's count of connections dropped for a full accept queue (all sockets)."""
    lines = Path("/proc/net/netstat").read_text().splitlines()
    for names, values in zip(lines[::2], lines[1::2], strict=False):
        if names.startswith("TcpExt:"):
            row = dict(zip(names.split()[1:], values.split()[1:], strict=True))
            return int(row.get("ListenOverflows", 0))
    return 0


class Host:
    """The store's process (``serve``), with the coordinator for ``members`` > 0."""

    def __init__(self, env: dict[str, str], members: int, args_: argparse.Namespace) -> None:
        args = ["serve", "--world", str(members), "--timeout-s", str(args_.timeout_s)]
        args += ["--per-machine", str(args_.per_machine)]
        self.proc = subprocess.Popen(
            [sys.executable, str(RANKS), *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
            text=True,
        )
        assert self.proc.stdout is not None
        first = json.loads(self.proc.stdout.readline())
        self.port, self.pid = int(first["port"]), int(first["pid"])
        self.tid = None
        from dtrain.dist.stores import client_store

        self.ctl = client_store("127.0.0.1", self.port, 600.0)
        self.ctl.set_timeout(__import__("datetime").timedelta(seconds=600))
        self.tid = store_thread(self.pid)

    def cpu(self) -> tuple[float, float]:
        """CPU seconds of the store's thread and of its whole process."""
        return cpu_s(self.pid, self.tid), cpu_s(self.pid)

    def close(self) -> dict[str, Any]:
        """The coordinator's polls ([time, seconds] each); the process ends."""
        try:
            out, _ = self.proc.communicate("", timeout=30)
            return dict(json.loads(out.strip().splitlines()[-1]))
        except Exception:
            self.proc.kill()
            self.proc.wait()
            return {"polls": []}


class Probe:
    """A client of its own that adds to a counter every 10 ms: the latency another rank's
    call sees (p50/p99), as [time, seconds]."""

    def __init__(self, port: int, active: bool = True) -> None:
        from dtrain.dist.stores import client_store

        self.client = client_store("127.0.0.1", port, 600.0)
        self.times: list[tuple[float, float]] = []
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        if not active:
            self.stopped.set()
        self.thread.start()

    def _run(self) -> None:
        while not self.stopped.wait(0.01):
            started = time.perf_counter()
            try:
                self.client.add("sim/probe", 1)
            except Exception:  # the store is gone: the run is over
                return
            self.times.append((time.time(), time.perf_counter() - started))

    def stop(self) -> None:
        self.stopped.set()
        self.thread.join()


class Run:
    """One world of one mode: the store host, the rank processes, the probe; the driver's
    keys; each window's figures."""

    def __init__(self, mode: str, world: int, args: argparse.Namespace) -> None:
        self.mode, self.world, self.args = mode, world, args
        self.env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]),
            "DTRAIN_JOB_SECRET": secrets.token_hex(32),
        }
        self.overflows = listen_overflows()
        self.host = Host(self.env, world if mode == "inplace" else 0, args)
        self.env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(self.host.port))
        # In place, the launchers of the machines other than the coordinator's (members on
        # machines of --per-machine), in a process of their own.
        self.launchers: subprocess.Popen[str] | None = None
        if mode == "inplace" and 0 < args.per_machine < world:
            shape = [f"--world={world}", f"--per-machine={args.per_machine}"]
            command = [sys.executable, str(RANKS), "launchers", f"--port={self.host.port}"]
            command += [*shape, f"--watch-s={args.watch_s}"]
            pipes = {"stdin": subprocess.PIPE, "stdout": subprocess.PIPE}
            self.launchers = subprocess.Popen(command, env=self.env, text=True, **pipes)
        # The probe's 100 calls a second are more than a few ranks make: off for --check-real.
        self.probe = Probe(self.host.port, active=args.probe)
        # Ranks 0 .. W-2 spread over the processes, the victim (W-1) alone in its own.
        procs = processes_of(world, args.procs)
        cuts = [round(i * (world - 1) / procs) for i in range(procs + 1)]
        spans = [(cuts[i], cuts[i + 1]) for i in range(procs)] + [(world - 1, world)]
        self.ranks = []
        for index, (first, stop) in enumerate(spans):
            victim = ["--victim"] if index == len(spans) - 1 else []
            command = [
                sys.executable,
                str(RANKS),
                mode,
                f"--port={self.host.port}",
                f"--world={world}",
                f"--ranks={first}:{stop}",
                f"--index={index}",
                f"--heartbeat-s={args.heartbeat_s}",
                f"--timeout-s={args.timeout_s}",
                f"--step-s={args.step_s}",
                f"--per-machine={args.per_machine}",
                f"--stagger-s={args.stagger_s}",
                *victim,
            ]
            self.ranks.append(
                subprocess.Popen(command, stdout=subprocess.PIPE, env=self.env, text=True)
            )
        self.victim = self.ranks[-1]
        self.harness: dict[int, float] = {}  # each rank process's CPU seconds, last read
        self.rows: dict[str, dict[str, Any]] = {}
        self.failed = ""  # why the last wait_count gave up

    def set(self, key: str, value: str = "go") -> float:
        self.host.ctl.set(f"sim/{key}", value)
        return time.time()

    def count(self, key: str) -> int:
        return int(self.host.ctl.add(f"sim/{key}", 0))

    def wait_count(self, key: str, n: int, timeout_s: float) -> bool:
        """Whether ``n`` ranks have added to ``key`` within ``timeout_s`` (else ``failed``
        says why)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.count(key) >= n:
                return True
            ended = [p.returncode for p in self.ranks if p is not self.victim and p.poll()]
            if ended:  # a process of ranks failed (one that ended 0 had finished)
                self.failed = f"a process of ranks failed (exit {ended[0]}) before {key}"
                return False
            time.sleep(0.05)
        self.failed = f"{self.count(key)}/{n} ranks at {key} after {timeout_s:.0f}s"
        return False

    def cpu_mark(self) -> tuple[float, float, float, float]:
        thread, process = self.host.cpu()
        helpers = [self.launchers] if self.launchers is not None else []
        for proc in [*self.ranks, *helpers]:  # a killed process keeps the CPU it had last
            self.harness[proc.pid] = cpu_s(proc.pid) or self.harness.get(proc.pid, 0.0)
        return time.time(), thread, process, sum(self.harness.values())

    def window(self, name: str, seconds: float) -> None:
        """A steady window of ``seconds``: its CPU shares and probe latencies."""
        start = self.cpu_mark()
        time.sleep(seconds)
        self.measure(name, start, self.cpu_mark())

    def measure(self, name: str, start: tuple[float, ...], end: tuple[float, ...]) -> None:
        span = end[0] - start[0]
        lat = [s for t, s in self.probe.times if start[0] <= t <= end[0]]
        self.rows[name] = {
            "from": start[0],
            "to": end[0],
            "store_thread": (end[1] - start[1]) / span,
            "store_process": (end[2] - start[2]) / span,
            "harness": (end[3] - start[3]) / span,
            "probe_p50": quantile(lat, 0.5),
            "probe_p99": quantile(lat, 0.99),
            "probe_max": max(lat, default=float("nan")),
        }

    def kill_victim(self) -> float:
        os.kill(self.victim.pid, signal.SIGKILL)
        killed = time.time()
        self.victim.wait()  # reaped: its /proc entry goes (the coordinator reads it)
        return killed

    def finish(self) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        """Every rank process's report (the victim's is none), and the host's."""
        self.probe.stop()
        reports = []
        for proc in self.ranks:
            try:
                out, _ = proc.communicate(timeout=120)
            except subprocess.TimeoutExpired:
                proc.kill()
                out, _ = proc.communicate()
            lines = [ln for ln in (out or "").splitlines() if ln.startswith("SIM ")]
            if lines:
                reports.append(json.loads(lines[-1][4:]))
        self._end_launchers()
        hosted = self.host.close()
        hosted["overflows"] = listen_overflows() - self.overflows
        return reports, hosted

    def begin(self, ready: int, go: str, window: str | bool) -> str:
        """Once ``ready`` ranks are: the word ``go``, then the ``window`` measured (if any,
        after ``--settle``); "" or why the ranks never got ready."""
        if not self.wait_count("ready", ready, self.args.start_timeout):
            self.abort()
            return self.failed
        self.set(go)
        time.sleep(self.args.settle)
        if window:
            self.window(str(window), self.args.window)
        return ""

    def end(self, finished: bool) -> dict[str, Any]:
        """The rows, every process's report and the host's; a piece that did not finish has
        every process report what it has now."""
        if not finished:
            self.set("dump")
        reports, hosted = self.finish()
        return {"rows": self.rows, "reports": reports, "host": hosted}

    def _end_launchers(self) -> None:
        if self.launchers is not None and self.launchers.poll() is None:
            try:
                self.launchers.communicate("", timeout=30)
            except subprocess.TimeoutExpired:
                self.launchers.kill()
                self.launchers.wait()

    def abort(self) -> None:
        self.probe.stop()
        helpers = [self.launchers] if self.launchers is not None else []
        for proc in [*self.ranks, *helpers, self.host.proc]:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


# -- the pieces --------------------------------------------------------------------------------


def one_off(run: Run, name: str, key: str, n: int, started: float, mark: tuple[float, ...]) -> bool:
    """A piece every rank does once (from ``started``): whether all ``n`` did in time."""
    done = run.wait_count(key, n, run.args.piece_timeout)
    run.measure(name, mark, run.cpu_mark())
    run.rows[name].update(
        started=started,
        finished=done,
        done=run.count(key),
        right=run.count(key.removesuffix("_done") + "_right"),
    )
    return done


def after_kill(run: Run, name: str, wanted: bool) -> bool:
    """The piece that follows a kill of the victim's process (or the word to skip it)."""
    if not wanted:
        run.set("kill", "skip")
        return True
    mark = run.cpu_mark()
    killed = run.kill_victim()
    run.set("kill", str(killed))
    return one_off(run, name, f"{name}_done", run.world - 1, killed, mark)


def restart_pieces(world: int, pieces: set[str], args: argparse.Namespace) -> dict[str, Any]:
    run = Run("restart", world, args)
    try:
        if why := run.begin(world, "steady", "beats" in pieces and "beats"):
            return {"error": f"the {world} ranks did not start: {why}"}
        finished = True
        if "words" in pieces:
            mark = run.cpu_mark()
            finished = one_off(run, "words", "words_done", world, run.set("words"), mark)
        else:
            run.set("words", "skip")
        if finished:
            finished = after_kill(run, "diagnosis", "diagnosis" in pieces)
        return run.end(finished)
    except BaseException:
        run.abort()
        raise


def inplace_pieces(world: int, pieces: set[str], args: argparse.Namespace) -> dict[str, Any]:
    run = Run("inplace", world, args)
    try:
        if why := run.begin(world - 1, "ask", "waiting" in pieces and "waiting"):
            return {"error": f"the {world} members did not register: {why}"}
        mark = run.cpu_mark()
        finished = one_off(run, "first", "gen0", world, run.set("late"), mark)
        finished = finished and run.wait_count("ready2", world, args.start_timeout)
        if finished:
            run.set("steady2")
            time.sleep(args.settle)
            if "inplace" in pieces:
                run.window("inplace", args.window)
            finished = after_kill(run, "regroup", "regroup" in pieces)
        return run.end(finished)
    except BaseException:
        run.abort()
        raise


def simulate(
    worlds: list[int], pieces: set[str], args: argparse.Namespace
) -> tuple[str, dict[int, dict[str, dict[str, Any]]]]:
    """The table of every world size (printed as it comes), the mesh's lines, the summary;
    and every row."""
    all_rows: dict[int, dict[str, dict[str, Any]]] = {}
    texts = []
    for world in worlds:
        rows: dict[str, dict[str, Any]] = {}
        if pieces & set(RESTART):
            rows.update(rows_of(world, restart_pieces(world, pieces, args), pieces & set(RESTART)))
        if pieces & set(INPLACE):
            rows.update(rows_of(world, inplace_pieces(world, pieces, args), pieces & set(INPLACE)))
        all_rows[world] = rows
        texts.append(table(world, rows, args))
        print(texts[-1], flush=True)
    if "pg" in pieces:
        texts.append("\n".join(pg_lines(measure_meshes(args), worlds)))
        print(texts[-1], flush=True)
    return "\n\n".join([*texts, "\n".join(summary(all_rows))]), all_rows


def measure_meshes(args: argparse.Namespace) -> list[dict[str, Any]]:
    from control_plane_sim_mesh import mesh

    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    host = Host(env, 0, args)
    try:
        out = []
        for size in [w for w in (2, 4, 8, 16, 32, 64, 128) if w <= args.pg_max]:
            out.append(mesh(host.port, size))
            if "error" in out[-1]:
                break  # the larger groups would fail alike
        return out
    finally:
        host.close()


def check_real(world: int, args: argparse.Namespace) -> str:
    """A real job and the simulation's beats at the same W and step, side by side."""
    from control_plane_sim_mesh import real_job

    real = real_job(world, args.real_steps, 100.0)
    args.step_s = real["step_s"]
    args.probe = False  # the real job has no probe calling its store 100 times a second
    # The store thread's CPU at 8 ranks is a few clock ticks a second: as long a window.
    args.window = max(args.window, real["window_s"])
    rows = rows_of(world, restart_pieces(world, {"beats"}, args), {"beats"})["beats"]
    if "error" in rows:
        return f"the simulation at W = {world} failed: {rows['error']}"
    calls = rows["calls"] / real["calls"] if real["calls"] else float("nan")
    cpu = rows["store_thread"] / real["store_thread"] if real["store_thread"] else float("nan")
    return "\n".join(
        [
            f"Check against a real {world}-rank job (benchmarks/control_plane.py's, step "
            f"{real['step_s'] * 1000:.0f} ms, {real['window_s']:.0f} s measured; the "
            "simulation stepped as fast, restart mode's beats, no probe):",
            f"  store calls per rank per second: real {real['calls']:.2f}, simulated "
            f"{rows['calls']:.2f}: {calls:.2f}x",
            f"  store thread's CPU: real {pct(real['store_thread'])}, simulated "
            f"{pct(rows['store_thread'])}: {cpu:.2f}x (the issue asks within 1.5x)",
        ]
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", default="32,256,1024,4096")
    parser.add_argument("--pieces", default=",".join(PIECES), help=f"of {','.join(PIECES)}")
    parser.add_argument("--window", type=float, default=3.0, help="seconds of each steady state")
    parser.add_argument("--settle", type=float, default=1.0, help="seconds before a window")
    parser.add_argument(
        "--procs", type=int, default=0, help="processes of simulated ranks (0: one per 64, 4+)"
    )
    parser.add_argument("--per-machine", type=int, default=8, help="in-place members a machine")
    parser.add_argument("--watch-s", type=float, default=0.1, help="quiet launchers' pace")
    parser.add_argument("--heartbeat-s", type=float, default=1.0, help="fault.heartbeat_s")
    parser.add_argument("--timeout-s", type=float, default=300.0, help="dist.timeout_s")
    parser.add_argument("--step-s", type=float, default=0.15, help="a simulated step")
    parser.add_argument("--start-timeout", type=float, default=300.0)
    parser.add_argument(
        "--stagger-s", type=float, default=0.0, help="each rank process starts this much later"
    )
    parser.add_argument("--piece-timeout", type=float, default=60.0)
    parser.add_argument("--pg-max", type=int, default=32, help="largest gloo group measured")
    parser.add_argument("--check-real", type=int, default=0, help="also a real job of N ranks")
    parser.add_argument("--real-steps", type=int, default=150, help="the real job's steps")
    parser.add_argument("--no-probe", dest="probe", action="store_false", help="no probe client")
    parser.add_argument("--write-docs", action="store_true", help="update docs/benchmarks.md")
    parser.add_argument("--json", default="", help="also write every row to this file")
    args = parser.parse_args()
    pieces = {p for p in args.pieces.split(",") if p}
    if pieces - set(PIECES):
        parser.error(f"--pieces: unknown {sorted(pieces - set(PIECES))}; of {', '.join(PIECES)}")
    worlds = [int(w) for w in args.worlds.split(",") if w]  # none: only --check-real
    if any(w < 3 for w in worlds):
        parser.error("--worlds: 3 ranks or more (one of them is killed)")
    text, rows = simulate(worlds, pieces, args)
    text += "\n\n" + NOTES
    if args.json:
        Path(args.json).write_text(json.dumps(rows, default=str))
    setting = (
        (f"{args.procs} processes of" if args.procs else "64 to a process (at least 4) of")
        + " simulated ranks, in-place members on machines of "
        f"{args.per_machine or 'all'}, windows of {args.window:g}s"
    )
    if args.check_real:  # (it sets the window and the step to the real job's)
        text += "\n\n" + check_real(args.check_real, args)
    print(text)
    print(machine_line())
    if args.write_docs:
        path = write_report_section(
            "control-plane-sim",
            "The control plane simulated at thousands of ranks",
            text,
            setting,
        )
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
