"""Checkpoints in an object store against moving the same bytes plainly (issue 42's benchmark):

1. ``save``: dtrain's save into ``s3://`` -- ``torch.save`` and DCP streamed through fsspec as
   multipart uploads (parts sent while the next are written; a file of up to 100 MiB as one
   request, hashed while it goes out), each 64 MiB piece hashed, the marker object last
   (:class:`dtrain.checkpoint.write.Checkpointer`) -- against ``fs.put`` of the same files
   from a local folder (fsspec's plain upload, its own concurrency). Target: at most 1.2x.
2. ``resume``: dtrain's verified read -- every piece's SHA-256 checked against the marker as
   it is downloaded into a copy (:mod:`dtrain.checkpoint.copies`: in memory up to 256 MiB, else
   a local file), then each file loaded from that copy as data only
   (``torch.load(weights_only=True)``, DCP's reader with the allowlisted metadata) -- against
   ``fs.get`` of the same files to a local folder. Target: at most 1.2x.

The state is a model's state dict and an optimizer's moments (fp32), written two ways as the
strategies do: whole files (``model.pt`` + ``optimizer.pt``: ddp) and DCP's sharded state
(``dcp/``: fsdp), at two sizes (a few MB, about 100 MB). Rounds interleave dtrain and the plain
transfer, in alternating order; every round is printed, and the median of the per-round ratios
with its quartiles (on a busy machine single rounds scatter from 0.9x to 2.5x: the default of
31 rounds lets the median settle; with 15, the 12 MB medians moved by 0.1-0.35x between runs
minutes apart). Beside the times, exact where they are noise: what one more
save and resume of each asked of the store, untimed -- requests by kind, bytes each way (a
GET's as the store answered it: ``fs.get`` opens a large file whole and then reads it in
ranges, so its first answer counts more than it reads) and this process's CPU time
(:mod:`_s3_requests`).

The store is moto's S3 server (``moto[server]``), started by this script as its own process
on loopback; ``--swift`` takes the endpoint and test account ``scripts/s3.sh env`` prints (a
Swift started with ``scripts/s3.sh up``). Both stores keep objects on this machine: the figures
say what dtrain adds to the transfer, not what a remote store's link costs.

    python benchmarks/bench_s3_checkpoint.py                       # both sizes, 31 rounds
    python benchmarks/bench_s3_checkpoint.py --sizes-mb 4 --rounds 1   # a quick look
    python benchmarks/bench_s3_checkpoint.py --write-docs          # section in docs/benchmarks.md
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from statistics import median, quantiles
from typing import Any

from _report import ROOT, machine_line, update_section
from _s3_requests import Counter, Tally

sys.path.insert(0, str(ROOT / "src"))

BUCKET = "dtrain-bench"
KEY_ID = "DTRAINBENCHKEY0001"
SECRET = "dtrain-bench-secret-0001"


# ---------------------------------------------------------------------------------------------
# The store


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextmanager
def moto_store() -> Iterator[dict[str, str]]:
    """moto's S3 server in its own process (so the server's work is not charged to this
    process's interpreter); the environment that reaches it."""
    port = _free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline or server.poll() is not None:
                    raise SystemExit(
                        "moto's S3 server did not start (pip install 'moto[server]')"
                    ) from None
                time.sleep(0.2)
        yield {
            "AWS_ENDPOINT_URL_S3": f"http://127.0.0.1:{port}",
            "AWS_ACCESS_KEY_ID": KEY_ID,
            "AWS_SECRET_ACCESS_KEY": SECRET,
            "AWS_DEFAULT_REGION": "us-east-1",
        }
    finally:
        server.terminate()
        server.wait(timeout=30)


@contextmanager
def swift_store() -> Iterator[dict[str, str]]:
    """The Swift that ``scripts/s3.sh up`` started: its ``env`` (export lines)."""
    out = subprocess.run(
        ["bash", str(ROOT / "scripts" / "s3.sh"), "env"], capture_output=True, text=True
    )
    if out.returncode != 0:
        raise SystemExit(f"scripts/s3.sh env failed: {out.stderr.strip() or out.stdout.strip()}")
    env = {}
    for line in out.stdout.splitlines():
        name, _, value = line.removeprefix("export ").partition("=")
        if name.startswith("AWS_"):
            env[name] = value.strip("'\"")
    yield env


# ---------------------------------------------------------------------------------------------
# The state and the two ways of moving it


def make_state(mb: int) -> dict[str, Any]:
    """A model of about ``mb`` MB in fp32 (square layers) and its optimizer's two moments:
    about 3 x ``mb`` MB in all, as an AdamW checkpoint is."""
    import torch

    side = 1024
    n = max(1, round(mb * 2**20 / (side * side * 4)))  # layers
    generator = torch.Generator().manual_seed(0)
    model = {f"layer{i}.weight": torch.randn(side, side, generator=generator) for i in range(n)}
    moments = {
        name: {"exp_avg": torch.randn_like(t), "exp_avg_sq": torch.rand_like(t)}
        for name, t in model.items()
    }
    return {"model": model, "optimizer": moments}


