"""Where metrics go: ``RUN_DIR/metrics.jsonl`` (one JSON object per line, the schema is
docs/metrics.md), the console, TensorBoard (:mod:`dtrain.metrics.tensorboard`) and the
experiment trackers (:mod:`dtrain.metrics.trackers`).

Every sink takes the same records (:class:`Sink`); the trainer writes each record once, to
:class:`Sinks`, which hands it to every sink it holds. Only rank 0 has sinks."""

from __future__ import annotations

import contextlib
import json
import math
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol, TextIO

from tqdm import tqdm

from dtrain.console import say_line
from dtrain.fsutil import format_size

Record = dict[str, Any]


class Sink(Protocol):
    def write(self, record: Record) -> None: ...

    def close(self) -> None: ...


class Sinks:
    """Every record to every sink, in order."""

    def __init__(self, sinks: Sequence[Sink]) -> None:
        self.sinks = list(sinks)

    def write(self, record: Record) -> None:
        for sink in self.sinks:
            sink.write(record)

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()


def open_sinks(
    run_dir: Path, progress: Progress, *, tensorboard: bool, trackers: Sequence[Sink] = ()
) -> Sinks:
    """Rank 0's sinks: ``RUN_DIR/metrics.jsonl``, the progress line, TensorBoard when
    ``metrics.tensorboard`` asks for it, and the experiment ``trackers``
    (:mod:`dtrain.metrics.trackers`)."""
    sinks: list[Sink] = [JsonlSink(run_dir / "metrics.jsonl"), progress]
    if tensorboard:
        from dtrain.metrics.tensorboard import TensorBoardSink

        sinks.append(TensorBoardSink(run_dir))
    return Sinks([*sinks, *trackers])


class JsonlSink:
    """Append-only; each line is flushed so a crash loses at most the line being written."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        # A run that crashed mid-line left the file without its last newline: start on a
        # line of our own, so the cut line stays the only one lost.
        cut = False
        if path.exists() and path.stat().st_size > 0:
            with path.open("rb") as fh:
                fh.seek(-1, 2)
                cut = fh.read(1) != b"\n"
        self._fh: TextIO | None = path.open("a", buffering=1)
        if cut:
            self._fh.write("\n")
        self.lost = 0  # records that could not be written
        self.warned = False

    def write(self, record: dict[str, Any]) -> None:
        clean = {
            k: (None if isinstance(v, float) and not math.isfinite(v) else v)
            for k, v in record.items()
        }
        line = json.dumps(clean) + "\n"
        try:
            if self._fh is None:  # a write failed before: try the file again
                self._fh = self.path.open("a", buffering=1)
                self._fh.write("\n")  # the failed write may have left a cut line
            self._fh.write(line)
        except OSError as exc:
            # A full disk (or storage gone away) costs the metrics, never the run: one
            # warning, then every record tries again; the reader skips a cut line.
            self.lost += 1
            self._drop()
            if not self.warned:
                self.warned = True
                print(
                    f"dtrain: warning: cannot write {self.path} ({exc.strerror or exc}); "
                    "training goes on, and its records are lost until the file takes them again",
                    file=sys.stderr,
                    flush=True,
                )

    def _drop(self) -> None:
        fh, self._fh = self._fh, None
        if fh is not None:
            with contextlib.suppress(OSError):  # its buffered part of a line is lost with it
                fh.close()

    def close(self) -> None:
        self._drop()


def format_rate(value: float) -> str:
    units = (("M", 1e6), ("k", 1e3))
    return next(
        (f"{value / size:.1f}{unit}" for unit, size in units if value >= size), f"{value:.0f}"
    )


def format_duration(seconds: float) -> str:
    seconds = max(0, int(seconds))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}h{minutes:02d}m" if hours else f"{minutes}m{secs:02d}s"


class Progress:
    """A progress bar on a terminal; on a pipe (CI logs), one plain line per logged step. As
    a sink it shows ``train`` records and remembers the slowest rank of the latest ``ranks``
    record."""

    def __init__(self, total: int, initial: int, item_name: str) -> None:
        self.total = total
        self.item_name = item_name
        self.interactive = sys.stderr.isatty()
        self.start = time.perf_counter()
        self.start_step = initial
        self.bar = tqdm(
            total=total,
            initial=initial,
            unit="step",
            dynamic_ncols=True,
            disable=not self.interactive,
            file=sys.stderr,
        )
        self.slowest = ""  # "slowest rank 1 1.3x", from the latest per-rank record

    def write(self, record: Record) -> None:
        kind = record.get("kind")
        if kind == "ranks":
            self.slowest = slowest_rank(record)
        if kind != "train":
            return
        step, loss = int(record["step"]), record.get("loss")
        loss = float("nan") if loss is None else float(loss)
        done = step - self.start_step
        elapsed = time.perf_counter() - self.start
        eta = elapsed / done * (self.total - step) if done > 0 else float("nan")
        items_per_s = float(record.get(f"{self.item_name}_per_s") or 0.0)
        rate = f"{format_rate(items_per_s)} {self.item_name}/s"
        comm_bytes = float(record.get("comm_bytes_per_step") or 0.0)  # what this rank sent
        if comm_bytes:
            rate += f"  comm {format_size(comm_bytes)}/step"
        if self.slowest:
            rate += f"  {self.slowest}"
        if self.interactive:
            self.bar.set_postfix_str(f"loss {loss:.3f} {rate}", refresh=False)
            self.bar.update(step - self.bar.n)
        else:
            eta_text = format_duration(eta) if math.isfinite(eta) else "?"
            say_line(f"step {step}/{self.total}  loss {loss:.4f}  {rate}  eta {eta_text}")

    def message(self, text: str) -> None:
        if self.interactive:
            self.bar.write(text, file=sys.stderr)
        else:
            say_line(text)

    def close(self) -> None:
        self.bar.close()


def slowest_rank(record: Record) -> str:
    """``"slowest rank R 1.3x"`` from a ``ranks`` record: the rank whose own time per item is
    the most above the others' median; empty with one rank or no timings."""
    slowdown = [s if s is not None else float("nan") for s in record.get("slowdown") or []]
    if len(slowdown) < 2 or not any(math.isfinite(s) for s in slowdown):
        return ""
    rank = max((r for r, s in enumerate(slowdown) if math.isfinite(s)), key=lambda r: slowdown[r])
    return f"slowest rank {rank} {slowdown[rank]:.2f}x"
