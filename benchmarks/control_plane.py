"""The control plane as the world grows: start-up, what liveness and metrics cost each rank per
step, a checkpoint's commit, and the time from a kill -9 to a named error and to training
again -- at 2 to 32 ranks of one machine (``benchmarks/control_plane_task.py``: a tiny model
whose forward sleeps, one thread per rank).

On a machine with fewer cores than ranks, wall times measure the machine as much as dtrain: 32
ranks share 2 cores. So the per-step cost is counted where it is spent, per rank: CPU time of
the training thread inside the control plane's calls, CPU time of the watchdog's thread, and
the calls each rank makes to the job's key-value store -- each per step, and its ratio to the
2-rank figure (the target: within 1.1x at 32 ranks). Start-up, commit and failure times are
wall times, printed as measured, with what bounds them here.

    python benchmarks/control_plane.py                  # 2, 4, 8, 16, 32 ranks
    python benchmarks/control_plane.py --worlds 2,8 --write-doc

Across machines: ``--hosts H --nproc-per-host P[,P2...]`` runs each world of H x P ranks twice,
on one machine and on H hosts made of network namespaces (``tests.hosts``: each with
its own network stack, address and hostname, joined by a bridge; one ``dtrain train`` per host,
c10d rendezvous on host 0), and prints the same rows for both, the hosts' ratios to the one
machine's (its own section of docs/benchmarks.md, ``control-plane-hosts``). Needs root; the
hosts take their own subnet (``--subnet``, not the tests' 10.77.0) and are removed at the end,
also when a run fails.

    python benchmarks/control_plane.py --hosts 4 --nproc-per-host 2,4 --write-doc
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import re
import signal
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from _report import ROOT, machine_line, write_report_section

sys.path.insert(0, str(ROOT))  # tests/hosts.py: the namespace hosts of a source checkout
from tests.hosts import Hosts, leftovers
from tests.processes import Launch, rank_of

HERE = Path(__file__).resolve().parent
PER_RANK_BATCH = 2
RDZV_PORT = 29500  # on host 0; each hosts run takes the next (no wait on an old one's socket)


@dataclass(frozen=True)
class Layout:
    """Where a job's ranks run: ``nodes`` x ``per_node``, on one machine (``hosts`` None: one
    ``dtrain train --nproc W``) or one ``dtrain train`` per namespace host."""

    nodes: int
    per_node: int
    hosts: Hosts | None = None

    @property
    def world(self) -> int:
        return self.nodes * self.per_node

    @property
    def label(self) -> str:
        return f"{self.nodes}x{self.per_node}" if self.hosts is not None else str(self.world)

    @property
    def name(self) -> str:
        return f"h{self.nodes}x{self.per_node}" if self.hosts is not None else f"w{self.world}"


_ports = iter(range(RDZV_PORT, RDZV_PORT + 1000))


def start(layout: Layout, config: Path, *args: str) -> list[Launch]:
    """The job's ``dtrain train`` processes (one per host), started at once."""
    hosts = layout.hosts
    if hosts is None:
        return [Launch(config, layout.world, *args, cwd=HERE)]
    endpoint = f"{hosts.address(0)}:{next(_ports)}"
    return [
        Launch(
            config,
            layout.per_node,
            "--nnodes",
            str(layout.nodes),
            "--node-rank",
            str(i),
            "--rdzv-endpoint",
            endpoint,
            "--run-id",
            config.stem,
            *args,
            cwd=HERE,
            exec_prefix=hosts.exec_prefix(i),
        )
        for i in range(layout.nodes)
    ]


def close(launches: list[Launch]) -> None:
    for launch in launches:
        launch.close()


def outputs(launches: list[Launch]) -> str:
    return "\n".join(f"--- host {i}\n{launch.text()[-3000:]}" for i, launch in enumerate(launches))


def write_config(path: Path, run_dir: Path, world: int, steps: int, sleep_ms: float) -> Path:
    lines = [
        "[run]",
        f'dir = "{run_dir}"',
        'task = "control_plane_task:build"',
        "[data]",
        f"global_batch_size = {PER_RANK_BATCH * world}",  # the same work per rank
        "prefetch = 0",
        "[train]",
        f"steps = {steps}",
        "log_every = 10",
        "[optim]",
        'name = "sgd"',
        "lr = 0.01",
        "warmup_steps = 0",
        "[eval]",
        "every = 0",
        "[checkpoint]",
        "every = 10",
        "[dist]",
        "threads = 1",
        "timeout_s = 60",
        "[task]",
        f"samples = {max(4096, 4 * PER_RANK_BATCH * world * steps)}",
        f"sleep_ms = {sleep_ms}",
    ]
    path.write_text("\n".join(lines) + "\n")
    return path


