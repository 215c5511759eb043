"""A prepared check for the day a GPU machine is lent: every strategy x precision x compile
trains a few steps on CUDA and is compared with one process under the same precision and
compile; a table says each row's time per step, its largest loss difference and whether it
passed. Exit code 1 when a row failed.

    python benchmarks/gpu_check.py                        # CUDA: the whole matrix, 60 rows
    python benchmarks/gpu_check.py --strategies ddp,fsdp --precisions bf16-mixed
    python benchmarks/gpu_check.py --device cpu --compile off   # the same on CPU (gloo)

**The matrix.** ddp, allreduce, fsdp, tensor, pipeline (GPipe, one micro-batch: the same split
as one process) and localsgd (a sync every step: data parallelism's update) on 2 ranks; hybrid
fsdp (2 copies x 2 shards) and fsdp x tensor (2 x 2) on 4; each in fp32, bf16-mixed and
fp16-mixed, eager and compiled (``train.compile``: the blocks compiled one by one). Beside
them, eager rows with torch's fused optimizer kernel (``optim.implementation = 'fused'``)
wherever it runs: not where parameters are DTensors (fsdp, tensor), where fused SGD is a
config error. Compile leaves the optimizer step alone (only the blocks are compiled), so
compiled fused rows would add nothing the eager ones do not check. The model is
the tests' tiny GPT (2 blocks, d_model 64, 32 tokens) trained by SGD for ``--steps`` steps
without gradient clipping (local SGD clips per replica), so that every row computes one
process's update; the reference of a row is one process with its precision and compile.

**Tolerances** (those of ``tests/test_precision.py``, and one for compiled fp16): the loss of
every step within a relative 1e-5 of the reference's in fp32, and in every format in the
pipeline, whose stages compute every gradient over the whole batch, in the same shapes, as
the one process does: only the summation order differs. bf16-mixed under ddp, allreduce and
fsdp also within 1e-5 of a reference that accumulates the batch in one micro-batch per rank:
each rank rounds its partial gradient sums to bfloat16 before the ranks add them, and so does
that reference (measured on CPU: 8.3e-7). bf16-mixed elsewhere within bf16's unit roundoff,
2^-8, of the whole-batch reference: a tensor-parallel slice's partial sums are rounded before
the ranks add them. Hybrid fsdp (4 ranks) and local SGD are held there too: against an
accumulating reference they came to 9.2e-5 and 2.3e-5 on CPU, their float32 arithmetic
differing from the reference's in the last bit (four partial sums added in another order;
parameters averaged after each replica's own step), which a weight's next bfloat16 cast can
turn into a whole bfloat16 step. fp16-mixed
eager within 1e-5 (fp16 rounds 8x finer; tests/test_precision.py holds ddp and fsdp to it);
compiled within fp16's unit roundoff, 2^-11: the compiled kernels are specialized to each
rank's shapes (a part of the batch) and need not round where the one process's kernels
round (on CPU: 1.3e-5 for ddp and fsdp, where eager gives 2.6e-6).

**Several ranks on one GPU.** NCCL refuses two ranks on one device, so where a row has more
ranks than there are GPUs its collectives go through gloo (``dist.backend = 'gloo'``) with the
ranks sharing the GPUs (rank r on GPU r mod count: dtrain's own placement); with enough GPUs,
NCCL. gloo has no point-to-point transfer of CUDA tensors, so pipeline rows on shared GPUs are
reported as skipped, with the reason; gloo's coverage of the other collectives on CUDA tensors
is what the rows find out (a row that raises is a failed row, its error in the table).

Each world size runs its rows one after the other in one launch of its ranks (``run_ranks``),
the references in one process, so that torch, CUDA and each compiled block start once per
launch: a tiny model, 6 steps a row, sized to stay under 5 minutes on one H200 -- not yet
measured (no GPU was lent while it was written; compiling each strategy's blocks once per
precision should be most of it). The script prints its own wall time. On CPU the same
script runs on gloo (``tests/test_gpu_check.py`` runs a few rows).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent

# name -> (ranks, [strategy] options, [comm] options)
STRATEGIES: dict[str, tuple[int, dict[str, Any], dict[str, Any]]] = {
    "ddp": (2, {"name": "ddp"}, {}),
    "allreduce": (2, {"name": "allreduce"}, {}),
    "fsdp": (2, {"name": "fsdp"}, {}),
    "hybrid fsdp": (4, {"name": "fsdp", "dp_replicate": 2}, {}),
    "fsdp x tensor": (4, {"name": "fsdp", "tensor_parallel": 2}, {}),
    "tensor": (2, {"name": "tensor"}, {}),
    "pipeline": (
        2,
        {"name": "pipeline", "pipeline_balance": "uniform", "pipeline_schedule": "gpipe"},
        {},
    ),
    "localsgd": (2, {"name": "localsgd"}, {"sync_every": 1}),
}
# 2-rank data parallelism: in bf16 each rank rounds its partial gradient sums, so the
# reference accumulates the same shares in one process (see the module's docstring).
DATA_PARALLEL = ("ddp", "allreduce", "fsdp")
PRECISIONS = ("fp32", "bf16-mixed", "fp16-mixed")
# Where fused SGD runs: torch's fused kernel has no DTensor rule (a config error in dtrain).
FUSED_STRATEGIES = ("ddp", "allreduce", "pipeline", "localsgd")
COMPILE = {"off": False, "on": True}
BF16_ROUNDOFF = 2.0**-8
FP16_ROUNDOFF = 2.0**-11
TIGHT = 1e-5


@dataclass(frozen=True)
class Row:
    strategy: str
    precision: str
    compiled: bool
    fused: bool = False  # optim.implementation = 'fused' (else foreach)

    @property
    def ranks(self) -> int:
        return STRATEGIES[self.strategy][0]

    @property
    def name(self) -> str:
        name = f"{self.strategy} / {self.precision} / compile {'on' if self.compiled else 'off'}"
        return f"{name} / fused" if self.fused else name

    @property
    def reference_key(self) -> tuple[str, bool, int, bool]:
        """What the row's one-process reference runs: its precision, compile, micro-batches
        and optimizer kernel."""
        return (self.precision, self.compiled, self.reference_micro_batches, self.fused)

    @property
    def reference_micro_batches(self) -> int:
        """The micro-batches the one-process reference accumulates the batch in: one per
        data-parallel rank in bf16-mixed (the same rounded partial sums), else the whole
        batch at once."""
        if self.precision == "bf16-mixed" and self.strategy in DATA_PARALLEL:
            return self.ranks
        return 1

    @property
    def tolerance(self) -> float:
        """The largest relative loss difference from the reference that passes (see the
        module's docstring for why)."""
        if self.precision == "fp32" or self.strategy == "pipeline":
            return TIGHT
        if self.precision == "bf16-mixed":
            return TIGHT if self.reference_micro_batches > 1 else BF16_ROUNDOFF
        return FP16_ROUNDOFF if self.compiled else TIGHT


@dataclass
class Outcome:
    row: Row
    backend: str
    step_ms: float | None = None
    difference: float | None = None  # the largest relative loss difference over the steps
    error: str | None = None
    skipped: str | None = None

    @property
    def passed(self) -> bool:
        return self.skipped is not None or (
            self.error is None
            and self.difference is not None
            and self.difference <= self.row.tolerance
        )


def job_config(
    run_dir: Path,
    precision: str,
    compiled: bool,
    device: str,
    backend: str,
    steps: int,
    strategy: dict[str, Any] | None = None,
    comm: dict[str, Any] | None = None,
    micro_batches: int = 1,
    fused: bool = False,
) -> dict[str, Any]:
    """A row's config (without ``strategy``: the one-process reference)."""
    return {
        "run": {"dir": str(run_dir), "task": "tests.tasks:tiny_gpt", "seed": 0},
        "data": {"global_batch_size": 8, "prefetch": 0, "micro_batches": micro_batches},
        "train": {
            "steps": steps,
            "log_every": 1,
            "precision": precision,
            "compile": compiled,
            "grad_clip": 0.0,
        },
        "optim": {
            "name": "sgd",
            "lr": 0.5,
            "warmup_steps": 2,
            "implementation": "fused" if fused else "foreach",
        },
        "eval": {"every": 0, "batch_size": 8, "max_samples": 8},
        "checkpoint": {"every": 0},
        "strategy": strategy or {"name": "ddp"},
        "comm": comm or {},
        "dist": {"device": device, "backend": backend, "timeout_s": 120.0},
        "task": {"n_layer": 2, "d_model": 64, "seq_len": 32, "samples": 64},
    }


def train_each(raws: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """In every rank: train each config in turn; per config its losses and step times (rank
    0, from metrics.jsonl) or the error it raised."""
    from dtrain.train.job import build_job_config, build_trainer

    out: list[dict[str, Any]] = []
    for raw in raws:
        if raw["train"]["compile"]:
            # Each row's blocks are new modules, which TorchDynamo compiles anew; past its
            # recompile limit (8 per code object) it would run them eagerly, silently. A row
            # starts from an empty cache instead (inductor's on-disk cache stays warm).
            import torch._dynamo

            torch._dynamo.reset()
        try:
            build_trainer(build_job_config(raw)).fit()
        except Exception as exc:
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
            out.append({"error": f"{type(exc).__name__}: {first}"[:160]})
            continue
        out.append(read_metrics(Path(raw["run"]["dir"])))
    return out


def read_metrics(run_dir: Path) -> dict[str, Any]:
    losses: dict[int, float] = {}
    times: dict[int, float] = {}
    metrics = run_dir / "metrics.jsonl"
    if metrics.exists():  # rank 0's
        for line in metrics.read_text().splitlines():
            record = json.loads(line)
            if record.get("kind") == "train":
                losses[record["step"]] = record["loss"]
                times[record["step"]] = record["step_time_s"]
    return {"losses": losses, "times": times}


def largest_difference(losses: dict[int, float], reference: dict[int, float]) -> float:
    """The largest relative difference of a row's loss from the reference's, over the steps
    (inf where a step is missing or not finite)."""
    if not reference or set(losses) != set(reference):
        return math.inf
    worst = 0.0
    for step, value in reference.items():
        if not (math.isfinite(value) and math.isfinite(losses[step])):
            return math.inf
        worst = max(worst, abs(losses[step] - value) / max(abs(value), 1e-12))
    return worst


def step_ms(times: dict[int, float]) -> float | None:
    """The median step time after the first two (the first compiles, the second may)."""
    later = [t for step, t in sorted(times.items()) if step > 2] or list(times.values())
    return 1e3 * statistics.median(later) if later else None


def choose_backend(device: str, ranks: int, asked: str) -> str:
    if device == "cpu":
        return "gloo"
    if asked != "auto":
        return asked
    import torch

    return "nccl" if torch.cuda.device_count() >= ranks else "gloo"


def run(rows: list[Row], device: str, asked_backend: str, steps: int, root: Path) -> list[Outcome]:
    from tests.ranks import RankFailed, run_ranks

    references: dict[tuple[str, bool, int, bool], dict[str, Any]] = {}
    keys = sorted({row.reference_key for row in rows})
    ref_raws = [
        job_config(
            root / f"ref-{p}-{c}-{m}-{f}", p, c, device, "gloo", steps, micro_batches=m, fused=f
        )
        for p, c, m, f in keys
    ]
    started = time.perf_counter()
    for key, result in zip(keys, run_ranks(train_each, 1, ref_raws, timeout=1800)[0]):
        references[key] = result
    print(f"references: {len(keys)} one-process runs in {time.perf_counter() - started:.0f}s")
    outcomes: list[Outcome] = []
    by_launch: dict[tuple[int, str], list[Row]] = {}
    for row in rows:
        backend = choose_backend(device, row.ranks, asked_backend)
        if device == "cuda" and backend == "gloo" and row.strategy == "pipeline":
            outcomes.append(
                Outcome(
                    row,
                    backend,
                    skipped="gloo sends no CUDA tensors point to point; needs "
                    f"{row.ranks} GPUs for NCCL",
                )
            )
            continue
        by_launch.setdefault((row.ranks, backend), []).append(row)
    for (ranks, backend), launch in sorted(by_launch.items()):
        raws = [
            job_config(
                root / f"{index}-{ranks}-{backend}",
                row.precision,
                row.compiled,
                device,
                backend,
                steps,
                STRATEGIES[row.strategy][1],
                STRATEGIES[row.strategy][2],
                fused=row.fused,
            )
            for index, row in enumerate(launch)
        ]
        started = time.perf_counter()
        try:
            # dtrain's runtime joins the process group itself (NCCL or gloo, as the
            # config says); the same launch serves every row of this world size.
            per_rank = run_ranks(train_each, ranks, raws, timeout=1800, init_group=False)
        except RankFailed as exc:
            message = str(exc).strip().splitlines()[-1][:160]
            outcomes += [Outcome(row, backend, error=message) for row in launch]
            continue
        print(
            f"{ranks} ranks ({backend}): {len(launch)} rows in {time.perf_counter() - started:.0f}s"
        )
        for index, row in enumerate(launch):
            results = [rank_results[index] for rank_results in per_rank]
            errors = [r["error"] for r in results if "error" in r]
            outcome = Outcome(row, backend)
            if errors:
                outcome.error = errors[0]
            else:
                reference = references[row.reference_key]
                if "error" in reference:
                    outcome.error = f"the reference failed: {reference['error']}"
                else:
                    outcome.difference = largest_difference(
                        results[0]["losses"], reference["losses"]
                    )
                    outcome.step_ms = step_ms(results[0]["times"])
            outcomes.append(outcome)
    order = {row: index for index, row in enumerate(rows)}
    return sorted(outcomes, key=lambda o: order[o.row])


def table(outcomes: list[Outcome]) -> str:
    lines = [
        f"{'row':<48}{'ranks':>6} {'backend':<8}{'step (ms)':>10}{'max loss diff':>15}"
        f"{'tolerance':>11}  result"
    ]
    for o in outcomes:
        ms = f"{o.step_ms:.1f}" if o.step_ms is not None else "-"
        diff = f"{o.difference:.2e}" if o.difference is not None else "-"
        if o.skipped:
            verdict = f"skipped: {o.skipped}"
        elif o.error:
            verdict = f"FAIL: {o.error}"
        else:
            verdict = "pass" if o.passed else "FAIL"
        lines.append(
            f"{o.row.name:<48}{o.row.ranks:>6} {o.backend:<8}{ms:>10}{diff:>15}"
            f"{o.row.tolerance:>11.1e}  {verdict}"
        )
    return "\n".join(lines)


def parse_list(text: str, valid: tuple[str, ...] | list[str], what: str) -> list[str]:
    items = [item.strip() for item in text.split(",") if item.strip()]
    unknown = [item for item in items if item not in valid]
    if unknown or not items:
        raise SystemExit(f"--{what} {text!r}: expected a comma-separated list of {list(valid)}")
    return items


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--strategies", default=",".join(STRATEGIES))
    parser.add_argument("--precisions", default=",".join(PRECISIONS))
    parser.add_argument("--compile", default="off,on", help="off, on, or off,on")
    parser.add_argument(
        "--fused", default="on", choices=["on", "off"], help="the fused-optimizer rows too (on)"
    )
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument(
        "--backend",
        choices=["auto", "nccl", "gloo"],
        default="auto",
        help="CUDA: NCCL where every rank has a GPU of its own, else gloo (auto)",
    )
    parser.add_argument("--keep", default="", help="keep the run folders here")
    args = parser.parse_args(argv)
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            print("gpu_check: no CUDA device here; use --device cpu", file=sys.stderr)
            return 2
    rows = [
        Row(strategy, precision, COMPILE[compiled])
        for strategy in parse_list(args.strategies, list(STRATEGIES), "strategies")
        for precision in parse_list(args.precisions, PRECISIONS, "precisions")
        for compiled in parse_list(args.compile, tuple(COMPILE), "compile")
    ]
    if args.fused == "on":
        rows += [
            Row(row.strategy, row.precision, False, fused=True)
            for row in rows
            if not row.compiled and row.strategy in FUSED_STRATEGIES
        ]
    os.chdir(ROOT)  # the workers import the task (tests.tasks) from here
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    root = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="gpu-check-"))
    started = time.perf_counter()
    try:
        outcomes = run(rows, args.device, args.backend, args.steps, root)
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    print(table(outcomes))
    failed = [o for o in outcomes if not o.passed]
    skipped = sum(1 for o in outcomes if o.skipped)
    print(
        f"{len(outcomes) - len(failed) - skipped} passed, {len(failed)} failed, {skipped} "
        f"skipped in {time.perf_counter() - started:.0f}s ({args.device})"
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
