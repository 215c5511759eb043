"""``pipeline``: the bubble against the GPipe bound, and 1F1B's activation memory against GPipe's.

Two questions, answered side by side in one run on K ranks (gloo on loopback, one thread per
rank), through the ``pipeline`` strategy's own ``forward_backward``:

1. Idle fraction per stage. A stage is busy while it computes a micro-batch's forward or
   backward (``PipelineStage.forward_one_chunk`` / ``backward_one_chunk``, timed on the wall
   clock); the step's span runs from the first rank's start to the last rank's end (all ranks
   start together after a barrier; ``time.perf_counter`` is one clock for every process of the
   machine). Idle = 1 - busy / span. With K equal stages and M micro-batches, GPipe idles
   ``(K-1) / (M+K-1)`` of the span on every stage (the fill and the drain of the pipeline; 1F1B
   has the same bubble). Target: within 5 percentage points of that bound for M = 4, 8, 16.
2. Peak activation memory per stage, 1F1B over GPipe at the same M: the most bytes of tensors
   autograd holds for backward at any moment of a step (counted with ``saved_tensors_hooks`` on
   the stage's layers, each storage once, weights excluded), and the peak of the process's
   resident memory above its level before the step (``VmHWM``, reset through
   ``/proc/self/clear_refs``). GPipe holds all M micro-batches' activations before the first
   backward; 1F1B at most K - s on stage s. Target: at most 1.0x.

The stages are equal by construction: a chain of identical blocks cut into equal layer counts.
Two kinds of block:

- *real*: residual MLP blocks computing on the CPU (K = 2, one core per rank). On a machine
  shared with other jobs the ranks also wait for a CPU; the kernel's per-thread ``schedstat``
  run delay says how long, and is printed beside each figure, with the figures over the
  "quiet" steps where no rank waited for a CPU more than 5% of the span;
- *timed*: a block that sleeps a fixed time in forward and backward (plus a small real linear
  map), for K = 2 and K = 4 on any machine. Sleeping needs no core, so the schedule, the gloo
  sends, torch's and dtrain's code are measured without the computation being stretched by
  other load (a rank still wakes up late on a busy machine). Printed at two scales: the
  "ms/action" column is the idle above the bound per forward or backward, a fixed cost per
  action that weighs more the shorter the actions are.

Variants (M x schedule) alternate round by round, in reversed order every other round, so that
load from other users of the machine hits all alike; figures are medians over rounds.

    .venv/bin/python benchmarks/bench_pipeline.py               # prints the figures
    .venv/bin/python benchmarks/bench_pipeline.py --write-docs  # also updates docs/benchmarks.md
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _report import ROOT, write_report_section

sys.path.insert(0, str(ROOT))  # tests/: the test aids of a source checkout

SECTION = "bench_pipeline"
MICRO_BATCHES = (4, 8, 16)
SCHEDULES = ("gpipe", "1f1b")


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


class _Wait(torch.autograd.Function):
    """Identity whose forward and backward each take a fixed wall time without using a CPU."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, forward_s: float, backward_s: float) -> torch.Tensor:
        ctx.backward_s = backward_s
        time.sleep(forward_s)
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        time.sleep(ctx.backward_s)
        return grad, None, None


class Timed(nn.Module):
    """A layer of fixed duration: a small linear map plus a wait (see the module docstring)."""

    def __init__(self, width: int, forward_s: float, backward_s: float) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)
        self.forward_s, self.backward_s = forward_s, backward_s

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Wait.apply(self.linear(x), self.forward_s, self.backward_s)


