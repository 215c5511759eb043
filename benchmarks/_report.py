"""Shared by the benchmark scripts: repeated timing, the machine's description, and writing a
script's section of ``docs/benchmarks.md`` (between markers, so the scripts never touch each
other's figures; the marker logic is :func:`dtrain.testing.report.update_section`, which the
chaos run of ``tests/system/`` uses too)."""

from __future__ import annotations

import os
import shlex
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

from dtrain.testing.report import machine
from dtrain.testing.report import update_section as update_doc_section

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "benchmarks.md"
HEADER = """# Benchmarks

Every figure below was printed by a script in `benchmarks/`, which measures a baseline and
dtrain side by side in one run and writes its own section here (between its markers); the
fault-tolerance table comes from the system test `tests/system/chaos.py` (`make chaos`). Rerun
the command shown to refresh a section.
"""


def command_line() -> str:
    """The command that reproduces this run, relative to the repository root."""
    script = Path(sys.argv[0]).resolve()
    try:
        shown = str(script.relative_to(ROOT))
    except ValueError:
        shown = str(script)
    return " ".join(["python", shown, *(shlex.quote(a) for a in sys.argv[1:])])


def median_rate(fn: Callable[[], int], repeats: int) -> tuple[float, list[float]]:
    """Run ``fn`` (returns the items it processed) ``repeats`` times: median items/s and all."""
    rates = []
    for _ in range(repeats):
        started = time.perf_counter()
        items = fn()
        rates.append(items / (time.perf_counter() - started))
    return statistics.median(rates), rates


def rss_anon_kib() -> int:
    """Anonymous resident memory of this process (heap, stacks; not file-backed maps)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1])
    raise RuntimeError("no RssAnon in /proc/self/status (Linux only)")


def update_section(name: str, body: str) -> Path:
    """Replace (or add) this script's section of docs/benchmarks.md."""
    return update_doc_section(DOC, name, body, HEADER)


def write_report_section(name: str, title: str, report: str, setting: str = "") -> Path:
    """A script's section holding its printed report as is: the title, the command, the date,
    the machine (and ``setting``), then the report in a code block."""
    load = ", ".join(f"{v:.1f}" for v in os.getloadavg())
    where = f"{machine()}; {setting}" if setting else machine()
    body = "\n".join(
        [
            f"## {title}",
            "",
            f"`{command_line()}` on {time.strftime('%Y-%m-%d')}",
            f"({where}; load average {load} when it finished):",
            "",
            "```",
            report,
            "```",
        ]
    )
    return update_section(name, body)
