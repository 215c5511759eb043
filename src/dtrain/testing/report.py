"""Writing measured figures into the docs -- for benchmarks and system tests: the machine's
description, and one script's section of a Markdown file (between markers, so that scripts never
touch each other's figures)."""

from __future__ import annotations

import os
import platform
import re
from pathlib import Path


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


def update_section(doc: Path, name: str, body: str, header: str = "") -> Path:
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
