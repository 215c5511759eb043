"""Shared by the benchmark scripts and the chaos run of ``tests/system/``: repeated timing, the
machine's description, and writing a script's section of ``docs/benchmarks.md`` (between
markers, so the scripts never touch each other's figures)."""

from __future__ import annotations

import os
import platform
import re
import shlex
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "benchmarks.md"
HEADER = """# Benchmarks

Every figure below was printed by a script in `benchmarks/`, which measures a baseline and
dtrain side by side in one run and writes its own section here (between its markers); the
fault-tolerance table comes from the system test `tests/system/chaos.py` (`make chaos`). Rerun
the command shown to refresh a section.
"""


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    import numpy
    import torch

    return (
        f"{os.cpu_count()} CPU cores ({cpu}), Python {platform.python_version()}, "
        f"torch {torch.__version__}, NumPy {numpy.__version__}"
    )


def machine_line() -> str:
    """:func:`machine` and the load average, for a run that has just finished."""
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    return f"{machine()}; load average {load} when it finished"


def update_doc_section(doc: Path, name: str, body: str, header: str = "") -> Path:
    """Replace (or add at the end) the section ``name`` of ``doc``: the text between
    ``<!-- BEGIN name -->`` and ``<!-- END name -->``. A missing ``doc`` starts as ``header``."""
    begin, end = f"<!-- BEGIN {name} -->", f"<!-- END {name} -->"
    section = f"{begin}\n{body.rstrip()}\n{end}"
    text = doc.read_text() if doc.exists() else header
    pattern = re.compile(re.escape(begin) + r".*?" + re.escape(end), re.DOTALL)
    if pattern.search(text):
        text = pattern.sub(lambda _: section, text)
    else:
        text = text.rstrip() + "\n\n" + section + "\n"
    doc.parent.mkdir(parents=True, exist_ok=True)
    doc.write_text(text)
    return doc


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
