"""What an estimate says: the parts one rank holds and the totals of the phases they add up
in (the largest is the peak), for the rank that needs the most."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class Line:
    what: str
    bytes: int


@dataclass
class MemoryEstimate:
    """One rank's memory (the rank that needs the most) for a config at a world size."""

    strategy: str
    world_size: int
    mesh: str
    rank: int
    where: str  # the part of the model that rank holds
    precision: str
    activation_checkpointing: str
    micro_batch_samples: int
    parameter_count: int
    lines: list[Line]  # the parts, each once
    phases: dict[str, int]  # the totals: set-up, forward/backward, optimizer step, ...
    other_checkpointing: str  # the comparison: "full" where none is configured, else "none"
    other_activations: int
    other_peak: int
    notes: list[str] = field(default_factory=list)
    budget: int | None = None

    @property
    def peak(self) -> int:
        return max(self.phases.values())

    @property
    def peak_phase(self) -> str:
        return max(self.phases, key=lambda name: self.phases[name])

    @property
    def fits(self) -> bool | None:
        return None if self.budget is None else self.peak <= self.budget

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["lines"] = {line.what: line.bytes for line in self.lines}
        out.update(peak=self.peak, peak_phase=self.peak_phase, fits=self.fits)
        return out
