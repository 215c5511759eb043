"""The report's figures, one function each, over one or more runs (their curves overlaid).

Each function takes the runs and a list it appends notes to, and returns a :class:`Plot` (a
matplotlib ``Figure``, never shown: the Agg canvas only renders it to PNG) or None when no run
has what it needs. A run that lacks a plot's data is left out of that plot and a note says so:
several runs are compared on what they share. Every figure is :data:`SIZE_PX` pixels; series
carry labels (the legend), unlabelled artists are decoration; every line stays visible
(:func:`_done`; docs/observability.md, "dtrain report").
"""

from __future__ import annotations

import io
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.lines import Line2D

from dtrain.report.read import Record, Run, val_metrics

DPI = 100
SIZE_PX = (960, 480)
PHASES = (("data_s", "data wait"), ("compute_s", "compute"), ("comm_s", "comm wait"),
          ("optimizer_s", "optimizer"))  # fmt: skip
COLORS = ("tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple", "tab:brown",
          "tab:pink", "tab:gray", "tab:olive", "tab:cyan")  # fmt: skip
STYLES = ("-", "--", ":", "-.")


@dataclass
class Plot:
    name: str  # the PNG's file stem
    title: str
    figure: Figure

    def png(self) -> bytes:
        buffer = io.BytesIO()
        FigureCanvasAgg(self.figure)
        self.figure.savefig(buffer, format="png", dpi=DPI)
        return buffer.getvalue()


def _figure() -> tuple[Figure, Axes]:
    fig = Figure(figsize=(SIZE_PX[0] / DPI, SIZE_PX[1] / DPI), dpi=DPI, layout="constrained")
    ax = fig.add_subplot()
    ax.grid(True, alpha=0.3)
    return fig, ax


def _color(i: int) -> str:
    return COLORS[i % len(COLORS)]


def _points(
    records: list[Record], x: Callable[[Record], float | None], field: str
) -> tuple[list[float], list[float]]:
    xs, ys = [], []
    for record in records:
        value, at = record.get(field), x(record)
        if isinstance(value, (int, float)) and math.isfinite(value) and at is not None:
            xs.append(at)
            ys.append(float(value))
    return xs, ys


def _broken_at(
    xs: list[float], ys: list[float], starts: list[float]
) -> tuple[list[float], list[float]]:
    """The points with a gap (NaN, where matplotlib lifts the pen) before the first one of
    each later attempt (``starts``: their x): by wall time, a line drawn across the time
    between a stop and its resume -- no training, minutes or days -- looked like training
    with a flat loss."""
    out_x: list[float] = []
    out_y: list[float] = []
    pending = sorted(starts)
    for x, y in zip(xs, ys):
        while pending and x >= pending[0]:
            if out_x:
                out_x.append(pending[0])
                out_y.append(math.nan)
            pending.pop(0)
        out_x.append(x)
        out_y.append(y)
    return out_x, out_y


def _lone(ys: list[float], k: int) -> bool:
    """Whether point ``k`` has no neighbour on its line (NaN or the end on either side)."""
    return not math.isnan(ys[k]) and all(
        j < 0 or j >= len(ys) or math.isnan(ys[j]) for j in (k - 1, k + 1)
    )


def _left_out(notes: list[str], title: str, run: Run, why: str) -> None:
    notes.append(f"{title}: left out {run.label} ({why})")


# -- loss ------------------------------------------------------------------------------------


def _by_step(record: Record) -> float | None:
    step = record.get("step")
    return float(step) if isinstance(step, int) else None


def _wall_clock(run: Run, scale: float) -> Callable[[Record], float | None]:
    origin = run.first_time or 0.0

    def at(record: Record) -> float | None:
        t = record.get("time")
        return (float(t) - origin) / scale if isinstance(t, (int, float)) else None

    return at


def _time_scale(runs: list[Run]) -> tuple[float, str]:
    span = max(
        (max((r.get("time") or 0.0) for r in run.records) - (run.first_time or 0.0)) for run in runs
    )
    if span > 2 * 3600:
        return 3600.0, "wall time (h)"
    if span > 300:
        return 60.0, "wall time (min)"
    return 1.0, "wall time (s)"