def mse(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return (output - target).square().mean(dim=-1)


# -- instruments -------------------------------------------------------------------------------


class Busy:
    """Wall time a rank spends computing stage forwards and backwards."""

    def __init__(self) -> None:
        self.seconds = 0.0

    def install(self) -> None:
        from torch.distributed.pipelining.stage import _PipelineStageBase

        for name in ("forward_one_chunk", "backward_one_chunk"):
            original = getattr(_PipelineStageBase, name)
            setattr(_PipelineStageBase, name, self._timed(original))

    def _timed(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - started

        return timed


class SavedBytes:
    """Bytes of tensors autograd holds for backward, live; each storage counted once."""

    def __init__(self) -> None:
        self.live: dict[int, list[int]] = {}  # storage pointer -> [bytes, holders]
        self.current = 0
        self.peak = 0
        self.parameters: set[int] = set()  # storages that are parameters, not activations

    def reset(self) -> None:
        self.peak = self.current

    def pack(self, tensor: torch.Tensor) -> Any:
        if tensor.untyped_storage().data_ptr() in self.parameters:
            return tensor  # a weight saved for backward is the model's, not an activation
        return _Held(self, tensor)

    @staticmethod
    def unpack(held: Any) -> torch.Tensor:
        return held if isinstance(held, torch.Tensor) else held.tensor


class _Held:
    def __init__(self, owner: SavedBytes, tensor: torch.Tensor) -> None:
        self.owner, self.tensor = owner, tensor
        storage = tensor.untyped_storage()
        self.key = storage.data_ptr()
        entry = owner.live.setdefault(self.key, [storage.nbytes(), 0])
        if entry[1] == 0:
            owner.current += entry[0]
            owner.peak = max(owner.peak, owner.current)
        entry[1] += 1

    def __del__(self) -> None:
        entry = self.owner.live[self.key]
        entry[1] -= 1
        if entry[1] == 0:
            self.owner.current -= entry[0]
            del self.owner.live[self.key]


class Tracked(nn.Module):
    """A layer whose forward counts what autograd saves."""

    def __init__(self, inner: nn.Module, saved: SavedBytes) -> None:
        super().__init__()
        self.inner = inner
        self.saved = saved

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.saved.parameters.update(p.untyped_storage().data_ptr() for p in self.parameters())
        with torch.autograd.graph.saved_tensors_hooks(self.saved.pack, self.saved.unpack):
            return self.inner(x)


def return_freed_memory() -> None:
    """Make glibc map every allocation of 4 KiB or more on its own and unmap it when freed,
    so that the resident size follows the live tensors instead of a cached heap."""
    import ctypes

    libc = ctypes.CDLL("libc.so.6")
    m_trim_threshold, m_mmap_threshold = -1, -3
    libc.mallopt(m_mmap_threshold, 4096)
    libc.mallopt(m_trim_threshold, 4096)


def run_delay_s() -> float:
    """Seconds this thread has spent runnable but waiting for a CPU (the kernel's schedstat):
    time taken by other processes on a busy machine."""
    return int(Path("/proc/thread-self/schedstat").read_text().split()[1]) / 1e9


def rss_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


# -- inside each rank --------------------------------------------------------------------------


def rank_main(opts: dict[str, Any]) -> dict[str, Any]:
    from dtrain.config.load import build_config
    from dtrain.dist.runtime import init_runtime
    from dtrain.parallel import build_strategy
    from dtrain.task import Task

    busy, saved = Busy(), SavedBytes()
    busy.install()
    return_freed_memory()
    width, layers, rows = opts["width"], opts["layers"], opts["rows"]
    torch.manual_seed(0)
    blocks: list[nn.Module]
    if opts["compute"] == "timed":
        per_layer = dist.get_world_size() / layers  # a stage's waits add up to the given times
        blocks = [
            Timed(
                width, opts["forward_ms"] * per_layer / 1e3, opts["backward_ms"] * per_layer / 1e3
            )
            for _ in range(layers)
        ]
    else:
        blocks = [Block(width) for _ in range(layers)]
    model = nn.Sequential(*(Tracked(block, saved) for block in blocks))
    strategies: dict[tuple[int, str], Any] = {}
    for m in opts["micro_batches"]:
        for schedule in SCHEDULES:
            cfg = build_config(
                {
                    "data": {"global_batch_size": m * rows, "micro_batches": m},
                    "strategy": {
                        "name": "pipeline",
                        "pipeline_schedule": schedule,
                        "pipeline_balance": "uniform",
                    },
                }
            )
            strategy = build_strategy(cfg, init_runtime(cfg.dist))
            # Each variant cuts its own copy: setup prunes the model to this rank's stage.
            strategy.setup(Task(model=_copy(model, saved), train_data=[], loss_fn=mse))
            strategies[(m, schedule)] = strategy
    generator = torch.Generator().manual_seed(1)
    batches = {
        m: [
            (
                torch.randn(rows, width, generator=generator),
                torch.randn(rows, width, generator=generator),
            )
            for _ in range(m)
        ]
        for m in opts["micro_batches"]
    }
    scale = torch.tensor(1.0)
    variants = list(strategies)
    records: list[dict[str, Any]] = []
    for round_index in range(opts["warmup"] + opts["rounds"]):
        order = variants if round_index % 2 == 0 else variants[::-1]
        for m, schedule in order:
            strategy = strategies[(m, schedule)]
            for param in strategy.parameters():
                param.grad = None
            dist.barrier()
            Path("/proc/self/clear_refs").write_text("5")  # reset the resident-memory peak
            rss_before = rss_kib("VmRSS")
            saved.reset()
            busy.seconds = 0.0
            delay = run_delay_s()
            started = time.perf_counter()
            strategy.forward_backward(batches[m], mse, scale)
            ended = time.perf_counter()
            delay = run_delay_s() - delay
            if round_index >= opts["warmup"]:
                records.append(
                    {
                        "m": m,
                        "schedule": schedule,
                        "round": round_index,
                        "start": started,
                        "end": ended,
                        "busy": busy.seconds,
                        "delay": delay,
                        "saved_peak": saved.peak,
                        "rss_peak_kib": rss_kib("VmHWM") - rss_before,
                    }
                )
    return {"rank": dist.get_rank(), "records": records}


def _copy(model: nn.Module, shared: SavedBytes) -> nn.Module:
    """A copy with its own parameters and the same instrument."""
    import copy

    return copy.deepcopy(model, {id(shared): shared})


# -- the report --------------------------------------------------------------------------------

Steps = dict[tuple[int, str], list[list[dict[str, Any]]]]  # (M, schedule) -> steps -> ranks
QUIET = 0.05  # a step is quiet when no rank waited for a CPU more than 5% of its span


def group_steps(results: list[dict[str, Any]]) -> Steps:
    by_step: dict[tuple[int, str, int], list[dict[str, Any]]] = {}
    for result in results:
        for record in result["records"]:
            key = (record["m"], record["schedule"], record["round"])
            by_step.setdefault(key, []).append({**record, "rank": result["rank"]})
    steps: Steps = {}
    for (m, schedule, _), records in sorted(by_step.items()):
        steps.setdefault((m, schedule), []).append(records)
    return steps


def _span(records: list[dict[str, Any]]) -> float:
    return max(r["end"] for r in records) - min(r["start"] for r in records)


def _delay_share(records: list[dict[str, Any]]) -> float:
    """The largest share of the step's span that one rank spent waiting for a CPU."""
    return max(r["delay"] for r in records) / _span(records)


def _idle(
    steps: list[list[dict[str, Any]]], stages: int
) -> tuple[list[float], list[tuple[float, float]]]:
    """Median idle fraction of each stage over the steps, and its middle half."""
    idle: dict[int, list[float]] = {s: [] for s in range(stages)}
    for records in steps:
        span = _span(records)
        for r in records:
            idle[r["rank"]].append(1 - r["busy"] / span)
    return (
        [statistics.median(idle[s]) for s in range(stages)],
        [_middle_half(idle[s]) for s in range(stages)],
    )


def _middle_half(values: list[float]) -> tuple[float, float]:
    ordered = sorted(values)
    n = len(ordered)
    return ordered[n // 4], ordered[min(n - 1, (3 * n) // 4)]


def idle_lines(steps: Steps, stages: int, *, quiet_too: bool) -> tuple[list[str], float | None]:
    """One line per (M, schedule) and subset of steps: idle per stage against the bound, and
    the excess idle per action (scale-free: what each forward or backward adds to the bound).
    Returns the lines and the worst gap of the last subset (all steps, or the quiet ones);
    None when that subset never had enough steps to judge."""
    lines: list[str] = []
    worst: float | None = None
    for (m, schedule), every_step in steps.items():
        bound = (stages - 1) / (m + stages - 1)
        subsets = [("all", every_step)]
        if quiet_too:
            subsets.append(("quiet", [r for r in every_step if _delay_share(r) <= QUIET]))
        for label, chosen in subsets:
            prefix = f"M={m:>2} {schedule:>5} {label:>5} steps ({len(chosen):>2})"
            if len(chosen) < 3:
                lines.append(f"{prefix}: too few to tell")
                continue
            medians, spread = _idle(chosen, stages)
            gap = max(abs(v - bound) for v in medians)
            if label == subsets[-1][0]:
                worst = gap if worst is None else max(worst, gap)
            span = statistics.median(_span(r) for r in chosen)
            excess_ms = (max(medians) - bound) * span / (2 * m) * 1e3
            delay = statistics.median(_delay_share(r) for r in chosen)
            lines.append(
                f"{prefix}: idle "
                + "  ".join(
                    f"s{s} {v:5.1%} ({lo:.0%}-{hi:.0%})"
                    for s, (v, (lo, hi)) in enumerate(zip(medians, spread))
                )
                + f"  bound {bound:5.1%}  gap {gap * 100:4.1f} pts"
                f"  | step {span * 1e3:4.0f} ms, {excess_ms:+.1f} ms/action, CPU wait {delay:3.0%}"
            )
    return lines, worst


def memory_lines(steps: Steps, stages: int) -> tuple[list[str], float]:
    """Per M and stage: peak saved activations and resident peak, 1F1B over GPipe; returns
    the lines and the largest ratio of either."""
    lines, worst = [], 0.0
    for m in sorted({m for m, _ in steps}):
        parts = []
        for stage in range(stages):
            saved, rss = {}, {}
            for schedule in SCHEDULES:
                mine = [
                    r for records in steps[(m, schedule)] for r in records if r["rank"] == stage
                ]
                saved[schedule] = statistics.median(r["saved_peak"] for r in mine) / 2**20
                rss[schedule] = statistics.median(r["rss_peak_kib"] for r in mine) / 1024
            saved_ratio = saved["1f1b"] / saved["gpipe"]
            rss_ratio = rss["1f1b"] / max(rss["gpipe"], 1e-9)
            worst = max(worst, saved_ratio, rss_ratio)
            parts.append(
                f"s{stage} {saved['gpipe']:4.1f} -> {saved['1f1b']:4.1f} MiB = {saved_ratio:.2f}x "
                f"(resident {rss['gpipe']:4.1f} -> {rss['1f1b']:4.1f} MiB = {rss_ratio:.2f}x)"
            )
        lines.append(f"M={m:>2}: " + ";  ".join(parts))
    return lines, worst


def run(
    stages: int,
    compute: str,
    args: argparse.Namespace,
    forward_ms: float = 0.0,
    backward_ms: float = 0.0,
) -> Steps:
    from tests.ranks import run_ranks

    opts = {
        "compute": compute,
        "width": args.width if compute == "real" else 64,
        "layers": args.layers,
        "rows": args.rows,
        "rounds": args.rounds,
        "warmup": args.warmup,
        "micro_batches": MICRO_BATCHES,
        "forward_ms": forward_ms,
        "backward_ms": backward_ms,
    }
    results = run_ranks(rank_main, stages, opts, timeout=3600, collective_timeout=600)
    return group_steps(results)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=8, help="blocks in the chain")
    parser.add_argument("--width", type=int, default=256, help="real blocks: width")
    parser.add_argument("--rows", type=int, default=32, help="samples per micro-batch")
    parser.add_argument(
        "--timed",
        nargs="*",
        default=["4/8", "20/40"],
        help="timed stages: forward/backward milliseconds per micro-batch, one run each",
    )
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--write-docs", action="store_true")
    args = parser.parse_args()
    started = time.time()
    out: list[str] = []
    verdicts: list[str] = []

    real = run(2, "real", args)
    lines, real_gap = idle_lines(real, 2, quiet_too=True)
    out += [
        f"1. Real compute: K=2 stages x {args.layers // 2} residual MLP blocks (width "
        f"{args.width}), micro-batches of {args.rows} rows. Per (M, schedule): median idle per "
        "stage (middle half), the GPipe bound (K-1)/(M+K-1), the step's span, the idle above "
        "the bound per forward or backward, and the share of the span the busiest rank spent "
        f"waiting for a CPU taken by other processes; 'quiet' = steps where no rank waited "
        f"more than {QUIET:.0%}.",
        *lines,
        "",
    ]
    verdicts.append(
        f"real K=2: worst gap {real_gap * 100:.1f} pts over quiet steps"
        if real_gap is not None
        else "real K=2: too few quiet steps to judge (the ranks kept waiting for a CPU)"
    )
    for timing in args.timed:
        forward_ms, backward_ms = (float(v) for v in timing.split("/"))
        for stages in (2, 4):
            timed = run(stages, "timed", args, forward_ms, backward_ms)
            lines, gap = idle_lines(timed, stages, quiet_too=False)
            out += [
                f"2. Timed compute, K={stages}: a stage's forward waits {forward_ms:g} ms and its "
                f"backward {backward_ms:g} ms per micro-batch (sleeping: other load cannot "
                "stretch it, beyond waking up late); all else is the real pipeline.",
                *lines,
                "",
            ]
            assert gap is not None
            verdicts.append(f"timed {timing} ms K={stages}: worst gap {gap * 100:.1f} pts")
    mem_lines, worst_ratio = memory_lines(real, 2)
    out += [
        "3. Peak activation memory per stage, GPipe -> 1F1B, real compute, K=2: tensors saved "
        "for backward (each storage once), and in brackets the process's resident peak above "
        "its level before the step (the gradients, ~8 MiB per stage, included):",
        *mem_lines,
        "",
    ]
    verdicts.append(f"memory 1F1B/GPipe: at most {worst_ratio:.2f}x (target <= 1.0x)")
    out.append(
        "verdict (idle target: within 5 pts of the bound): "
        + "; ".join(verdicts)
        + f". {time.time() - started:.0f} s in all"
    )
    text = "\n".join(out)
    print(text)
    if args.write_docs:
        title = "Pipeline: bubble vs the GPipe bound; 1F1B vs GPipe activation memory"
        print(f"wrote {write_report_section(SECTION, title, text)}")


if __name__ == "__main__":
    main()
