"""``dtrain estimate`` against the peaks real runs reach: for each config, the estimated peak of
the rank that needs the most, and the largest measured peak over the ranks, side by side.

    python benchmarks/bench_estimate.py                 # every config below
    python benchmarks/bench_estimate.py --only ddp      # the configs whose name has "ddp"
    python benchmarks/bench_estimate.py --write-docs    # and update docs/benchmarks.md

The measured peak is a rank's resident size above its size just before the trainer was built,
at its highest (the kernel's VmHWM, reset through /proc/self/clear_refs) over set-up and 3
training steps (AdamW: the optimizer's state exists from the first, ddp's staging bucket from
the second). Each config runs in fresh processes, after one run of the same strategy on a tiny
model (what its first run imports, connects and starts belongs to the runtime), with glibc
returning every freed block of 64 KiB or more to the kernel (a fixed mmap threshold: by
default it grows to 32 MiB and freed blocks below it stay resident, which is allocator
slack). The rows marked "malloc default" leave glibc as it is. The model is the tests' GPT
(vocabulary 64): "activations" 2 blocks of d_model 192 over 128 tokens, "state" 4 blocks of
d_model 384 over 64 tokens; 16 samples per step.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(ROOT))
from _report import command_line, machine_line, update_section  # noqa: E402

SIZES = {
    "activations": {"n_layer": 2, "d_model": 192, "seq_len": 128, "samples": 32},
    "state": {"n_layer": 4, "d_model": 384, "seq_len": 64, "samples": 32},
}
PIPELINE = {"name": "pipeline", "pipeline_balance": "uniform"}
# name -> (ranks, size, [strategy], other sections, fixed mmap threshold)
CONFIGS: dict[str, tuple[int, str, dict[str, Any], dict[str, Any], bool]] = {
    "ddp": (2, "activations", {"name": "ddp"}, {}, True),
    "ddp, state": (2, "state", {"name": "ddp"}, {}, True),
    "ddp, malloc default": (2, "activations", {"name": "ddp"}, {}, False),
    "ddp, 2 micro-batches": (2, "activations", {"name": "ddp"}, {"micro": 2}, True),
    "ddp, bf16-mixed": (2, "activations", {"name": "ddp"}, {"precision": "bf16-mixed"}, True),
    "ddp, checkpointing full": (
        2,
        "activations",
        {"name": "ddp"},
        {"activation_checkpointing": "full"},
        True,
    ),
    "allreduce": (2, "activations", {"name": "allreduce"}, {}, True),
    "localsgd": (2, "activations", {"name": "localsgd"}, {}, True),
    "fsdp": (2, "activations", {"name": "fsdp"}, {}, True),
    "fsdp, state": (2, "state", {"name": "fsdp"}, {}, True),
    "fsdp, state, malloc default": (2, "state", {"name": "fsdp"}, {}, False),
    "fsdp, 2 micro-batches": (2, "activations", {"name": "fsdp"}, {"micro": 2}, True),
    "fsdp, meta init": (2, "state", {"name": "fsdp"}, {"meta_init": True}, True),
    "fsdp, every:2": (
        2,
        "activations",
        {"name": "fsdp"},
        {"activation_checkpointing": "every:2"},
        True,
    ),
    "fsdp, bf16-mixed, every:2": (
        2,
        "activations",
        {"name": "fsdp"},
        {"precision": "bf16-mixed", "activation_checkpointing": "every:2"},
        True,
    ),
    "hybrid fsdp 2 x 2": (4, "state", {"name": "fsdp", "dp_replicate": 2}, {}, True),
    "tensor": (2, "activations", {"name": "tensor"}, {}, True),
    "pipeline 1f1b": (2, "activations", PIPELINE, {"micro": 2}, True),
    "pipeline 1f1b, state": (2, "state", PIPELINE, {"micro": 2}, True),
    "pipeline 2 x fsdp 2, state": (
        4,
        "state",
        {**PIPELINE, "pipeline_stages": 2, "data_parallel": "fsdp"},
        {"micro": 2},
        True,
    ),
    "pipeline 2 x fsdp 2, state, no reshard": (
        4,
        "state",
        {
            **PIPELINE,
            "pipeline_stages": 2,
            "data_parallel": "fsdp",
            "reshard_after_forward": False,
        },
        {"micro": 2},
        True,
    ),
    "pipeline gpipe, 4 micro-batches": (
        2,
        "activations",
        {**PIPELINE, "pipeline_schedule": "gpipe"},
        {"micro": 4},
        True,
    ),
}


def config(
    run_dir: Path, size: dict[str, Any], strategy: dict[str, Any], extra: dict[str, Any]
) -> dict[str, Any]:
    from tests.conftest import tiny_raw

    train = {"steps": 4, "log_every": 1}
    for key in ("precision", "activation_checkpointing"):
        if key in extra:
            train[key] = extra[key]
    task = dict(size)
    if extra.get("meta_init"):
        task["meta_init"] = True
    return tiny_raw(
        run_dir,
        task=task,
        strategy=strategy,
        train=train,
        optim={"name": "adamw", "lr": 1e-3, "warmup_steps": 0},
        data={"global_batch_size": 16, "micro_batches": extra.get("micro", 1)},
    )


def measure(name: str, root: Path) -> dict[str, float]:
    from tests.estimate_helpers import peak_after_warm_up, peak_after_warm_up_default_malloc
    from tests.ranks import run_ranks

    from dtrain.estimate import estimate_memory
    from dtrain.train.job import build_job_config

    ranks, size, strategy, extra, fixed = CONFIGS[name]
    slug = name.replace(" ", "").replace(",", "-").replace(":", "")
    raw = config(root / slug, SIZES[size], strategy, extra)
    tiny = {"n_layer": 2, "d_model": 32, "seq_len": 16}
    warm_up = config(root / f"{slug}-warm", tiny, strategy, {**extra, "meta_init": False})
    fn = peak_after_warm_up if fixed else peak_after_warm_up_default_malloc
    started = time.perf_counter()
    peaks = run_ranks(fn, ranks, raw, warm_up, timeout=1800)
    estimate = estimate_memory(build_job_config(raw), ranks)
    return {
        "estimate": estimate.peak,
        "measured": max(peaks),
        "phase": estimate.peak_phase,  # type: ignore[dict-item]
        "seconds": time.perf_counter() - started,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="", help="run the configs whose name contains this")
    parser.add_argument("--write-docs", action="store_true", help="update docs/benchmarks.md")
    args = parser.parse_args()
    import tempfile

    names = [name for name in CONFIGS if args.only in name]
    rows = []
    measured: dict[str, float] = {}
    with tempfile.TemporaryDirectory(prefix="bench-estimate-") as tmp:
        for name in names:
            result = measure(name, Path(tmp))
            measured[name] = result["measured"]
            ratio = result["estimate"] / result["measured"]
            ranks, size = CONFIGS[name][:2]
            rows.append(
                f"| {name} | {ranks} | {size} | {result['estimate'] / 2**20:.1f} | "
                f"{result['measured'] / 2**20:.1f} | **{ratio:.2f}** | {result['phase']} |"
            )
            print(rows[-1], f"({result['seconds']:.0f}s)", flush=True)
    lines = [
        "| config | ranks | model | estimated peak (MiB) | measured peak (MiB) | estimated / "
        "measured | peak phase (estimate) |",
        "|---|---:|---|---:|---:|---:|---|",
        *rows,
    ]
    print("\n".join(lines))
    if args.write_docs:
        body = doc_body(lines, command_line(), slack_note(measured))
        print(f"wrote {update_section('bench_estimate', body)}")


MALLOC_DEFAULT = ", malloc default"


def slack_note(measured: dict[str, float]) -> str:
    """What glibc's malloc as it comes adds: each "malloc default" row's measured peak against
    the same config's with freed blocks returned."""
    gaps = [
        f"{name.removesuffix(MALLOC_DEFAULT)!r} {(peak - measured[base]) / 2**20:.1f} MiB"
        for name, peak in measured.items()
        if name.endswith(MALLOC_DEFAULT) and (base := name.removesuffix(MALLOC_DEFAULT)) in measured
    ]
    return (
        'Outside 0.85..1.15: the "malloc default" rows, each its config with glibc\'s malloc as '
        "it comes; what that adds to the measured peak is allocator slack (freed blocks below "
        "glibc's growing mmap threshold stay resident), not counted"
        + (f": {', '.join(gaps)}." if gaps else ".")
    )