def _mark_events(
    ax: Axes, runs: list[Run], x_of: Callable[[Run], Callable[[Record], float | None]]
) -> None:
    """Checkpoints, restarts / resumes, membership changes and rollbacks as vertical lines,
    skipped steps as crosses at the bottom: each kind labelled once."""
    labelled: set[str] = set()

    def label(text: str) -> str:
        if text in labelled:
            return "_"
        labelled.add(text)
        return text

    lines = (  # event names, their line's style and label
        (("checkpoint",), dict(color="0.55", ls=":", lw=1), "checkpoint"),
        (("resumed", "restart"), dict(color="tab:red", ls="--", lw=1.2), "restart / resume"),
        (("membership",), dict(color="tab:orange", ls="--", lw=1.2), "membership"),  # in place
        (("rollback",), dict(color="tab:purple", ls="-.", lw=1.2), "rollback"),
    )
    for run in runs:
        x = x_of(run)
        for names, style, text in lines:
            records = run.events(*names)
            if len(names) > 1:  # a resume and a restart at one step are one line
                records = list({r["step"]: r for r in records}.values())
            for record in records:
                if (at := x(record)) is not None:
                    ax.axvline(at, label=label(text), **style)  # type: ignore[arg-type]
        skipped = [a for a in (x(r) for r in run.events("step_skipped")) if a is not None]
        if skipped:
            ax.plot(
                skipped,
                [0.03] * len(skipped),
                "x",
                color="black",
                transform=ax.get_xaxis_transform(),
                label=label("skipped step"),
            )


def _data_lines(ax: Axes) -> list[Line2D]:
    """The series (in data coordinates), not the event lines drawn across the axes."""
    return [line for line in ax.get_lines() if line.get_transform() == ax.transData]


def _xy(line: Line2D) -> tuple[list[float], list[float]]:
    xs: Any = line.get_xdata()  # what the series was drawn from: numbers (matplotlib's
    ys: Any = line.get_ydata()  # types allow strings and arrays of any kind)
    return [float(x) for x in xs], [float(y) for y in ys]


def _pad_y(ax: Axes, from_zero: bool) -> None:
    """A y-range with room above (and, unless it starts at zero, below) the data: matplotlib's
    own put a near-constant series exactly on the top spine once the bottom was set to zero
    (the default job's bytes per step, its throughput and shares looked empty)."""
    ys = [y for line in _data_lines(ax) for y in _xy(line)[1] if math.isfinite(y)]
    if not ys:
        return
    low, high = (min(0.0, min(ys)) if from_zero else min(ys)), max(ys)
    pad = 0.08 * ((high - low) or abs(high) or 1.0)
    ax.set_ylim(low if from_zero else low - pad, high + pad)


MARKERS = ("o", "s", "^", "D")


