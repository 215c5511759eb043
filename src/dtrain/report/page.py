"""The report's HTML page: one self-contained file (the plots embedded as base64 PNG data
URIs, no scripts, no external links) holding each run's totals, hardware and config, the
notes on what was left out, and the plots."""

from __future__ import annotations

import base64
import html
import time
from typing import Any

from dtrain.metrics.traces import TRACES_DIR, list_traces
from dtrain.report.read import Run
from dtrain.report.totals import format_totals, totals

STYLE = """
body { font: 14px/1.45 system-ui, sans-serif; margin: 2em auto; max-width: 1000px;
       color: #222; background: #fff; padding: 0 1em; }
h1 { font-size: 1.6em; margin-bottom: 0.2em; }
h2 { font-size: 1.25em; margin-top: 1.6em; border-bottom: 1px solid #ddd; }
table { border-collapse: collapse; margin: 0.5em 0; }
td, th { border: 1px solid #ccc; padding: 3px 8px; text-align: left; vertical-align: top; }
th { background: #f3f3f3; }
td.num { text-align: right; font-variant-numeric: tabular-nums; }
figure { margin: 1.2em 0; }
img { max-width: 100%; height: auto; border: 1px solid #eee; }
figcaption { color: #555; font-size: 0.9em; }
pre { background: #f7f7f7; padding: 0.6em; overflow-x: auto; font-size: 12px; }
.notes li { color: #8a5300; }
"""


def _e(value: Any) -> str:
    return html.escape(str(value))


def _totals_table(runs: list[Run]) -> str:
    rows = [format_totals(totals(run)) for run in runs]
    head = "".join(f"<th>{_e(run.label)}</th>" for run in runs)
    lines = [f"<table><tr><th></th>{head}</tr>"]
    keys = list(dict.fromkeys(key for row in rows for key in row))  # runs' own metrics too
    for key in keys:
        cells = "".join(f'<td class="num">{_e(row.get(key, "-"))}</td>' for row in rows)
        lines.append(f"<tr><th>{_e(key)}</th>{cells}</tr>")
    lines.append("</table>")
    return "\n".join(lines)


def hardware_rows(run: Run) -> list[tuple[str, str]]:
    """What the newest start record says the run ran on."""
    starts = run.of("start")
    if not starts:
        return [("hardware", "not recorded (a run from before start records)")]
    start = starts[-1]
    hw = start.get("hardware") or {}
    distinct = sorted(set(start.get("hosts") or []))
    return [
        ("strategy", str(start.get("strategy", "-"))),
        (
            "ranks",
            f"{start.get('world_size', '-')} ({start.get('data_parallel_size', '-')} "
            f"data-parallel) on {len(distinct)} host(s): {', '.join(distinct)}",
        ),
        ("device", str(hw.get("gpu") or hw.get("device", "-"))),
        ("CPU", f"{hw.get('cpu', '-')}, {hw.get('cpu_cores', '-')} cores"),
        ("memory", f"{hw.get('memory_gb', '-')} GB"),
        ("software", f"torch {hw.get('torch', '-')}, Python {hw.get('python', '-')}"),
        ("global batch", f"{start.get('global_batch_size', '-')} samples"),
        ("parameters", f"{(start.get('param_bytes_rank0') or 0) / 1e6:.1f} MB on rank 0"),
        ("attempts", str(len(starts))),
    ]


def _traces(run: Run) -> list[str]:
    """The run's profiler traces (``train.profile``), to open in https://ui.perfetto.dev."""
    traces = list_traces(run.path)
    if not traces:
        return []
    rows = [
        f"<tr><td>{_e(t.steps)}</td><td>{t.rank}</td><td>{_e(f'{TRACES_DIR}/{t.path.name}')}</td>"
        f'<td class="num">{t.size / 1e6:.1f} MB</td></tr>'
        for t in traces
    ]
    return [
        "<h3>Profiler traces</h3>",
        "<p>Open one in https://ui.perfetto.dev or chrome://tracing (docs/observability.md).</p>",
        "<table><tr><th>steps</th><th>rank</th><th>file</th><th>size</th></tr>",
        *rows,
        "</table>",
    ]


def render(runs: list[Run], images: list[tuple[str, str, bytes]], notes: list[str]) -> str:
    """The page: ``images`` are (file name, title, PNG bytes)."""
    labels = ", ".join(run.label for run in runs)
    parts = [
        "<!doctype html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f"<title>dtrain report: {_e(labels)}</title>",
        f"<style>{STYLE}</style></head><body>",
        "<h1>dtrain report</h1>",
        f"<p>{_e(labels)} &middot; written {_e(time.strftime('%Y-%m-%d %H:%M'))}</p>",
        "<h2>Totals</h2>",
        _totals_table(runs),
    ]
    if notes:
        parts.append('<h2>Notes</h2><ul class="notes">')
        parts += [f"<li>{_e(note)}</li>" for note in notes]
        parts.append("</ul>")
    parts.append("<h2>Plots</h2>")
    for name, title, png in images:
        data = base64.b64encode(png).decode("ascii")
        parts.append(
            f'<figure id="{_e(name)}"><img alt="{_e(title)}" src="data:image/png;base64,{data}">'
            f"<figcaption>{_e(title)} ({_e(name)}.png)</figcaption></figure>"
        )
    for run in runs:
        parts.append(f"<h2>Run {_e(run.label)}</h2>")
        parts.append(f"<p>{_e(run.path)}</p><table>")
        parts += [f"<tr><th>{_e(k)}</th><td>{_e(v)}</td></tr>" for k, v in hardware_rows(run)]
        parts.append("</table>")
        parts += _traces(run)
        config = run.config_text or "(no config.toml in the run folder)"
        parts.append(f"<details><summary>config.toml</summary><pre>{_e(config)}</pre></details>")
    parts.append("</body></html>")
    return "\n".join(parts) + "\n"
