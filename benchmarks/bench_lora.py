"""LoRA against a full fine-tune of the same model: bytes sent per step, checkpoint size, step
time (issue 43).

The model: a Hugging Face GPT-2 built from a config (``--layers``, ``--width``; nothing is
downloaded) through examples/hf_gpt2_lora.py, once with LoRA adapters (rank ``--rank`` on
``c_attn`` and both ``c_proj``: the base frozen) and once without (every weight trained). Both
train ``--steps`` steps under ddp on 2 ranks (gloo on loopback), AdamW, one checkpoint at the
end; rounds alternate the order (LoRA first, then full first, ...), in one launch. Per variant:
rank 0's bytes sent per step (the train records' ``comm_bytes_per_step``), the final
checkpoint's bytes on disk (every file of its ``step-N`` folder: model, optimizer, RNG, train
state, meta), and the median step time of the train records after the first (the median over
rounds of each).

    .venv/bin/python benchmarks/bench_lora.py                  # prints the figures
    .venv/bin/python benchmarks/bench_lora.py --write-docs     # also updates docs/benchmarks.md
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _report import ROOT, write_report_section

sys.path.insert(0, str(ROOT))  # examples/ and tests/: the aids of a source checkout
from tests.ranks import run_ranks

VARIANTS = ("lora", "full")


def job(run_dir: Path, lora: bool, args: argparse.Namespace) -> dict[str, Any]:
    return {
        "run": {"dir": str(run_dir), "task": "examples.hf_gpt2_lora:build", "seed": 0},
        "data": {"global_batch_size": args.batch, "prefetch": 0},
        "train": {"steps": args.steps, "log_every": 1},
        "optim": {"lr": 1e-3, "warmup_steps": 0},
        "eval": {"every": 0, "max_samples": 16},
        "checkpoint": {"every": 0, "async_save": False},
        "task": {
            "n_layer": args.layers,
            "n_embd": args.width,
            "n_head": max(1, args.width // 64),
            "vocab": args.vocab,
            "seq_len": args.seq_len,
            "train_size": args.batch * args.steps,
            "val_size": 16,
            "lora": lora,
            "lora_r": args.rank,
            "lora_alpha": 2 * args.rank,
        },
    }


def train_rounds(root: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    """In each rank: every round trains both variants (order alternating); rank 0 reads what
    each run recorded."""
    from dtrain.train.job import build_job_config, build_trainer

    measured = []
    for round_ in range(args.rounds):
        order = VARIANTS if round_ % 2 == 0 else VARIANTS[::-1]
        for variant in order:
            run_dir = Path(root) / f"{variant}-{round_}"
            build_trainer(build_job_config(job(run_dir, variant == "lora", args))).fit()
            records = [json.loads(line) for line in (run_dir / "metrics.jsonl").open()]
            train = [r for r in records if r.get("kind") == "train"][1:]  # after the first
            step_dir = max((run_dir / "checkpoints").glob("step-*"))
            measured.append(
                {
                    "variant": variant,
                    "bytes_per_step": statistics.median(r["comm_bytes_per_step"] for r in train),
                    "step_s": statistics.median(r["step_time_s"] for r in train),
                    "checkpoint_bytes": sum(
                        f.stat().st_size for f in step_dir.rglob("*") if f.is_file()
                    ),
                    "params": train[0]["param_bytes_rank0"] // 4,
                }
            )
    return measured


def report(measured: list[dict[str, Any]], args: argparse.Namespace) -> str:
    def median(variant: str, key: str) -> float:
        return statistics.median(m[key] for m in measured if m["variant"] == variant)

    lines = [
        f"GPT-2 ({args.layers} layers, width {args.width}, vocab {args.vocab}, "
        f"{median('full', 'params') / 1e6:.2f} M parameters), LoRA rank {args.rank} on c_attn "
        f"and c_proj; ddp on 2 ranks, AdamW, global batch {args.batch} x {args.seq_len} tokens, "
        f"{args.steps} steps, {args.rounds} rounds",
        "",
        "| | LoRA | full fine-tune | LoRA / full |",
        "|---|---|---|---|",
    ]
    for key, name, unit, scale in (
        ("bytes_per_step", "bytes sent per step (rank 0)", "kB", 1e3),
        ("checkpoint_bytes", "checkpoint on disk", "kB", 1e3),
        ("step_s", "step time", "ms", 1e-3),
    ):
        lora, full = median("lora", key), median("full", key)
        lines.append(
            f"| {name} | {lora / scale:,.1f} {unit} | {full / scale:,.1f} {unit} | "
            f"{lora / full:.3f}x |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--write-docs", action="store_true")
    args = parser.parse_args()
    root = tempfile.mkdtemp(prefix="dtrain-bench-lora-")
    try:
        measured = run_ranks(train_rounds, 2, root, args, timeout=3600)[0]
    finally:
        shutil.rmtree(root, ignore_errors=True)
    text = report(measured, args)
    print(text)
    if args.write_docs:
        write_report_section(
            "bench_lora",
            "LoRA against a full fine-tune (`bench_lora.py`)",
            text,
            "2 ranks (gloo), one thread each",
        )


if __name__ == "__main__":
    main()