def state_mb(state: dict[str, Any]) -> float:
    import torch

    def size(obj: Any) -> int:
        if isinstance(obj, torch.Tensor):
            return obj.numel() * obj.element_size()
        return sum(size(v) for v in obj.values()) if isinstance(obj, dict) else 0

    return size(state) / 2**20


class Case:
    """One form (``whole`` or ``dcp``) of one state, saved and resumed in one store prefix."""

    def __init__(self, form: str, state: dict[str, Any], prefix: str, scratch: Path) -> None:
        from dtrain.checkpoint.write import Checkpointer
        from dtrain.storage.objects import ObjectPath

        self.form, self.state, self.prefix = form, state, prefix
        self.scratch = scratch  # a resume's local folder (run.local_dir)
        self.root = ObjectPath(f"s3://{BUCKET}/{prefix}/checkpoints")
        self.fs = self.root.fs
        # Nothing pruned inside a timed save: each round's checkpoint is removed between rounds.
        self.checkpointer = Checkpointer(
            self.root, rank=0, world_size=1, keep_last=10**6, keep_every=0, log=lambda _: None
        )
        self.step = 0
        self.template: dict[str, Any] | None = None  # the sharded resume's target (see _load)

    # -- dtrain --------------------------------------------------------------------------

    def dtrain_save(self) -> None:
        self.step += 1
        meta = {"step": self.step, "strategy": "ddp" if self.form == "whole" else "fsdp"}
        if self.form == "whole":
            files = {"model.pt": self.state["model"], "optimizer.pt": self.state["optimizer"]}
            self.checkpointer.save(self.step, files, meta, blocking=True)
        else:
            self.checkpointer.save(self.step, {}, meta, blocking=True, sharded=self.state)

    def step_dir(self) -> Any:
        from dtrain.checkpoint.layout import step_dir_name

        return self.root / step_dir_name(self.step)

    def dtrain_resume(self) -> None:
        from dtrain.checkpoint import read as ckread
        from dtrain.checkpoint.copies import keep_copies

        step_dir = self.step_dir()
        # As a resume does: what is verified is kept locally for the load (one read a byte).
        with keep_copies(self.scratch, self.root):
            ckread.verify_checkpoint(step_dir)
            self._load(step_dir)

    def _load(self, step_dir: Any) -> None:
        import torch

        from dtrain.checkpoint import read as ckread
        from dtrain.checkpoint.safe_dcp import load_sharded

        if self.form == "whole":
            ckread.load_file(step_dir, "model.pt")
            ckread.load_file(step_dir, "optimizer.pt")
            ckread.load_meta(step_dir)
            return
        if self.template is None:
            # A sharded resume loads in place into the live model's and optimizer's tensors,
            # which exist (and were touched) before it: the template is made once, as they are.
            self.template = {
                "model": {k: torch.empty_like(v) for k, v in self.state["model"].items()},
                "optimizer": {
                    k: {m: torch.empty_like(t) for m, t in v.items()}
                    for k, v in self.state["optimizer"].items()
                },
            }
        load_sharded(self.template, ckread.sharded_reader(step_dir), no_dist=True)

    # -- plain fsspec --------------------------------------------------------------------

    def local_copy(self, into: Path) -> Path:
        """The files of the last dtrain save, on local disk (what the plain upload sends)."""
        folder = into / f"{self.prefix}-files"
        shutil.rmtree(folder, ignore_errors=True)
        self.fs.get(self.step_dir().url + "/", str(folder) + "/", recursive=True)
        return folder

    def plain_put(self, folder: Path) -> None:
        self.fs.put(str(folder) + "/", f"{BUCKET}/{self.prefix}/plain/", recursive=True)

    def plain_get(self, into: Path) -> None:
        shutil.rmtree(into, ignore_errors=True)
        self.fs.get(f"{BUCKET}/{self.prefix}/plain/", str(into) + "/", recursive=True)

    def clear(self, what: str) -> None:
        for key in self.fs.find(f"{BUCKET}/{self.prefix}/{what}"):
            self.fs.rm_file(key)


def timed(fn: Callable[[], Any]) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


Counts = dict[str, dict[str, Tally]]


def measure(
    case: Case, rounds: int, scratch: Path, counter: Counter
) -> tuple[dict[str, list[tuple[float, float]]], Counts]:
    """``rounds`` of (dtrain s, plain s) for saving and for resuming, in alternating order;
    and the requests of one more of each, untimed (what a save and a resume ask of the store)."""
    case.dtrain_save()  # warm: connections, imports; and the files the plain upload sends
    files = case.local_copy(scratch)
    case.plain_put(files)
    got = scratch / f"{case.prefix}-got"
    ways = {
        "save": {"dtrain": case.dtrain_save, "plain": lambda: case.plain_put(files)},
        "resume": {"dtrain": case.dtrain_resume, "plain": lambda: case.plain_get(got)},
    }
    for way in ways["resume"].values():  # warm too: the first load imports and allocates
        way()
    counts: Counts = {}
    case.clear("checkpoints")
    case.clear("plain")
    for what, pair in ways.items():
        for who, way in pair.items():
            with counter.count() as tally:
                way()
            counts.setdefault(what, {})[who] = tally
    out: dict[str, list[tuple[float, float]]] = {"save": [], "resume": []}
    for r in range(rounds):
        case.clear("checkpoints")
        case.clear("plain")
        order = ("dtrain", "plain") if r % 2 == 0 else ("plain", "dtrain")
        for what, way in ways.items():  # saves first: the resumes read what they wrote
            took = {who: timed(way[who]) for who in order}
            out[what].append((took["dtrain"], took["plain"]))
    return out, counts