def records(run_dir: Path) -> list[dict[str, Any]]:
    metrics = run_dir / "metrics.jsonl"
    if not metrics.exists():
        return []
    out = []
    for line in metrics.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return out


def wait_for(run_dir: Path, launches: list[Launch], test: Any, timeout: float) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for record in records(run_dir):
            if test(record):
                return record
        if not all(launch.alive() for launch in launches):
            raise RuntimeError(f"the run ended early:\n{outputs(launches)}")
        time.sleep(0.05)
    raise RuntimeError(f"timed out after {timeout:.0f}s:\n{outputs(launches)}")


def steady(scratch: Path, layout: Layout, steps: int, sleep_ms: float) -> dict[str, Any]:
    """One run to the end: start-up, per-rank control-plane cost per step, commit times."""
    world = layout.world
    run_dir = scratch / f"steady-{layout.name}"
    config = write_config(scratch / f"steady-{layout.name}.toml", run_dir, world, steps, sleep_ms)
    started = time.time()
    launches = start(layout, config)
    try:
        codes = [launch.wait(1800) for launch in launches]
    finally:
        close(launches)
    if codes != [0] * len(launches):
        logs = "".join(
            f"--- {p.name}\n{p.read_text()[-2000:]}" for p in sorted((run_dir / "logs").glob("*"))
        )
        raise RuntimeError(f"{layout.label} ranks: exit {codes}\n{outputs(launches)}\n{logs}")
    begun = next(r for r in records(run_dir) if r.get("kind") == "start")
    ranks = [json.loads(p.read_text()) for p in sorted((run_dir / "bench").glob("*.json"))]
    assert len(ranks) == world, f"{len(ranks)} rank reports of {world}"
    per_rank = [measured(r) for r in ranks]
    rank0 = next(p for p, r in zip(per_rank, ranks, strict=True) if r["rank"] == 0)
    commits = [s for r in ranks for s in r["commit_s"]]

    def median(name: str) -> float:
        return statistics.median(p[name] for p in per_rank)

    return {
        "label": layout.label,
        "world": world,
        "nodes": layout.nodes if layout.hosts is not None else 0,
        "startup_s": begun["time"] - started,
        "main_units": median("main_units"),
        "watchdog_units": median("watchdog_units"),
        "rank0_main_units": rank0["main_units"],
        "main_us": median("main_us"),
        "watchdog_us": median("watchdog_us"),
        "ref_us": median("ref_us"),
        "store_ops": max(p["store_ops"] for p in per_rank),
        "per_s": {
            name: max(p["per_s"].get(name, 0.0) for p in per_rank)
            for name in ("store_calls", "beats", "stamps", "syncs")
        },
        "set_phase": median("set_phase"),
        "step_s": median("step_s"),
        "commit_s": statistics.median(commits) if commits else float("nan"),
        "parts_units": {
            name: statistics.median(p["parts_units"].get(name, 0.0) for p in per_rank)
            for name in sorted({n for p in per_rank for n in p["parts_units"]})
        },
    }


