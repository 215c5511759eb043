"""The estimate as the command prints it: a small table, or JSON; and ``--memory`` read."""

from __future__ import annotations

import json
import re

from dtrain.errors import UserError
from dtrain.estimate.result import MemoryEstimate

# Bytes ("", "b"); kB to TB in powers of 10^3, KiB to TiB in powers of 2^10.
PREFIXES = "kmgt"
UNITS = {"": 1, "b": 1} | {f"{p}b": 1000 ** (i + 1) for i, p in enumerate(PREFIXES)}
UNITS |= {f"{p}ib": 1024 ** (i + 1) for i, p in enumerate(PREFIXES)}


def parse_bytes(text: str) -> int:
    """``80GB`` (10^9), ``80GiB`` (2^30), ``512MB``, ``1e9``: bytes; a one-line error else."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-z]*)\s*", text.lower())
    if match is None or match.group(2) not in UNITS:
        raise UserError(
            f"--memory {text!r}: expected a size such as 80GB (10^9 bytes), 80GiB (2^30) or 512MB"
        )
    return int(float(match.group(1)) * UNITS[match.group(2)])


def human(size: int) -> str:
    """Bytes in the largest decimal unit that keeps the number at least 1."""
    for unit, scale in (("TB", 10**12), ("GB", 10**9), ("MB", 10**6), ("kB", 10**3)):
        if abs(size) >= scale:
            return f"{size / scale:.2f} {unit}"
    return f"{size} B"


def format_table(estimate: MemoryEstimate) -> str:
    e = estimate
    lines = [
        f"{e.strategy} on {e.world_size} rank(s) ({e.mesh}); {e.precision}; "
        f"activation checkpointing {e.activation_checkpointing}",
        f"model: {e.parameter_count / 1e6:.2f} M parameters; micro-batch: "
        f"{e.micro_batch_samples} samples per rank",
        f"rank {e.rank} holds the most: {e.where}",
        "",
    ]
    width = max(len(line.what) for line in e.lines) + 2
    width = max(width, 36)
    lines.append(f"{'what':<{width}}{'bytes per rank':>16}")
    lines += [f"{line.what:<{width}}{human(line.bytes):>16}" for line in e.lines]
    lines.append("")
    for phase, size in e.phases.items():
        mark = "  <- peak" if phase == e.peak_phase else ""
        lines.append(f"{'total, ' + phase:<{width}}{human(size):>16}{mark}")
    lines.append(
        f"with activation checkpointing {e.other_checkpointing}: activations "
        f"{human(e.other_activations)}, peak {human(e.other_peak)}"
    )
    if e.budget is not None:
        verdict = "fits" if e.fits else "does NOT fit"
        lines.append(
            f"peak {human(e.peak)} {verdict} in {human(e.budget)} per rank "
            f"({100 * e.peak / e.budget:.0f}%)"
        )
    lines += [f"note: {note}" for note in e.notes]
    lines.append(
        "not counted: the runtime's own memory (torch, the process group, a GPU's context, "
        "the kernels' workspaces), the data, allocator slack"
    )
    return "\n".join(lines)


def format_json(estimate: MemoryEstimate) -> str:
    return json.dumps(estimate.to_json(), indent=2)
