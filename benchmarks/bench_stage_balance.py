"""Pipeline stage balance: equal layer counts, the per-layer profile, and the profile refined by
timing the plan's stages as cut -- side by side in one run.

The question: when the balancer cuts a chain of unequal layers into K stages, how close to
equal are the stages when they run as a pipeline runs them (each stage's input detached, its
backward a call of its own)? A pipeline runs at the pace of its slowest stage, so each plan is
judged by slowest stage / mean stage (1.00 = perfectly balanced).

Per model, each trial plans afresh (profile, balance; then, for the refined plan, up to two
rounds of timing the stages and correcting the layer costs: ``dtrain.parallel.pipeline.refine``) and
then times the three plans side by side, a repeat running every plan once, with
``time.thread_time`` and one intra-op thread, so that time this process spends preempted is
not counted. The table gives the median trial and the range, and what planning cost.

Models: ``mlp`` is the chain of ``tests/test_balance.py`` (30 residual MLP blocks of width
w, then three times [3 blocks 8x as wide, 6 of width w]; 4 stages) at two widths -- the
narrower one is closer to what a faster CPU sees, where fixed per-layer costs weigh more;
``gpt`` is the default GPT as the pipeline cuts it (embeddings, 4 blocks, head; 2 stages).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from dtrain.models.gpt import GPT, GPTConfig
from dtrain.parallel.pipeline.profile import balance_layers
from dtrain.parallel.pipeline.refine import time_plans
from dtrain.parallel.pipeline.stages import StagePlan, plan_from_bounds, uniform_bounds

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _report import ROOT, write_report_section

sys.path.insert(0, str(ROOT))  # tests/: the test aids of a source checkout
from tests.chains import unequal_mlp_chain

SECTION = "bench_stage_balance"
VARIANTS = ("equal layers", "profiled", "refined")


def gpt_chain() -> tuple[list[nn.Module], torch.Tensor]:
    cfg = GPTConfig()
    return GPT(cfg).pipeline_layers(), torch.randint(0, cfg.vocab_size, (8, cfg.seq_len))


def imbalance(seconds: list[float]) -> float:
    return max(seconds) / statistics.mean(seconds)


def trial(
    layers: list[nn.Module], x: torch.Tensor, stages: int, repeats: int
) -> tuple[dict[str, StagePlan], dict[str, float], dict[str, float]]:
    """One trial: the three plans, what planning cost (seconds), and each plan's imbalance."""
    clock: Callable[[], float] = time.thread_time
    plans = {
        "equal layers": plan_from_bounds([1.0] * len(layers), uniform_bounds(len(layers), stages))
    }
    cost = {}
    for name, rounds in (("profiled", 0), ("refined", 2)):
        started = time.perf_counter()
        plans[name], _ = balance_layers(
            layers, x, stages, repeats=repeats, refine_rounds=rounds, clock=clock
        )
        cost[name] = time.perf_counter() - started
    timed = time_plans(layers, x, [plans[v].bounds for v in VARIANTS], repeats, clock)
    return plans, cost, {v: imbalance(t) for v, t in zip(VARIANTS, timed, strict=True)}


def run_model(
    name: str, layers: list[nn.Module], x: torch.Tensor, stages: int, trials: int, repeats: int
) -> list[str]:
    results = [trial(layers, x, stages, repeats) for _ in range(trials)]
    lines = [f"{name}: {len(layers)} layers, {stages} stages, {trials} trials"]
    for variant in VARIANTS:
        values = [r[2][variant] for r in results]
        bounds = sorted({r[0][variant].bounds for r in results})
        shown = ", ".join(str(b) for b in bounds[:3]) + (" ..." if len(bounds) > 3 else "")
        lines.append(
            f"  {variant:>12}: slowest/mean {statistics.median(values):.3f} "
            f"(trials {min(values):.3f}-{max(values):.3f}); bounds {shown}"
        )
    gain = [r[2]["profiled"] / r[2]["refined"] for r in results]
    lines.append(
        f"  profiled / refined imbalance, same trial: {statistics.median(gain):.3f} "
        f"(trials {min(gain):.3f}-{max(gain):.3f})"
    )
    for variant in ("profiled", "refined"):
        spent = statistics.median(r[1][variant] for r in results)
        lines.append(f"  planning ({variant}): {spent:.2f} s")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--trials", type=int, default=7)
    parser.add_argument("--repeats", type=int, default=11, help="timed passes per measurement")
    parser.add_argument("--models", nargs="*", default=["mlp128", "mlp64", "gpt"])
    parser.add_argument("--write-docs", action="store_true")
    args = parser.parse_args()
    for model in args.models:  # before any timing: a typo should not cost a run
        if model != "gpt" and not (model.startswith("mlp") and model[3:].isdigit()):
            parser.error(f"--models: unknown model {model!r}; use mlp<width> or gpt")
    torch.manual_seed(0)
    torch.set_num_threads(1)
    lines: list[str] = []
    for model in args.models:
        if model == "gpt":
            layers, x = gpt_chain()
            part = run_model("gpt (default)", layers, x, 2, args.trials, args.repeats)
        else:
            layers, x = unequal_mlp_chain(int(model[3:]))
            part = run_model(f"mlp, width {model[3:]}", layers, x, 4, args.trials, args.repeats)
        print("\n".join(part), flush=True)
        lines += part
    report = "\n".join(lines)
    if args.write_docs:
        title = "Pipeline stage balance: equal layers, profiled, refined"
        setting = "1 process, 1 thread, thread CPU time"
        print(f"wrote {write_report_section(SECTION, title, report, setting)}")


if __name__ == "__main__":
    main()
