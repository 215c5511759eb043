"""The report of ``benchmarks/control_plane_sim.py``: a table per world size, the gloo mesh's
counts and their extrapolation, and where each piece breaks the bounds of issue #44."""

from __future__ import annotations

import argparse
import math
import statistics
from typing import Any

RESTART = ("beats", "words", "diagnosis")
INPLACE = ("waiting", "first", "inplace", "regroup")
PIECES = (*RESTART, *INPLACE, "pg")
# What counts as broken, at a W (the "done when"): the store thread above half a core
# in a steady state, a probe call's p99 above a second, a one-off piece over 10 s, a killed
# rank named wrongly by anyone, the coordinator's poll over its 10 ms interval (p99).
HALF_CORE, PROBE_P99_S, ONE_OFF_S, POLL_S = 0.5, 1.0, 10.0, 0.01


def quantile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def rates(reports: list[dict[str, Any]], start: float, end: float, ranks: int) -> tuple[float, ...]:
    """Link calls and store operations per rank per second between two times, from every
    process's tally series."""

    def at(series: list[list[float]], t: float, column: int) -> float:
        before = [row for row in series if row[0] <= t]
        return before[-1][column] if before else 0.0

    calls = sum(at(r["series"], end, 1) - at(r["series"], start, 1) for r in reports)
    ops = sum(at(r["series"], end, 2) - at(r["series"], start, 2) for r in reports)
    span = max(end - start, 1e-9)
    return calls / ranks / span, ops / ranks / span


# Simulated ranks a process holds by default: with 256 (4 processes at W = 1,024) the threads
# of one process waited up to 0.7 s for its interpreter's lock while every rank diagnosed, a
# live rank's beats went 3.5 s apart and the diagnosis named it stopped (a real rank has a
# process of its own); with 64, 0.5 s and 2.7 s.
RANKS_PER_PROCESS = 64