def measured(rank: dict[str, Any]) -> dict[str, Any]:
    """One rank's counters from the end of warm-up to the end: CPU per step in units of the
    reference work's CPU time on the same thread (``control_plane_task._reference_work``),
    and counts per step or per second."""
    warm, end = rank["warm"], rank["end"]
    steps = end["steps"] - warm["steps"]
    seconds = end["time"] - warm["time"]
    main_ref = statistics.median(rank["main_ref_s"])
    watchdog_ref = statistics.median(rank["watchdog_ref_s"] or rank["main_ref_s"])

    def parts(at: dict[str, Any]) -> dict[str, float]:
        return {
            **{k.rsplit(".", 1)[-1]: v for k, v in at["main_cpu_by"].items()},
            **at["inner_cpu_by"],
        }

    before, after = parts(warm), parts(end)
    main_s = (end["main_cpu_s"] - warm["main_cpu_s"]) / steps
    watchdog_s = (
        (end["watchdog_cpu_s"] or 0.0)
        - (warm["watchdog_cpu_s"] or 0.0)
        - (end["watchdog_ref_cpu_s"] - warm["watchdog_ref_cpu_s"])
    ) / steps
    counts = {k: end["counts"].get(k, 0) - warm["counts"].get(k, 0) for k in end["counts"]}
    return {
        "main_units": main_s / main_ref,
        "watchdog_units": watchdog_s / watchdog_ref,
        "main_us": 1e6 * main_s,
        "watchdog_us": 1e6 * watchdog_s,
        "ref_us": 1e6 * main_ref,
        "store_ops": (end["store_ops"] - warm["store_ops"]) / steps,
        "per_s": {
            "store_calls": (end["store_ops"] - warm["store_ops"]) / seconds,
            **{name: counts.get(name, 0) / seconds for name in ("beats", "stamps", "syncs")},
        },
        "set_phase": counts.get("set_phase", 0) / steps,
        "step_s": seconds / steps,
        "parts_units": {k: (v - before.get(k, 0.0)) / steps / main_ref for k, v in after.items()},
    }