def _show_identical(ax: Axes) -> str:
    """Each series equal to one drawn before it, point for point, restyled (dashed or dotted,
    with markers placed apart from the other copies', so that the first shows through) and
    named: drawn plainly, it hid the first completely. The words, for the legend's title."""
    lines, said = _data_lines(ax), list[str]()
    for j, line in enumerate(lines):
        xs, ys = _xy(line)
        twin = next((o for o in lines[:j] if _xy(o) == (xs, ys)), None)
        if twin is None or not xs:
            continue
        copy, every = len(said), max(1, len(xs) // 12)
        line.set_linestyle((0, (6, 4)) if copy % 2 == 0 else (0, (1, 3)))
        line.set_marker(MARKERS[copy % len(MARKERS)])
        line.set_markersize(4)
        line.set_markevery((copy * max(1, every // 4) % every, every))
        said.append(f"{line.get_label()} identical to {twin.get_label()} (drawn over it)")
    return "\n".join(said)


def _done(
    drawn: tuple[Figure, Axes],
    name: str,
    title: str,
    ylabel: str = "",
    heading: str = "",
    from_zero: bool = False,
    xlabel: str = "step",
) -> Plot | None:
    """The figure ``drawn`` on labelled, titled (``heading``, else ``title``) and with its
    legend, as the plot ``name``; None where no series was drawn on it."""
    fig, ax = drawn
    if not ax.get_lines():
        return None
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    identical = _show_identical(ax)
    _pad_y(ax, from_zero)
    ax.set_title(heading or title)
    # The words on equal series head the legend, which finds room for them with it.
    ax.legend(fontsize="small", title=identical or None, title_fontsize="small")
    return Plot(name, title, fig)


def plot_loss(runs: list[Run], notes: list[str], by: str = "step") -> Plot | None:
    """Training and validation loss against the step (``by="step"``) or the wall time."""
    title = "loss by step" if by == "step" else "loss by wall time"
    fig, ax = _figure()
    scale, xlabel = _time_scale(runs) if by == "time" else (1.0, "step")

    def x_of(run: Run) -> Callable[[Record], float | None]:
        return _by_step if by == "step" else _wall_clock(run, scale)

    several = len(runs) > 1
    for i, run in enumerate(runs):
        prefix = f"{run.label}: " if several else ""
        xs, ys = _points(run.of("train"), x_of(run), "loss")
        if not xs:
            _left_out(notes, title, run, "no train records with a loss")
            continue
        starts = [x for x in map(x_of(run), run.of("start")[1:]) if x is not None]
        if by == "time":  # by step a resume goes on where the run stopped: no gap to show
            xs, ys = _broken_at(xs, ys, starts)
        ax.plot(xs, ys, color=_color(i), lw=1.5, label=f"{prefix}train loss")
        vx, vy = _points(run.of("eval"), x_of(run), "val_loss")
        if by == "time":
            vx, vy = _broken_at(vx, vy, starts)
        if vx:
            ax.plot(vx, vy, "o--", color=_color(i), ms=4, lw=1, label=f"{prefix}val loss")
        # An attempt of one train record is a point, which a line alone does not draw.
        if lone := [k for k in range(len(xs)) if _lone(ys, k)]:
            ax.plot([xs[k] for k in lone], [ys[k] for k in lone], "o", color=_color(i), ms=3)
    if ax.get_lines():
        _mark_events(ax, runs, x_of)
    name = "loss_by_step" if by == "step" else "loss_by_time"
    return _done((fig, ax), name, title, "loss", xlabel=xlabel)


# -- throughput, communication ---------------------------------------------------------------


def _train_lines(
    runs: list[Run],
    notes: list[str],
    title: str,
    field: str,
    single: str,
    divisor: float = 1.0,
    why: Callable[[Run], str] | None = None,
) -> tuple[Figure, Axes]:
    """Each run's train records' ``field`` (divided by ``divisor``) by step, labelled
    ``single`` when there is one run; a run without it left out (``why``: in what words)."""
    fig, ax = _figure()
    for i, run in enumerate(runs):
        xs, ys = _points(run.of("train"), _by_step, field)
        if not xs:
            _left_out(notes, title, run, why(run) if why else f"its train records have no {field}")
            continue
        label = run.label if len(runs) > 1 else single
        ax.plot(xs, [y / divisor for y in ys], color=_color(i), lw=1.5, label=label)
    return fig, ax


def plot_throughput(runs: list[Run], notes: list[str]) -> Plot | None:
    """Items per second: the task's items when every run counts the same ones, else samples."""
    title = "throughput"
    items = {run.item_name for run in runs}
    item = items.pop() if len(items) == 1 else "samples"
    drawn = _train_lines(runs, notes, title, f"{item}_per_s", item)
    heading = f"{title} ({item} per second, whole job)"
    return _done(drawn, "throughput", title, f"{item} / s", heading, from_zero=True)


def _uncounted(run: Run) -> str:
    """Why a run has no bytes communicated (a null field: its strategy does not count them)."""
    trains = run.of("train")
    if trains and all(
        "comm_bytes_per_step" in r and r["comm_bytes_per_step"] is None for r in trains
    ):
        strategy = next((r.get("strategy") for r in run.of("start")), None)
        named = f" ({strategy})" if strategy else ""
        return f"its strategy{named} does not count its traffic"
    return "no comm_bytes_per_step"


def plot_comm(runs: list[Run], notes: list[str]) -> Plot | None:
    """Bytes each rank sends per step (rank 0's count)."""
    title = "bytes communicated"
    drawn = _train_lines(runs, notes, title, "comm_bytes_per_step", "rank 0", 1e6, _uncounted)
    heading = f"{title} (per step, by one rank)"
    return _done(drawn, "comm", title, "MB sent per step", heading, from_zero=True)


# -- per rank --------------------------------------------------------------------------------


def _rank_records(run: Run, notes: list[str], title: str) -> list[Record]:
    records = run.of("ranks")
    if not records:
        _left_out(notes, title, run, "no per-rank records")
    return records


def phase_means(records: list[Record]) -> dict[str, list[float]]:
    """Each phase's mean time per step for every rank, over all the windows (weighted by
    their steps); ranks as in the newest record."""
    ranks = len(records[-1].get("step_s") or [])
    sums = {field: [0.0] * ranks for field, _ in PHASES}
    steps = [0.0] * ranks
    for record in records:
        n = float(record.get("steps") or 0)
        values = {field: record.get(field) or [] for field, _ in PHASES}
        if any(len(v) != ranks for v in values.values()):
            continue  # another world size (an elastic restart): not comparable
        for rank in range(ranks):
            if all(values[f][rank] is not None for f, _ in PHASES):
                for field, _ in PHASES:
                    sums[field][rank] += values[field][rank] * n
                steps[rank] += n
    return {f: [s / n if n else 0.0 for s, n in zip(sums[f], steps)] for f, _ in PHASES}


def plot_time_breakdown(runs: list[Run], notes: list[str]) -> Plot | None:
    """Every rank's mean step, stacked by phase: a slow rank's extra time shows in data or
    compute, the others' waiting for it in comm wait."""
    title = "time per step by rank"
    labels: list[str] = []
    stacks: list[dict[str, float]] = []
    for run in runs:
        records = _rank_records(run, notes, title)
        if not records:
            continue
        means = phase_means(records)
        for rank in range(len(means[PHASES[0][0]])):
            labels.append(f"{run.label}\nrank {rank}" if len(runs) > 1 else f"rank {rank}")
            stacks.append({field: means[field][rank] * 1e3 for field, _ in PHASES})
    if not stacks:
        return None
    fig, ax = _figure()
    bottom = [0.0] * len(stacks)
    positions = list(range(len(stacks)))
    for j, (field, name) in enumerate(PHASES):
        heights = [s[field] for s in stacks]
        ax.bar(positions, heights, bottom=bottom, color=_color(j), label=name, width=0.6)
        bottom = [b + h for b, h in zip(bottom, heights)]
    ax.set_xticks(positions, labels, fontsize="small")
    ax.set_ylabel("ms per step (mean)")
    ax.set_title(title)
    ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.0, 1.0))
    return Plot("time_breakdown", title, fig)


def _per_rank_lines(
    runs: list[Run],
    notes: list[str],
    title: str,
    field: str,
    factor: float,
) -> tuple[Figure, Axes]:
    fig, ax = _figure()
    for i, run in enumerate(runs):
        records = _rank_records(run, notes, title)
        if not records:
            continue
        if not any(record.get(field) for record in records):
            _left_out(notes, title, run, f"its per-rank records have no {field}")
            continue
        ranks = max(len(record.get(field) or []) for record in records)
        for rank in range(ranks):
            xs, ys = [], []
            for record in records:
                values = record.get(field) or []
                if rank < len(values) and values[rank] is not None:
                    xs.append(record["step"])
                    ys.append(values[rank] * factor)
            prefix = f"{run.label}: " if len(runs) > 1 else ""
            color, style = (_color(rank), STYLES[i % len(STYLES)])
            ax.plot(xs, ys, style, color=color, lw=1.5, label=f"{prefix}rank {rank}")
    return fig, ax


def plot_shares(runs: list[Run], notes: list[str]) -> Plot | None:
    """Each rank's share of the global batch over time (moves under balance.mode)."""
    title = "batch share by rank"
    drawn = _per_rank_lines(runs, notes, title, "share", 100.0)
    return _done(drawn, "shares", title, "% of the global batch's samples", from_zero=True)


def plot_memory(runs: list[Run], notes: list[str]) -> Plot | None:
    """Each rank's memory (RssAnon on CPU, the peak allocated on CUDA)."""
    title = "memory by rank"
    drawn = _per_rank_lines(runs, notes, title, "memory_bytes", 1e-6)
    kinds = {r.get("memory_kind") for run in runs for r in run.of("start")} - {None}
    what = {"rss_anon": "RssAnon", "cuda_max_allocated": "CUDA max allocated"}
    ylabel = "MB" + (f" ({', '.join(what.get(str(k), str(k)) for k in kinds)})")
    # From zero: a few percent of growth must not look like a leak.
    return _done(drawn, "memory", title, ylabel, from_zero=True)


def plot_val_metrics(runs: list[Run], notes: list[str]) -> Plot | None:
    """The task's evaluation metrics (``Task.metrics``: the eval records' ``val_<name>``
    fields beside the loss) against the step; None when no run has any."""
    title = "validation metrics"
    fig, ax = _figure()
    several = len(runs) > 1
    for i, run in enumerate(runs):
        names = dict.fromkeys(name for record in run.of("eval") for name in val_metrics(record))
        for j, name in enumerate(names):
            xs, ys = _points(run.of("eval"), _by_step, f"val_{name}")
            if xs:
                label = (f"{run.label}: " if several else "") + name
                ax.plot(xs, ys, "o-", color=_color(i + j), ms=4, lw=1.5, label=label)
    return _done((fig, ax), "val_metrics", title)


ALL: tuple[Callable[[list[Run], list[str]], Plot | None], ...] = (
    plot_loss,
    lambda runs, notes: plot_loss(runs, notes, by="time"),
    plot_val_metrics,
    plot_throughput,
    plot_time_breakdown,
    plot_shares,
    plot_comm,
    plot_memory,
)


def make_plots(runs: list[Run], notes: list[str]) -> list[Plot]:
    """Every plot that at least one run has data for."""
    return [p for plot in ALL if (p := plot(runs, notes)) is not None]