def processes_of(world: int, procs: int) -> int:
    """The processes of ranks 0 .. W-2 (the victim has its own): ``procs``, or (0) one per
    ``RANKS_PER_PROCESS``, at least 4."""
    wanted = procs or max(4, -(-(world - 1) // RANKS_PER_PROCESS))
    return max(1, min(wanted, world - 1))


def rows_of(world: int, result: dict[str, Any], pieces: set[str]) -> dict[str, dict[str, Any]]:
    """Each measured piece's row: the window's figures, its rates from the ranks' tallies,
    and what the piece itself says (times, who was named, polls)."""
    if "error" in result:
        return {p: {"error": result["error"]} for p in pieces}
    reports, polls = result["reports"], result["host"].get("polls", [])
    out: dict[str, dict[str, Any]] = {}
    for name, row in result["rows"].items():
        if name not in pieces:
            continue
        row = dict(row)
        ranks = world - 1 if name in ("diagnosis", "regroup") else world
        row["calls"], row["ops"] = rates(reports, row["from"], row["to"], ranks)
        inside = [s for t, s in polls if row["from"] <= t <= row["to"]]
        row["poll_p50"], row["poll_p99"] = quantile(inside, 0.5), quantile(inside, 0.99)
        if "started" in row:
            # Counted by each process around the piece (the victim's not: it was killed).
            counted = [r[f"{name}_calls"] for r in reports if r.get(f"{name}_calls")]
            reporting = sum(r["ranks"] for r in reports if r.get(f"{name}_calls"))
            row["calls_total"] = sum(c[0] for c in counted) / max(1, reporting)
            row["ops_total"] = sum(c[1] for c in counted) / max(1, reporting)
            results = [x for r in reports for x in r.get(name, [])]
            if name == "first":
                results = [{"end": t} for r in reports for t in r.get("first", [])]
            ends = [x["end"] for x in results if isinstance(x, dict) and "end" in x]
            row["times"] = sorted(e - row["started"] for e in ends)
            starved = [r[f"{name}_starved"] for r in reports if r.get(f"{name}_starved")]
            if starved:
                row["starved"] = {k: max(x[k] for x in starved) for k in starved[0]}
            row["wrong"] = [
                str(x.get("words") or x.get("error") or x)
                for x in results
                if isinstance(x, dict) and ("right" in x or "error" in x) and not x.get("right")
            ][:2]
        out[name] = row
    tally: dict[str, int] = {}
    for r in reports:
        for k, v in r.get("tally", {}).items():
            tally[k] = tally.get(k, 0) + v
    for row in out.values():
        row["connections"] = tally.get("connections", 0)
        row["connect_failures"] = tally.get("connect_failures", 0)
        row["slow_connections"] = tally.get("slow_connections", 0)
        row["overflows"] = result["host"].get("overflows", 0)
    return out


def ms(value: float) -> str:
    return "-" if value != value else f"{value * 1000:.1f}"


def pct(value: float) -> str:
    return "-" if value != value else f"{value * 100:.1f}%"


def broken(name: str, row: dict[str, Any], world: int) -> list[str]:
    """What in a row breaks the issue's bounds (empty: none)."""
    if "error" in row:
        return [row["error"]]
    why = []
    if "started" not in row and row["store_thread"] > HALF_CORE:
        why.append(f"store thread {pct(row['store_thread'])} of a core")
    if row["probe_p99"] > PROBE_P99_S:
        why.append(f"probe p99 {row['probe_p99']:.2f}s")
    if name in ("waiting", "inplace") and row.get("poll_p99", float("nan")) > POLL_S:
        why.append(f"coordinator poll p99 {ms(row['poll_p99'])} ms > 10 ms")
    if "started" in row:
        expected = world - 1 if name in ("diagnosis", "regroup") else world
        if not row.get("finished") or row.get("done", 0) < expected:
            why.append(f"{row.get('done', 0)}/{expected} done in {row['to'] - row['from']:.0f}s")
        elif row["times"] and row["times"][-1] > ONE_OFF_S:
            why.append(f"took {row['times'][-1]:.1f}s")
        if row.get("right", 0) < expected:
            why.append(f"{row['right']}/{expected} right")
    return why


def table(world: int, rows: dict[str, dict[str, Any]], args: argparse.Namespace) -> str:
    lines = [
        f"W = {world} ({processes_of(world, args.procs)} processes of ranks and the victim's own)",
        f"{'piece':<10} {'calls/rank/s':>12} {'ops/rank/s':>10} {'store thr':>9} "
        f"{'store proc':>10} {'harness':>8} {'probe p50/p99 ms':>16}  what the piece says",
    ]
    for name in PIECES:
        row = rows.get(name)
        if row is None or name == "pg":
            continue
        if "error" in row:
            lines.append(f"{name:<10} {row['error']}")
            continue
        says = []
        if "times" in row:
            times = row["times"]
            expected = world - 1 if name in ("diagnosis", "regroup") else world
            says.append(f"{row['done']}/{expected} done, {row['right']} right")
            if times:
                says.append(
                    f"in {times[0]:.2f}-{times[-1]:.2f}s (median {statistics.median(times):.2f}s)"
                )
            says.append(f"{row['calls_total']:.0f} calls/rank in all")
            if "starved" in row:
                st = row["starved"]
                says.append(
                    f"harness threads late p99/max {st['late_p99']:.2f}/{st['late_max']:.2f}s, "
                    f"a live rank's beats {st['beat_gap']:.1f}s apart at most"
                )
        if row.get("poll_p50") == row.get("poll_p50"):
            says.append(f"coordinator poll p50/p99 {ms(row['poll_p50'])}/{ms(row['poll_p99'])} ms")
        lines.append(
            f"{name:<10} {row['calls']:>12.2f} {row['ops']:>10.2f} {pct(row['store_thread']):>9} "
            f"{pct(row['store_process']):>10} {pct(row['harness']):>8} "
            f"{ms(row['probe_p50']) + '/' + ms(row['probe_p99']):>16}  {'; '.join(says)}"
        )
        for words in row.get("wrong", []):
            lines.append(f"{'':<10} wrong: {words[:200]}")
    for mode, names in (("restart", RESTART), ("in-place", INPLACE)):
        row = next((rows[n] for n in names if "connections" in rows.get(n, {})), None)
        if row is not None:
            lines.append(
                f"{mode}: connections the ranks opened {row['connections']} "
                f"({row['connect_failures']} failed, {row['slow_connections']} took over 1 s; "
                "the victim's not counted), accept-queue "
                f"overflows on this machine meanwhile {row['overflows']}"
            )
    return "\n".join(lines)


def pg_lines(meshes: list[dict[str, Any]], worlds: list[int]) -> list[str]:
    """Measured groups, then their extrapolation to the worlds (a power law each)."""
    lines = ["gloo's full mesh at a group's creation (measured; threads of one process):"]
    for m in [m for m in meshes if "error" in m]:
        lines.append(f"  W = {m['world']:>4}: not made: {m['error']}")
    meshes = [m for m in meshes if "error" not in m]
    for m in meshes:
        lines.append(
            f"  W = {m['world']:>4.0f}: {m['calls']:>8.0f} store calls, {m['bytes']:>10.0f} "
            f"bytes, made in {m['made_s']:.2f}s"
        )
    if len(meshes) >= 2:
        # A power law through the two largest groups measured: the bytes grow faster than
        # W^2 (each rank's record lists more as the group grows), so a fixed exponent would not do.
        low, top = meshes[-2], meshes[-1]

        def fit(name: str) -> tuple[float, float]:
            k = math.log(top[name] / low[name]) / math.log(top["world"] / low["world"])
            return top[name] / top["world"] ** k, k

        (a, ka), (b, kb) = fit("calls"), fit("bytes")
        lines.append(
            f"  extrapolated as {a:.2f} W^{ka:.2f} calls and {b:.0f} W^{kb:.2f} bytes (through W "
            f"= {low['world']:.0f} and {top['world']:.0f}; not measured beyond):"
        )
        for w in worlds:
            lines.append(f"  W = {w:>4}: ~{a * w**ka:,.0f} store calls, ~{b * w**kb / 1e6:,.1f} MB")
    return lines


def summary(all_rows: dict[int, dict[str, dict[str, Any]]]) -> list[str]:
    """Per piece: the first W where it breaks a bound, and why."""
    lines = [
        "Where each piece breaks (store thread > half a core in a steady state, probe p99 "
        "> 1 s, a one-off > 10 s or not done, a wrong name, a poll > 10 ms):"
    ]
    for name in PIECES:
        seen = [(w, rows[name]) for w, rows in sorted(all_rows.items()) if name in rows]
        if not seen or name == "pg":
            continue
        first = next(((w, broken(name, row, w)) for w, row in seen if broken(name, row, w)), None)
        held = ", ".join(str(w) for w, _ in seen)
        if first is None:
            lines.append(f"  {name:<10} holds at every W measured ({held})")
        else:
            lines.append(f"  {name:<10} breaks at W = {first[0]}: {'; '.join(first[1])}")
    return lines


NOTES = """\
Columns: calls/rank/s, the ranks' calls through dtrain's store client (StoreLink.call, as
benchmarks/control_plane.py counts a real job's) and ops/rank/s, the store operations inside
them, per rank and second of the piece's window; store thr and store proc, the CPU share of a
core of the store's server thread (pt_tcpstore_uv) and of its whole process (which runs the
in-place coordinator too), read from /proc; harness, the CPU of the processes of simulated
ranks: near the machine's cores, the ranks ran slower than a real job's would, and their rates
are a floor; probe, the latency of another client's `add` meanwhile. One-off pieces (words,
diagnosis, first, regroup) say how many ranks finished and were right (every word; the killed
rank named, and only it; the generation of the survivors), their times from the start (the
kill, for diagnosis and regroup), and their calls per rank in all (first's: since the
members asked, the waiting window included). A simulated rank's process is a machine of its
own (its hostname), so the diagnosis of the killed rank (alone in its process) takes the path
of a rank on another machine: its beat goes stale first. In place, the members sit on
machines of --per-machine (8): the coordinator reads only its own machine's processes in
/proc, and the other machines' launchers (dtrain's NodeWatcher, in a process of their own,
counted in harness; their store calls are not the ranks') post their members' states and
their liveness; the killed member is on the last machine, whose launcher posts it down.
Until 2026-12-05 every member sat on the coordinator's machine, and each poll read W
processes in /proc (59-67 ms of a poll at 1,024), which no real coordinator does.
Connections that took over 1 s: torch's store client looks up the name of its socket's
address (getnameinfo of ::ffff:127.0.0.1, which goes to the DNS server: it is no name in
/etc/hosts); where the resolver drops a query, the lookup waits out its 5 s timeout (one in
25-60 here; a plain getnameinfo of that address does the same), and a connection given 5 s
or less (the in-place member's: recovery/membership.store_call_s) fails and is made again.
Plain TCP connections to the same store never stall; accept-queue overflows: as counted.
The harness's own choices: ranks are threads, 64 to a process (at least 4 processes), where a
real rank has a process and a core of its own; nothing of dtrain's is skipped or slowed
(fault.heartbeat_s 1 s, dist.timeout_s 300 s, a diagnosis's 3 s staleness, as a job's
defaults). Each one-off piece says how late the harness's threads ran (a 50 ms sleep's
lateness, p99/max) and how far apart a live rank's beats went at most: past 3 s, a diagnosis
names that live rank stopped, which is the harness starving it, not the rank. Until
2026-12-05 a process held 256 ranks at W = 1,024: its threads ran up to 0.7 s late, a live
rank's beats went 3.5 s apart, and the diagnosis named live ranks (0 of 1,023 right)."""
