"""The control-plane simulation (``benchmarks/control_plane_sim.py``) at its smallest: a few
simulated ranks drive dtrain's own watchdogs against a real store in its own process, one
rank's process is killed, and every other rank names it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.slow  # three processes that import torch, and a 3 s diagnosis


def simulate(tmp_path: Path, world: int, *flags: str) -> tuple[str, dict[str, Any]]:
    """The simulation of ``world`` ranks, small and short: what it printed, and its rows."""
    rows_file = tmp_path / "rows.json"
    script = str(ROOT / "benchmarks" / "control_plane_sim.py")
    command = [sys.executable, script, f"--worlds={world}", "--procs=1", "--window=1"]
    command += ["--settle=0.5", *flags, f"--json={rows_file}"]
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    return done.stdout, json.loads(rows_file.read_text())[str(world)]


def test_simulated_ranks_beat_and_name_the_killed_rank(tmp_path: Path) -> None:
    stdout, rows = simulate(tmp_path, 4, "--pieces=beats,words,diagnosis")
    assert sorted(rows) == ["beats", "diagnosis", "words"]
    beats = rows["beats"]
    # Every rank beats once a second and reads rank 0's beat once a second (rank 0 does not):
    # between 1 and 3 link calls per rank per second, whatever the machine's load.
    assert 1.0 <= beats["calls"] <= 3.0, beats
    assert beats["store_thread"] >= 0.0 and beats["probe_p50"] > 0.0
    assert rows["words"]["done"] == 4 and rows["words"]["right"] == 4
    diagnosis = rows["diagnosis"]
    # The 3 survivors each named rank 3, the killed one, and only it; after its beat went
    # stale (3 heartbeats, the last up to a beat before the kill), not at once.
    assert diagnosis["done"] == 3 and diagnosis["right"] == 3, diagnosis
    assert len(diagnosis["times"]) == 3 and min(diagnosis["times"]) >= 1.0
    # The harness says what it did to its ranks: a live rank's beats never went as far apart
    # as the diagnosis's staleness (3 s), or it could have been named in the killed one's stead.
    assert 0.0 < diagnosis["starved"]["beat_gap"] < 3.0, diagnosis["starved"]
    for piece in ("beats", "words", "diagnosis"):
        assert f"{piece:<10}" in stdout
    assert "diagnosis  holds at every W measured (4)" in stdout


def test_simulated_members_on_machines_regroup_through_their_launchers(tmp_path: Path) -> None:
    # In place, members on machines of 2: the coordinator reads its own machine's processes
    # only; the victim (member 5) is on machine 2, whose launcher (a NodeWatcher of the
    # launchers' process) posts it down; machine 1's launcher keeps its machine heard. Had
    # either launcher been silent, its machine's members would have been left out (a
    # generation of fewer than the 5 survivors: not right).
    _, rows = simulate(tmp_path, 6, "--per-machine=2", "--pieces=first,inplace,regroup")
    assert rows["first"]["done"] == 6 and rows["first"]["right"] == 6, rows["first"]
    assert rows["regroup"]["done"] == 5 and rows["regroup"]["right"] == 5, rows["regroup"]
