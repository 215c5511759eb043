"""Where metrics go: ``RUN_DIR/metrics.jsonl`` (one JSON object per line) and the console."""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path
from typing import Any, TextIO

from tqdm import tqdm


class JsonlSink:
    """Append-only; each line is flushed so a crash loses at most the line being written."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._fh: TextIO = path.open("a", buffering=1)

    def write(self, record: dict[str, Any]) -> None:
        clean = {
            k: (None if isinstance(v, float) and not math.isfinite(v) else v)
            for k, v in record.items()
        }
        self._fh.write(json.dumps(clean) + "\n")

    def close(self) -> None:
        self._fh.close()


def format_rate(value: float) -> str:
    for unit, scale in (("M", 1e6), ("k", 1e3)):
        if value >= scale:
            return f"{value / scale:.1f}{unit}"
    return f"{value:.0f}"


def format_bytes(value: float) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if value >= size:
            return f"{value / size:.1f} {unit}"
    return f"{value:.0f} B"


def format_duration(seconds: float) -> str:
    seconds = max(0, int(seconds))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}h{minutes:02d}m" if hours else f"{minutes}m{secs:02d}s"


class Progress:
    """A progress bar on a terminal; on a pipe (CI logs), one plain line per logged step."""

    def __init__(self, total: int, initial: int, item_name: str, enabled: bool) -> None:
        self.total = total
        self.item_name = item_name
        self.enabled = enabled
        self.interactive = enabled and sys.stderr.isatty()
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

    def update(self, step: int, loss: float, items_per_s: float, comm_bytes: float = 0.0) -> None:
        """``comm_bytes``: what this rank sent per step since the last update."""
        if not self.enabled:
            return
        done = step - self.start_step
        elapsed = time.perf_counter() - self.start
        eta = elapsed / done * (self.total - step) if done > 0 else float("nan")
        rate = f"{format_rate(items_per_s)} {self.item_name}/s"
        if comm_bytes:
            rate += f"  comm {format_bytes(comm_bytes)}/step"
        if self.interactive:
            self.bar.set_postfix_str(f"loss {loss:.3f} {rate}", refresh=False)
            self.bar.update(step - self.bar.n)
        else:
            eta_text = format_duration(eta) if math.isfinite(eta) else "?"
            print(
                f"step {step}/{self.total}  loss {loss:.4f}  {rate}  eta {eta_text}",
                file=sys.stderr,
                flush=True,
            )

    def message(self, text: str) -> None:
        if not self.enabled:
            return
        if self.interactive:
            self.bar.write(text, file=sys.stderr)
        else:
            print(text, file=sys.stderr, flush=True)

    def close(self) -> None:
        self.bar.close()