Result = tuple[str, float, dict[str, list[tuple[float, float]]], Counts]


def report(results: list[Result]) -> str:
    """The times (medians of the rounds, the ratio's median and quartiles over the per-round
    ratios), then what one save and one resume asked of the store (exact)."""
    lines = [
        "| state | form | what | dtrain s (median) | plain s (median) | ratio (median) | "
        "ratio (quartiles) | rounds |",
        "|---|---|---|---:|---:|---:|---|---:|",
    ]
    for form, mb, rows, _ in results:
        for what, pairs in rows.items():
            ratios = sorted(d / p for d, p in pairs)
            low, _, high = quantiles(ratios, n=4) if len(ratios) > 1 else (ratios * 3)
            plain = "fs.put" if what == "save" else "fs.get"
            lines.append(
                f"| {mb:.0f} MB | {form} | {what} vs {plain} | "
                f"{median(d for d, _ in pairs):.3f} | {median(p for _, p in pairs):.3f} | "
                f"**{median(ratios):.3f}x** | {low:.2f} - {high:.2f} | {len(ratios)} |"
            )
    lines += [
        "",
        "| state | form | what | by | requests to the store | MiB up | MiB down | CPU s |",
        "|---|---|---|---|---|---:|---:|---:|",
    ]
    for form, mb, _, counts in results:
        for what, pair in counts.items():
            for who, tally in pair.items():
                kinds = ", ".join(f"{n} {kind}" for kind, n in tally.kinds())
                lines.append(
                    f"| {mb:.0f} MB | {form} | {what} | {who} | {sum(tally.calls.values())}: "
                    f"{kinds} | {tally.sent / 2**20:.1f} | {tally.received / 2**20:.1f} | "
                    f"{tally.cpu_s:.3f} |"
                )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes-mb", default="4,33", help="model sizes in MB (x3 with AdamW)")
    parser.add_argument("--forms", default="whole,dcp", help="whole (ddp's files), dcp (fsdp's)")
    parser.add_argument("--rounds", type=int, default=31)
    parser.add_argument("--swift", action="store_true", help="the store of scripts/s3.sh up")
    parser.add_argument("--write-docs", action="store_true")
    args = parser.parse_args()

    # DCP without a process group says it assumes one process, at every save and load.
    warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
    results: list[Result] = []
    with swift_store() if args.swift else moto_store() as env:
        os.environ.update(env)
        import s3fs  # noqa: F401  (the s3 extra: pip install -e '.[s3]')

        from dtrain.storage.objects import file_system

        fs = file_system("s3")
        if not fs.exists(BUCKET):
            fs.mkdir(BUCKET)
        counter = Counter(fs)
        with tempfile.TemporaryDirectory(prefix="dtrain-bench-s3-") as scratch:
            for mb in (int(x) for x in args.sizes_mb.split(",")):
                state = make_state(mb)
                for form in args.forms.split(","):
                    case = Case(form, state, f"{form}-{mb}", Path(scratch))
                    rows, counts = measure(case, args.rounds, Path(scratch), counter)
                    results.append((form, state_mb(state), rows, counts))
                    for what, pair in counts.items():
                        for who, tally in pair.items():
                            print(f"{state_mb(state):.0f} MB {form} {what} {who}: {tally.line()}")
                    for what, pairs in rows.items():
                        for r, (d, p) in enumerate(pairs):
                            print(
                                f"{state_mb(state):.0f} MB {form} {what} round {r}: "
                                f"dtrain {d:.3f} s, plain {p:.3f} s, {d / p:.2f}x",
                                flush=True,
                            )
                    case.clear("")
    table = report(results)
    store = "OpenStack Swift's S3 API (scripts/s3.sh)" if args.swift else "moto's S3 server"
    print(table)
    # A busy machine scatters the rounds: the load says how far to trust the times.
    print(machine_line())
    if args.write_docs:
        body = "\n".join(
            [
                "## Checkpoints in an object store vs plain fsspec transfers (issue 42)",
                "",
                f"`python benchmarks/bench_s3_checkpoint.py {' '.join(sys.argv[1:])}` "
                f"on {time.strftime('%Y-%m-%d')}, against {store} on loopback "
                f"({machine_line()}). Target: each ratio at most 1.2x.",
                "",
                table,
            ]
        )
        print(f"wrote {update_section('bench_s3_checkpoint', body)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
