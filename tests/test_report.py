"""`dtrain report` on a small real run: PNGs of the expected size and series, a self-contained
HTML page whose images all decode (and that Chromium renders, not blank), a metrics file cut
mid-line, several runs overlaid, runs with metrics the others lack, and bad input; plus the
metrics stream itself: every field a run writes is in docs/metrics.md, events, the progress
line's slowest rank, TensorBoard."""

from __future__ import annotations

import base64
import importlib.util
import json
import re
import shutil
import subprocess
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import pytest

from dtrain.cli import main
from dtrain.metrics.sinks import JsonlSink, Progress
from dtrain.report import write_report
from dtrain.report.plots import SIZE_PX, make_plots
from dtrain.report.read import read_runs
from dtrain.report.totals import format_totals, totals
from tests.conftest import REPO, tiny_raw
from tests.dist_helpers import train_with_nan
from tests.ranks import run_ranks
from tests.report_helpers import legend_labels, png_size, records_of

pytest.importorskip("matplotlib", reason="dtrain report needs matplotlib (the dev extra has it)")

PLOTS = {"loss_by_step", "loss_by_time", "throughput", "time_breakdown", "shares", "comm", "memory"}


class Images(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.sources: list[str] = []
        self.links: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        values = dict(attrs)
        if tag == "img":
            self.sources.append(values.get("src") or "")
        for name in ("href", "src"):
            if values.get(name) and not str(values[name]).startswith("data:"):
                self.links.append(str(values[name]))


def page_images(page: Path) -> list[bytes]:
    """Every <img> of the page, decoded; the page links to nothing outside itself."""
    parser = Images()
    parser.feed(page.read_text())
    assert parser.links == []
    images = []
    for src in parser.sources:
        head, _, data = src.partition(",")
        assert head == "data:image/png;base64", src[:40]
        images.append(base64.b64decode(data, validate=True))
    return images


def copy_run(source: Path, dest: Path) -> Path:
    dest.mkdir(parents=True)
    for name in ("metrics.jsonl", "config.toml"):
        shutil.copy(source / name, dest / name)
    return dest


# -- the report on a real run ----------------------------------------------------------------


def test_report_writes_pngs_of_the_expected_size_and_series(
    observed_run: Path, tmp_path: Path
) -> None:
    page = write_report([observed_run], tmp_path / "out")
    assert page == tmp_path / "out" / "report.html"
    pngs = {p.stem: p.read_bytes() for p in (tmp_path / "out").glob("*.png")}
    assert set(pngs) == PLOTS
    for data in pngs.values():
        assert png_size(data) == SIZE_PX
    notes: list[str] = []
    plots = {p.name: p for p in make_plots(read_runs([observed_run]), notes)}
    assert notes == []
    # 12 steps: train records every 2, evaluations and checkpoints every 6 (and the final
    # checkpoint at 12), per-rank records every 3, on 2 ranks.
    assert legend_labels(plots["loss_by_step"]) == ["train loss", "val loss", "checkpoint"]
    axes = plots["loss_by_step"].figure.axes[0]
    train_line, val_line = axes.get_lines()[:2]
    assert list(train_line.get_xdata()) == [2, 4, 6, 8, 10, 12]
    assert list(val_line.get_xdata()) == [6, 12]
    assert len([x for x in axes.get_lines() if x.get_label() in ("checkpoint", "_")]) == 2
    assert legend_labels(plots["loss_by_time"]) == ["train loss", "val loss", "checkpoint"]
    assert legend_labels(plots["throughput"]) == ["tokens"]
    assert legend_labels(plots["comm"]) == ["rank 0"]
    bars = plots["time_breakdown"].figure.axes[0].containers
    assert [len(b) for b in bars] == [2, 2, 2, 2]  # 4 phases stacked, one bar per rank
    assert legend_labels(plots["time_breakdown"]) == [
        "data wait",
        "compute",
        "comm wait",
        "optimizer",
    ]
    for name in ("shares", "memory"):
        assert legend_labels(plots[name]) == ["rank 0", "rank 1"]
        lines = plots[name].figure.axes[0].get_lines()
        assert [list(line.get_xdata()) for line in lines] == [[3, 6, 9, 12]] * 2
    shares = [list(line.get_ydata()) for line in plots["shares"].figure.axes[0].get_lines()]
    assert shares == [[50.0] * 4] * 2  # percent of the global batch


def test_the_html_page_is_self_contained_and_every_image_decodes(
    observed_run: Path, tmp_path: Path
) -> None:
    page = write_report([observed_run], tmp_path / "out")
    images = page_images(page)
    assert len(images) == len(PLOTS)
    assert all(png_size(image) == SIZE_PX for image in images)
    text = page.read_text()
    for shown in ("Totals", "tokens seen", "GB sent (rank 0)", "config.toml", "ddp"):
        assert shown in text
    assert 'task = "tests.tasks:tiny_gpt"' in text.replace("&quot;", '"')  # the config


def chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.mark.skipif(
    chromium() is None,
    reason="chromium is not installed (make test installs Debian's chromium package when it "
    "runs as root with apt-get; else: apt-get install chromium)",
)
def test_chromium_renders_the_page_not_blank(observed_run: Path, tmp_path: Path) -> None:
    from matplotlib.image import imread

    page = write_report([observed_run], tmp_path / "out")
    shot = tmp_path / "shot.png"
    result = subprocess.run(
        [
            str(chromium()),
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-quic",
            "--no-first-run",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            f"--user-data-dir={tmp_path / 'profile'}",
            f"--screenshot={shot}",
            "--window-size=1200,2000",
            page.resolve().as_uri(),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert shot.exists(), result.stderr[-2000:]
    pixels = imread(shot)  # (height, width, channels), floats in [0, 1]
    assert pixels.shape[:2] == (2000, 1200)
    rgb = (pixels[..., :3] * 255).round().astype("uint8").reshape(-1, 3)
    not_white = (rgb < 250).any(axis=1).mean()
    colours = len({tuple(c) for c in rgb[::7].tolist()})
    # The page's text, tables and at least two plots: a blank or broken page is ~all white.
    assert not_white > 0.05 and colours > 50, (not_white, colours)


# -- reading what a crash leaves -------------------------------------------------------------


def test_a_metrics_file_cut_mid_line_still_reports(
    observed_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = copy_run(observed_run, tmp_path / "cut")
    data = (run / "metrics.jsonl").read_bytes()
    (run / "metrics.jsonl").write_bytes(data[: len(data) - 40])  # inside the summary line
    lines = data.count(b"\n")
    assert main(["report", str(run)]) == 0
    err = capsys.readouterr().err
    assert f"the last line ({lines}) is cut off" in err and "skipped it" in err
    page = run / "report" / "report.html"
    assert len(page_images(page)) == len(PLOTS)
    assert "is cut off" in page.read_text()


def test_a_run_appending_after_a_cut_line_starts_a_line_of_its_own(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"kind": "train", "step": 2, "loss": 1.0, "time": 1.0}\n{"kind": "tra')
    sink = JsonlSink(path)
    sink.write({"kind": "train", "step": 4, "loss": 0.5, "time": 2.0})
    sink.close()
    (run,) = read_runs([tmp_path])
    assert [r["step"] for r in run.records] == [2, 4]
    assert run.skipped == [f"{path}: line 2 is not a JSON record; skipped it"]


# -- several runs ----------------------------------------------------------------------------


def test_two_runs_overlay_their_curves(observed_run: Path, tmp_path: Path) -> None:
    a = copy_run(observed_run, tmp_path / "plain")
    b = copy_run(observed_run, tmp_path / "powersgd")
    records = records_of(b)
    for record in records:
        if record["kind"] == "train":
            record["loss"] *= 0.9
            record["comm_bytes_per_step"] /= 8
    (b / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    notes: list[str] = []
    plots = {p.name: p for p in make_plots(read_runs([a, b]), notes)}
    assert notes == []
    assert legend_labels(plots["loss_by_step"]) == [
        "plain: train loss",
        "plain: val loss",
        "powersgd: train loss",
        "powersgd: val loss",
        "checkpoint",
    ]
    comm = plots["comm"].figure.axes[0].get_lines()
    assert [line.get_label() for line in comm] == ["plain", "powersgd"]
    assert comm[0].get_ydata()[-1] == pytest.approx(8 * comm[1].get_ydata()[-1])
    assert len(plots["time_breakdown"].figure.axes[0].containers[0]) == 4  # 2 runs x 2 ranks
    assert legend_labels(plots["shares"]) == [
        "plain: rank 0",
        "plain: rank 1",
        "powersgd: rank 0",
        "powersgd: rank 1",
    ]
    page = write_report([a, b], tmp_path / "compare")
    assert "plain" in page.read_text() and "powersgd" in page.read_text()


def test_every_line_shows_equal_ones_are_named_and_sizes_start_at_zero(
    observed_run: Path, tmp_path: Path
) -> None:
    # The default job's bytes per step and its 50/50 shares are constant: drawn on the top
    # spine they looked empty; rank 1's share hid rank 0's; memory from 323 MB up made 9% of
    # growth look like a leak; a resumed run bit-identical to another vanished under it.
    plots = {p.name: p for p in make_plots(read_runs([observed_run]), [])}
    for name in ("comm", "shares", "memory", "throughput"):
        axes = plots[name].figure.axes[0]
        top = max(max(line.get_ydata()) for line in axes.get_lines())
        assert axes.get_ylim()[0] == 0 and axes.get_ylim()[1] >= 1.05 * top, name
    shares = plots["shares"].figure.axes[0]
    rank0, rank1 = shares.get_lines()
    assert list(rank0.get_ydata()) == list(rank1.get_ydata())
    assert rank0.get_linestyle() == "-" and rank1.get_linestyle() not in ("-", "solid")
    assert rank1.get_marker() == "o" and rank0.get_marker() in ("None", "", None)
    said = shares.get_legend().get_title().get_text()
    assert said == "rank 1 identical to rank 0 (drawn over it)"
    # Nothing equal: nothing said.
    assert not plots["loss_by_step"].figure.axes[0].get_legend().get_title().get_text()
    # A loss is not a size: its range is the data's, padded both ways.
    loss = plots["loss_by_step"].figure.axes[0]
    losses = [y for line in loss.get_lines()[:2] for y in line.get_ydata()]
    assert loss.get_ylim()[0] < min(losses) and loss.get_ylim()[1] > max(losses)
    # Two runs, the second a bit-identical copy of the first (a resume that matched).
    a, b = copy_run(observed_run, tmp_path / "first"), copy_run(observed_run, tmp_path / "again")
    notes: list[str] = []
    overlaid = {p.name: p for p in make_plots(read_runs([a, b]), notes)}
    assert notes == []
    axes = overlaid["loss_by_step"].figure.axes[0]
    assert axes.get_legend().get_title().get_text() == (
        "again: train loss identical to first: train loss (drawn over it)\n"
        "again: val loss identical to first: val loss (drawn over it)"
    )
    styles = {line.get_label(): (line.get_linestyle(), line.get_marker()) for line in axes.lines}
    assert styles["first: train loss"] != styles["again: train loss"]
    assert styles["first: val loss"] != styles["again: val loss"]


def test_the_report_sends_the_bytes_the_console_said(tmp_path: Path) -> None:
    # The console's figure is the strategy's own count (the summary record's); the page summed
    # the train records' per-step figures, which leave out the warm-up all-reduce before the
    # first step: 3.944 GB on the page, 3.950 GB on the console for the default job.
    run = tmp_path / "run"
    run.mkdir()
    lines = [
        {"kind": "start", "step": 0, "time": 1.0},
        {"kind": "train", "step": 2, "comm_bytes_per_step": 1e6, "time": 2.0},
        {"kind": "train", "step": 4, "comm_bytes_per_step": 1e6, "time": 3.0},
        {"kind": "summary", "state": "preempted", "step": 4, "comm_bytes": 5e6, "wall_s": 2.0},
        {"kind": "start", "step": 4, "time": 4.0},  # resumed, then killed: no summary
        {"kind": "train", "step": 6, "comm_bytes_per_step": 1e6, "time": 5.0},
    ]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    counted = totals(read_runs([run])[0])
    assert counted["comm_bytes"] == 5e6 + 2e6  # the first attempt's count, the second's steps
    assert format_totals(counted)["GB sent (rank 0)"] == "0.007"


def test_runs_with_metrics_the_others_lack_plot_what_they_share(
    observed_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # An fsdp run from before per-rank records, counting samples: no bytes, no ranks, no memory.
    old = tmp_path / "old-fsdp"
    old.mkdir()
    lines = [{"kind": "start", "step": 0, "strategy": "fsdp", "item_name": "samples", "time": 0}]
    for step in (2, 4, 6):
        lines.append(
            {
                "kind": "train",
                "step": step,
                "loss": 5.0 - step / 10,
                "samples_per_s": 100.0 + step,
                "comm_bytes_per_step": None,
                "time": float(step),
            }
        )
    (old / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    assert main(["report", str(observed_run), str(old), "--out", str(tmp_path / "r")]) == 0
    err = capsys.readouterr().err
    left_out = [
        "bytes communicated: left out old-fsdp (its strategy (fsdp) does not count its traffic)",
        "time per step by rank: left out old-fsdp (no per-rank records)",
        "batch share by rank: left out old-fsdp (no per-rank records)",
        "memory by rank: left out old-fsdp (no per-rank records)",
    ]
    for line in left_out:
        assert f"dtrain report: {line}" in err
    notes: list[str] = []
    plots = {p.name: p for p in make_plots(read_runs([observed_run, old]), notes)}
    # Throughput in what both count (samples; the GPT run counts tokens too).
    throughput = plots["throughput"].figure.axes[0]
    assert [line.get_label() for line in throughput.get_lines()] == ["run", "old-fsdp"]
    assert throughput.get_ylabel() == "samples / s"
    assert legend_labels(plots["comm"]) == ["run"]
    assert legend_labels(plots["loss_by_step"])[:3] == [
        "run: train loss",
        "run: val loss",
        "old-fsdp: train loss",
    ]


# -- bad input -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("setup", "message"),
    [
        (lambda d: None, "does not exist"),
        (lambda d: d.mkdir(), "has no metrics.jsonl: not a run folder"),
        (
            lambda d: (d.mkdir(), (d / "metrics.jsonl").write_text('{"kind": "tr')),
            "holds no metrics records (",
        ),
    ],
)
def test_a_folder_without_metrics_is_one_line_and_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], setup: Any, message: str
) -> None:
    run = tmp_path / "run"
    setup(run)
    assert main(["report", str(run)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("dtrain: error: ") and err.count("\n") == 1
    assert message in err


def test_missing_matplotlib_names_the_extra(
    observed_run: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "matplotlib" else find_spec(name, *a),
    )
    assert main(["report", str(observed_run)]) == 2
    err = capsys.readouterr().err
    needs = "dtrain report needs matplotlib: pip install -e '.[report]' in dtrain's clone"
    assert err == f"dtrain: error: {needs}\n"


def test_missing_tensorboard_is_one_line_before_launch(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "tensorboard" else find_spec(name, *a),
    )
    assert main(["train", "--metrics.tensorboard=true", "--nproc", "1"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert "metrics.tensorboard = true needs the tensorboard package: pip install" in err


# -- the stream ------------------------------------------------------------------------------


def documented_fields(doc: str) -> dict[str, set[str]]:
    """kind (or ``event:<name>``) -> the fields docs/metrics.md lists for it."""
    out: dict[str, set[str]] = {}
    section = ""
    for line in doc.splitlines():
        heading = re.match(r"^(##+) `([a-z_]+)`", line)
        if heading:
            level, name = heading.groups()
            section = name if level == "##" else f"event:{name}"
            out.setdefault(section, set())
        elif section and line.startswith("| `"):
            out[section] |= set(re.findall(r"`([^`]+)`", line.split("|")[1]))
    return out


def assert_documented(records: list[dict[str, Any]]) -> None:
    doc = documented_fields((REPO / "docs" / "metrics.md").read_text())
    for record in records:
        kind = record["kind"]
        assert kind in doc, f"kind {kind!r} is not in docs/metrics.md"
        allowed = set(doc[kind])
        if kind == "event":
            assert f"event:{record['name']}" in doc, f"event {record['name']!r} is not documented"
            allowed |= doc[f"event:{record['name']}"]
        for field in record:
            shown = "<items>_per_s" if field == "tokens_per_s" else field
            if kind == "eval" and field.startswith("val_") and field not in allowed:
                shown = "val_<name>"  # a metric of the task's own (Task.metrics)
            assert shown in allowed, f"{kind}.{field} is not in docs/metrics.md"


def test_every_field_a_run_writes_is_documented(observed_run: Path) -> None:
    records = records_of(observed_run)
    kinds = [r["kind"] for r in records]
    assert kinds[0] == "start" and kinds[-1] == "summary"
    assert {"train", "eval", "ranks", "event"} <= set(kinds)
    assert_documented(records)
    start = records[0]
    assert start["hosts"] and start["world_size"] == 2 and start["item_name"] == "tokens"
    assert start["memory_kind"] == "rss_anon" and start["hardware"]["cpu_cores"] >= 1
    for record in [r for r in records if r["kind"] == "ranks"]:
        assert all(m is not None and m > 10e6 for m in record["memory_bytes"])
    train = [r for r in records if r["kind"] == "train"]
    # 8 samples per step of 16 tokens (the tiny GPT's sequence).
    assert all(r["tokens_per_s"] == pytest.approx(16 * r["samples_per_s"]) for r in train)
    saved = [r for r in records if r.get("name") == "checkpoint"]
    assert [r["step"] for r in saved] == [6, 12]
    assert all(r["blocked_s"] >= 0 for r in saved)


def test_events_skip_rollback_resume_and_restart(tmp_path: Path) -> None:
    # Steps 6 and 7 (stream positions 40 and 48) are NaN: two skips, then a rollback to the
    # checkpoint of step 4 (fault.nan_rollback_after = 2); then a restart that resumes.
    job = {
        "train": {"steps": 10, "log_every": 2},
        "checkpoint": {"every": 4, "async_save": False},
        "fault": {"nan_rollback_after": 2},
    }
    raw = tiny_raw(tmp_path, job)
    run_ranks(train_with_nan, 1, raw, [40, 48], 0)
    raw["train"]["steps"] = 12
    run_ranks(train_with_nan, 1, raw, [], 0, env={"TORCHELASTIC_RESTART_COUNT": "1"})
    records = records_of(tmp_path)
    assert_documented(records)
    events = [(r["name"], r["step"]) for r in records if r["kind"] == "event"]
    assert events == [
        ("first_step", 1),
        ("checkpoint", 4),
        ("step_skipped", 6),
        ("step_skipped", 7),
        ("rollback", 4),
        ("checkpoint", 4),  # the rollback lands on a checkpoint step, and saves it again
        ("checkpoint", 8),
        ("checkpoint", 10),
        ("restart", 10),
        ("resumed", 10),
        ("first_step", 11),
        ("checkpoint", 12),
    ]
    rollback = next(r for r in records if r.get("name") == "rollback")
    assert rollback["from_step"] == 7 and rollback["checkpoint"] == "step-00000004"
    starts = [r for r in records if r["kind"] == "start"]
    assert [(s["step"], s["attempt"]) for s in starts] == [(0, 0), (10, 1)]
    notes: list[str] = []
    (run,) = read_runs([tmp_path])
    plots = {p.name: p for p in make_plots([run], notes)}
    assert legend_labels(plots["loss_by_step"]) == [
        "train loss",
        "val loss",
        "checkpoint",
        "restart / resume",
        "rollback",
        "skipped step",
    ]


def test_the_progress_line_names_the_slowest_rank(capsys: pytest.CaptureFixture[str]) -> None:
    progress = Progress(100, 0, "tokens")
    progress.write({"kind": "ranks", "step": 10, "slowdown": [0.98, 2.04, None]})
    progress.write(
        {
            "kind": "train",
            "step": 10,
            "loss": 2.5,
            "tokens_per_s": 12000.0,
            "comm_bytes_per_step": 2e6,
        }
    )
    line = capsys.readouterr().err.strip()
    assert line.startswith("step 10/100  loss 2.5000  12.0k tokens/s  comm 2.0 MB/step")
    assert "slowest rank 1 2.04x" in line and "eta" in line


@pytest.mark.skipif(
    importlib.util.find_spec("tensorboard") is None,
    reason="tensorboard is not installed (pip install -e '.[tensorboard]' in dtrain's clone)",
)
def test_tensorboard_event_files_hold_the_records(observed_run: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (folder,) = {p.parent for p in (observed_run / "tensorboard").rglob("events.out.*")}
    events = EventAccumulator(str(folder))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"train/loss", "train/tokens_per_s", "eval/val_loss"} <= tags
    assert {"ranks/compute_s/rank0", "ranks/share/rank1", "ranks/memory_bytes/rank1"} <= tags
    assert [e.step for e in events.Scalars("train/loss")] == [2, 4, 6, 8, 10, 12]
    loss = [r["loss"] for r in records_of(observed_run) if r["kind"] == "train"]
    assert [e.value for e in events.Scalars("train/loss")] == pytest.approx(loss, rel=1e-6)


def test_by_wall_time_a_resume_after_a_pause_is_a_gap_not_a_flat_line(tmp_path: Path) -> None:
    # Stopped at step 4 (t = 4 s), resumed an hour later for 4 steps, then once more for one
    # step: the train and val lines were drawn straight across each pause, as if the run had
    # trained on with a flat loss; a one-record attempt was not drawn at all.
    run = tmp_path / "paused"
    run.mkdir()
    lines: list[dict[str, Any]] = []
    for start, steps in ((0.0, (2, 4)), (3600.0, (6, 8)), (7200.0, (9,))):
        lines.append({"kind": "start", "step": steps[0] - 2, "time": start})
        for step in steps:
            at = start + step
            lines.append({"kind": "train", "step": step, "loss": 5.0 - step / 10, "time": at})
            lines.append({"kind": "eval", "step": step, "val_loss": 4.0, "time": at})
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    plots = {p.name: p for p in make_plots(read_runs([run]), [])}
    train, val, lone = plots["loss_by_time"].figure.axes[0].get_lines()[:3]
    for line in (train, val):
        gaps = [i for i, y in enumerate(line.get_ydata()) if y != y]  # NaN: the pen lifted
        assert len(gaps) == 2 and len(line.get_ydata()) == 7, list(line.get_ydata())
    # The last attempt's one point, drawn as a marker.
    assert list(lone.get_ydata()) == [5.0 - 0.9] and lone.get_marker() == "o"
    # By step, a resume goes on where it stopped: one unbroken line.
    by_step = plots["loss_by_step"].figure.axes[0].get_lines()[0]
    assert len(by_step.get_ydata()) == 5 and all(y == y for y in by_step.get_ydata())
