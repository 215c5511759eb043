"""``dtrain report`` and ``dtrain status``: reading run folders after (or while) they train.

matplotlib is needed only for the report (the ``report`` extra); ``status`` needs nothing more
than the run folder.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

from dtrain.errors import UserError
from dtrain.fsutil import require_output_folder
from dtrain.report.read import read_runs

REPORT_PAGE = "report.html"


def write_report(run_dirs: list[Path], out_dir: Path | None = None) -> Path:
    """PNG plots and ``report.html`` for the runs (overlaid when several) in ``out_dir``
    (default: ``RUN_DIR/report`` for one run, ``./report`` for several); returns the page.
    What was skipped or left out is printed on stderr and listed on the page."""
    if importlib.util.find_spec("matplotlib") is None:
        raise UserError(
            "dtrain report needs matplotlib: pip install -e '.[report]' in dtrain's clone"
        )
    from dtrain.report.page import render
    from dtrain.report.plots import make_plots

    runs = read_runs(run_dirs)
    out = out_dir or (run_dirs[0] / "report" if len(run_dirs) == 1 else Path("report"))
    require_output_folder(out, f"report folder {out}")
    notes = [line for run in runs for line in run.skipped]
    plots = make_plots(runs, notes)
    images = []
    for plot in plots:
        png = plot.png()
        (out / f"{plot.name}.png").write_bytes(png)
        images.append((plot.name, plot.title, png))
    page = out / REPORT_PAGE
    page.write_text(render(runs, images, notes))
    for note in notes:
        print(f"dtrain report: {note}", file=sys.stderr)
    return page