NOTE = (
    "The bf16-mixed rows count oneDNN's compiled kernels for the distinct bfloat16 matrix "
    "products (12 here, the output projection running in float32; 584 KiB each: 6.8 MiB; "
    "src/dtrain/estimate/kernels.py says how it was measured). Pipeline 2 x fsdp 2: torch's "
    "pipeline turns resharding after backward and gradient sync off for every micro-batch, "
    "so from a stage's first backward on its layers stay gathered and its gradients whole; "
    "a layer resharded after a later forward is gathered again, its block-sized all-gather "
    "buffer beside (seen on a real step: 5 blocks unsharded on the last stage, FSDP's own "
    "state read after every operation; on the first stage a 6.8 MiB buffer from aten.empty "
    "at the peak, besides its 2 gathered blocks and their gradients). Without resharding "
    "after forward (strategy.reshard_after_forward = false) every layer stays gathered from "
    "its first forward on and none is gathered again."
)


def doc_body(lines: list[str], command: str, slack: str) -> str:
    return "\n".join(
        [
            "## Memory estimate (`bench_estimate.py`)",
            "",
            f"Command: `{command}`  ",
            f"Machine: {machine_line()}  ",
            f"Date: {time.strftime('%Y-%m-%d')}; the largest peak over the ranks, each config "
            "in fresh processes after a warm-up run of its strategy; 3 AdamW steps of 16 "
            "samples (bench_estimate.py's docstring says how it is measured)",
            "",
            *lines,
            "",
            slack,
            "",
            NOTE,
        ]
    )


if __name__ == "__main__":
    main()