def median_row(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Several runs of one world size: each figure's median."""
    out: dict[str, Any] = {}
    for key, value in rows[0].items():
        if isinstance(value, dict):
            out[key] = median_row([row[key] for row in rows])
        elif isinstance(value, (int, float)):
            out[key] = statistics.median(row[key] for row in rows)
        else:
            out[key] = value
    return out


def kill_and_resume(scratch: Path, layout: Layout, sleep_ms: float) -> dict[str, Any]:
    """kill -9 of one rank (the last: not rank 0, which hosts the job's store; across hosts,
    on a host other than the rendezvous's): seconds until the first host names it and until
    every host has, and until the restarted group trains again."""
    world = layout.world
    run_dir = scratch / f"kill-{layout.name}"
    config = write_config(scratch / f"kill-{layout.name}.toml", run_dir, world, 2000, sleep_ms)
    launches = start(layout, config, "--max-restarts", "1")
    victim_rank = world - 1
    named_pattern = rf"rank {victim_rank} \([^)]*\) died"
    try:
        wait_for(run_dir, launches, lambda r: r.get("kind") == "train" and r["step"] >= 20, 1200)
        victims = [
            (i, p)
            for i, launch in enumerate(launches)
            for p in launch.workers()
            if rank_of(p) == victim_rank
        ]
        host, victim = random.choice(victims)
        killed_wall, killed = time.time(), time.monotonic()
        os.kill(victim, signal.SIGKILL)
        # The new attempt's start record (rank 0 writes one at every start). Not the
        # "restart" event: rank 0 writes that where its own machine's launcher counted a
        # restart, and across machines the launcher of a healthy one may not count one.
        resumed = wait_for(
            run_dir,
            launches,
            lambda r: r.get("kind") == "start" and r["time"] > killed_wall,
            1200,
        )
        again = wait_for(
            run_dir,
            launches,
            lambda r: r.get("kind") == "train" and r["time"] > resumed["time"],
            1200,
        )
        # Every host's words, once the group trains again (each has said all it will).
        named = [launch.first(named_pattern, since=killed) for launch in launches]
        said = [
            [line for t, line in launch.lines if t >= killed and "dtrain: error" in line]
            for launch in launches
        ]
        restart_event = any(
            r.get("kind") == "event" and r.get("name") == "restart" for r in records(run_dir)
        )
    finally:
        close(launches)
    times = [n[0] - killed for n in named if n is not None]
    if len(times) < len(launches):
        silent = [i for i, n in enumerate(named) if n is None]
        print(
            json.dumps({"not_named_on_hosts": silent, "victim_host": host, "said": said}),
            flush=True,
        )
    return {
        "named_s": min(times) if times else float("nan"),
        "named_all_s": max(times) if len(times) == len(launches) else float("nan"),
        "named_hosts": f"{len(times)}/{len(launches)}",
        "victim_host": host,
        "blamed": [blamed(lines) for lines in said],
        "restarted_s": resumed["time"] - killed_wall,
        "training_s": again["time"] - killed_wall,
        "restart_event": restart_event,
    }


FATE = re.compile(r"rank (\d+) \([^)]*\) (?:died|stopped responding|is cut off|is unreachable)")


def blamed(lines: list[str]) -> list[int]:
    """The ranks that one host's error lines name as dead or silent."""
    return sorted({int(m.group(1)) for line in lines for m in FATE.finditer(line)})


def seconds(value: float) -> str:
    return "-" if math.isnan(value) else f"{value:.1f}s"


def ratio(value: float, base: float) -> str:
    return f"{value / base:.2f}x" if base > 0 else "-"


def report(
    rows: list[dict[str, Any]], sleep_ms: float, steps: int, repeats: int, hosts: int = 0
) -> str:
    """The tables. ``hosts``: the rows pair one machine with ``hosts`` namespace hosts at
    each world size, and each row's ratio is to the one machine's row of its size (else to
    the first row, the smallest world)."""
    base = rows[0]
    unit_us = base["ref_us"]  # one unit, as the first runs measured it
    step_s = base["step_s"]  # the first runs' step

    def watchdog(row: dict[str, Any]) -> float:
        # The watchdog works by the clock: its share of a step is its rate times the step's
        # length, counted at the first runs' step (the steps here are longer at 32 ranks only
        # because 32 ranks share this machine's cores).
        return float(row["watchdog_units"] / row["step_s"] * step_s)

    def total(row: dict[str, Any]) -> float:
        return float(row["main_units"]) + watchdog(row)

    def baseline(row: dict[str, Any]) -> dict[str, Any]:
        if not hosts:
            return base
        return next(r for r in rows if r["world"] == row["world"] and not r["nodes"])

    first = f"{base['world']:.0f}-rank"
    versus = "vs 1" if hosts else f"vs {base['world']:.0f}"
    lines = []
    if hosts:
        lines += [
            f"Ranks: W on one machine (one `dtrain train --nproc W`), or {hosts}xP on {hosts} "
            f"hosts of P ranks (one `dtrain train --nnodes {hosts} --nproc P` per host, each "
            "in its own network namespace with its own address and hostname; c10d rendezvous "
            "on host 0). 'vs 1': the ratio to one machine at the same world size.",
            "",
        ]
    lines += [
        f"Per rank and step, steps 21-{steps} of each run ({repeats} run(s) per size, medians; "
        f"each forward sleeps {sleep_ms:.0f} ms). CPU time in the control plane, median rank, "
        "in units of a fixed piece of Python work timed on the same thread in the same run "
        f"(shown as microseconds at the {first} runs' speed: 1 unit = {unit_us:.0f} us); the "
        f"watchdog's, which works by the clock, per second times the {first} step "
        f"({step_s * 1000:.0f} ms). Store calls of the busiest rank, per step likewise. Raw: "
        "the CPU time as measured, and the wall step time:",
        "",
        f"{'ranks':>5}  {'control plane':>13}  {versus:>5}  {'training':>8}  {'(rank 0)':>8}  "
        f"{'watchdog':>8}  {'store calls':>11}  {'raw CPU':>8}  {'raw step':>8}",
    ]
    for row in rows:
        calls = row["per_s"]["store_calls"] * step_s
        lines.append(
            f"{row['label']:>5}  {total(row) * unit_us:>10.0f} us  "
            f"{ratio(total(row), total(baseline(row))):>5}  "
            f"{row['main_units'] * unit_us:>5.0f} us  "
            f"{row['rank0_main_units'] * unit_us:>5.0f} us  {watchdog(row) * unit_us:>5.0f} us  "
            f"{calls:>11.2f}  {row['main_us'] + row['watchdog_us']:>5.0f} us  "
            f"{row['step_s'] * 1000:>5.0f} ms"
        )
    lines += [
        "",
        "Counted, per rank (the busiest): store calls, beats, liveness stamps and syncs per "
        "second of training; the training thread's set_phase calls per step:",
        "",
        f"{'ranks':>5}  {'store calls/s':>13}  {'beats/s':>7}  {'stamps/s':>8}  {'syncs/s':>7}  "
        f"{'phases/step':>11}",
    ]
    for row in rows:
        per_s = row["per_s"]
        lines.append(
            f"{row['label']:>5}  {per_s['store_calls']:>13.2f}  {per_s['beats']:>7.2f}  "
            f"{per_s['stamps']:>8.2f}  {per_s['syncs']:>7.2f}  {row['set_phase']:>11.1f}"
        )
    names = sorted({n for row in rows for n in row["parts_units"]})
    lines += [
        "",
        f"The training thread's part by call (us per step at the {first} speed, median rank; "
        "gather_*, on_window: inside the balancer's hooks, once a timing window):",
        "",
        f"{'ranks':>5}  " + "  ".join(f"{n[:13]:>13}" for n in names),
    ]
    for row in rows:
        lines.append(
            f"{row['label']:>5}  "
            + "  ".join(f"{row['parts_units'].get(n, 0.0) * unit_us:>13.1f}" for n in names)
        )
    lines += [
        "",
        "Wall times (every rank shares this machine's cores: they grow with its load"
        + (
            "; named: the first host to name the killed rank, and the last, with how many did):"
            if hosts
            else "):"
        ),
        "",
        f"{'ranks':>5}  {'start-up':>9}  {'commit':>8}  {'kill -9 -> named':>16}  "
        + (f"{'on every host':>13}  " if hosts else "")
        + f"{'-> restarted':>12}  {'-> training':>11}",
    ]
    for row in rows:
        every = ""
        if hosts:
            named_all = seconds(row.get("named_all_s", float("nan")))
            every = f"{named_all:>8} {row.get('named_hosts', '-'):>4}  "
        lines.append(
            f"{row['label']:>5}  {row['startup_s']:>8.1f}s  {row['commit_s'] * 1000:>6.0f}ms  "
            f"{seconds(row.get('named_s', float('nan'))):>16}  {every}"
            f"{seconds(row.get('restarted_s', float('nan'))):>12}  "
            f"{seconds(row.get('training_s', float('nan'))):>11}"
        )
    if hosts:
        lines += ["", *across_hosts(rows, total, baseline), "", NOTES_HOSTS]
    else:
        lines += ["", NOTES]
    return "\n".join(lines)


def across_hosts(rows: list[dict[str, Any]], total: Any, baseline: Any) -> list[str]:
    """What the figures say, per world size: the hosts' per-step figures against one
    machine's (computed, so that a rerun's words match its figures)."""
    out = []
    for row in rows:
        if not row["nodes"]:
            continue
        one = baseline(row)
        calls = row["per_s"]["store_calls"] * row["step_s"]
        one_calls = one["per_s"]["store_calls"] * one["step_s"]
        out.append(
            f"{row['world']:.0f} ranks on {row['label']} hosts against one machine, per rank "
            f"and step: control-plane CPU {ratio(total(row), total(one))}, training thread's "
            f"{ratio(row['main_units'], one['main_units'])}, store calls "
            f"{ratio(calls, one_calls)}, set_phase calls "
            f"{ratio(row['set_phase'], one['set_phase'])}; start-up "
            f"{ratio(row['startup_s'], one['startup_s'])}, commit "
            f"{ratio(row['commit_s'], one['commit_s'])}."
        )
        if "blamed" in row:
            words = "; ".join(
                f"host {i}: {', '.join(map(str, ranks)) or 'none'}"
                for i, ranks in enumerate(row["blamed"])
            )
            out.append(
                f"  kill -9 of rank {row['world'] - 1:.0f} on host {row['victim_host']}: the "
                f"ranks each host's error lines name as dead or silent -- {words}."
            )
    return out


NOTES = """\
What a rank does for the control plane is the same at any size: each phase change is a few
stores into its liveness file's shared memory; its watchdog wakes 5 times a second, beats to
the job's store when a phase has lasted 0.2 s and once a second, reads rank 0's beat once a
second (ranks other than 0), and syncs its liveness file once a second. What grows with the
world, by design, is elsewhere: rank 0's store serves every rank's beats (about 3 calls per
rank per second); once a timing window (at least balance.every steps and balance.window_s)
every rank receives every rank's timing row (an all-gather of 88 bytes per rank) and rank 0
writes one `ranks` record of W entries; a checkpoint's commit gathers every rank's file list
on rank 0, which writes them into one marker; at start, gloo connects every rank to every
other. Start-up, commit and recovery times here are bounded by the machine: every process
imports torch and builds its model on the same cores."""

NOTES_HOSTS = """\
What differs across hosts is where the same calls go, not how many there are: a rank's beats
and its reads of rank 0's beat cross the network to host 0 (TCP over a veth and a bridge here,
not loopback), as do gloo's collectives between hosts; liveness files and their stamps stay on
each rank's own machine. So the per-rank counts per step are those of one machine, and what a
call costs is the kernel's TCP path either way. The rendezvous is where hosts add work:
every host's agent joins it at host 0 (start-up), and after a failure every host's agent must
notice it and join again before the group restarts. A rank killed on another machine cannot
be looked up by its pid there: the ranks of its own host name it from its missing process at
once, the other hosts once its beats have stopped for 3 heartbeats (3 s) and a probe of the
address it published is refused -- while the launchers are already stopping the healthy
workers for the restart (the killed rank's own launcher at once, the others' as soon as it
joins the rendezvous again). A rank still diagnosing then may name the wrong rank: rank 0,
stopped by its launcher once it has named the killed rank, takes the job's store with it, and
a rank that finds the store gone blames rank 0 ("killed or crashed"); the killed rank's
neighbours on its host, stopped by their launcher, read as killed too. The recovery is not
affected. The hosts share this machine's cores, so wall times here measure the machine as
much as the network."""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", default="2,4,8,16,32")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--sleep-ms", type=float, default=100.0)
    parser.add_argument("--repeats", type=int, default=1, help="steady runs per size")
    parser.add_argument("--no-kill", action="store_true", help="skip the kill -9 runs")
    parser.add_argument(
        "--hosts",
        type=int,
        default=0,
        help="namespace hosts: each world of H x P ranks on one machine and on H hosts",
    )
    parser.add_argument("--nproc-per-host", default="2", help="P, or several: 2,4")
    parser.add_argument("--subnet", default="10.78.0", help="the hosts' /24 (tests: 10.77.0)")
    parser.add_argument(
        "--scratch", default="", help="keep the runs (configs, logs, run folders) in this folder"
    )
    parser.add_argument("--write-doc", action="store_true", help="update docs/benchmarks.md")
    args = parser.parse_args()
    if args.scratch:  # an old run folder there would be resumed, not started
        if Path(args.scratch).exists() and any(Path(args.scratch).iterdir()):
            parser.error(f"--scratch {args.scratch}: not empty")
        Path(args.scratch).mkdir(parents=True, exist_ok=True)
    if args.hosts:
        if args.hosts < 2:
            parser.error("--hosts: 2 or more (one host is the one-machine run)")
        hosts = Hosts(
            args.hosts, prefix=f"cp{os.getpid() % 100000}", hostnames=True, subnet=args.subnet
        )
        layouts = [
            layout
            for per_host in (int(p) for p in args.nproc_per_host.split(","))
            for layout in (Layout(1, args.hosts * per_host), Layout(args.hosts, per_host, hosts))
        ]
        try:
            with hosts:
                rows = measure(layouts, args)
        finally:
            left = leftovers(hosts.prefix)
            print(f"namespaces and links left: {left or 'none'}", flush=True)
    else:
        rows = measure([Layout(1, int(w)) for w in args.worlds.split(",")], args)
    text = report(rows, args.sleep_ms, args.steps, args.repeats, args.hosts)
    print(text)
    print(machine_line())
    if args.write_doc:
        if args.hosts:
            path = write_report_section(
                "control-plane-hosts",
                f"The control plane on {args.hosts} hosts against one machine",
                text,
                f"{args.hosts} hosts in network namespaces of this machine (scripts/hosts.sh, "
                "no rate limit)",
            )
        else:
            path = write_report_section(
                "control-plane", "The control plane from 2 to 32 ranks", text, "one machine"
            )
        print(f"wrote {path}")


def measure(layouts: list[Layout], args: argparse.Namespace) -> list[dict[str, Any]]:
    """Every layout's steady runs (interleaved: a busy spell hits every layout alike), then
    its kill -9 run; one row each."""
    rows = []
    with tempfile.TemporaryDirectory(prefix="dtrain-control-plane-") as temporary:
        tmp = args.scratch or temporary
        runs: dict[str, list[dict[str, Any]]] = {layout.label: [] for layout in layouts}
        for repeat in range(args.repeats):
            for layout in layouts:
                scratch = Path(tmp) / f"r{repeat}"
                scratch.mkdir(exist_ok=True)
                runs[layout.label].append(steady(scratch, layout, args.steps, args.sleep_ms))
                print(json.dumps(runs[layout.label][-1]), flush=True)
        for layout in layouts:
            row = median_row(runs[layout.label])
            if not args.no_kill:
                row.update(kill_and_resume(Path(tmp), layout, args.sleep_ms))
            rows.append(row)
            print(json.dumps({"row": row}), flush=True)
    return rows


if __name__ == "__main__":
    main()
