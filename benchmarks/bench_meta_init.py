"""Meta-device initialization under FSDP: where each rank's memory goes, and what building the
model on the meta device saves -- a model whose whole state does not fit one rank's memory
limit trains when each rank makes only its shard (task.meta_init), and fails when every rank
first builds the whole model.

    sudo python benchmarks/bench_meta_init.py --write-docs   # root: cgroup v1 memory limits
    python benchmarks/bench_meta_init.py --n-layer 4 --ranks 4  # a smaller, quicker model

The default job's GPT made large (12 blocks, d_model 768: 85 M parameters, 326 MiB of fp32
weights, 1,302 MiB with gradients and AdamW's two moments), fsdp on 4 and on 8 ranks, 2 AdamW
steps (the second is the steady state: AdamW's moments exist from the first step on), one
sequence of 128 bytes per rank with activation checkpointing on every block (so that the
model's state and FSDP, not activations, are what is measured; a run without checkpointing
shows the activations' part; a run with ``strategy.backward_prefetch = false`` shows what
FSDP's backward prefetching costs: each block is then gathered when its own backward begins).
Each rank's resident memory is read at the boundaries of the phases (set-up, forward, backward,
optimizer step, the end of the run) and its peak within each phase (the kernel's VmHWM, reset
at every boundary), above its size before the trainer was built. A rank's share is a quarter (4
ranks) or an eighth (8 ranks) of the whole model's weights, gradients and AdamW state: 4 x the
bytes of the weights it holds.

Then both builds run again, each rank in a cgroup of its own from its start on (a cgroup v1
memory limit on what it allocates from there: this kernel does not move what a process held
before into its new group) with a limit between the two builds' peaks (their mean).
Target: the meta-built peak <= 1.3 x the rank's share (above its start).
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import os
import re
import shutil
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _report import ROOT, command_line, machine_line, update_section

sys.path.insert(0, str(ROOT))  # tests/: the test aids of a source checkout
from tests.ranks import RankFailed, run_ranks

CGROUP = Path("/sys/fs/cgroup/memory")
MIB = 2**20
# The phases of a run, in the order a step passes them; "end" is from the last optimizer
# step to the end of fit (the final checkpoint, the task's after-training hook).
PHASES = ("set-up", "forward", "backward", "optimizer step", "end")


def status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


class PhaseMeter:
    """Each phase's peak resident size above ``start``, the largest over the steps; the
    phase that ended last is written to ``trail`` (read when the kernel killed the rank)."""

    def __init__(self, trail: Path) -> None:
        self.trail = trail
        self.start = status_kib("VmRSS")
        self.peaks: dict[str, int] = {}
        self.last = ""
        Path("/proc/self/clear_refs").write_text("5")  # VmHWM <- VmRSS

    def mark(self, phase: str) -> None:
        """``phase`` has just ended."""
        peak = (status_kib("VmHWM") - self.start) * 1024
        self.peaks[phase] = max(self.peaks.get(phase, 0), peak)
        self.last = phase
        self.trail.write_text(phase)
        Path("/proc/self/clear_refs").write_text("5")

    def extend(self) -> None:
        """What ran since the last phase ended counts to it (loading a batch, zeroing the
        gradients: the size they start from is that phase's end)."""
        self.mark(self.last)


def without_evaluation(trainer: Any) -> Any:
    """The trainer without its final evaluation over the whole validation set (hours for
    this model on this machine; the peak of interest is training's)."""
    trainer.evaluate = lambda max_samples=0: None
    return trainer


def enter_cgroup(limit_bytes: int, rank: int) -> None:
    group = CGROUP / f"dtrain-bench-meta-{os.environ['DTRAIN_BENCH_META_PID']}-{rank}"
    group.mkdir(exist_ok=True)
    # What the process holds already stays charged where it was (this kernel cannot move
    # charges): the group counts what the rank allocates from now on.
    (group / "memory.limit_in_bytes").write_text(str(limit_bytes))
    swap = group / "memory.memsw.limit_in_bytes"  # no way around the limit through swap
    if swap.exists():
        swap.write_text(str(limit_bytes))
    (group / "cgroup.procs").write_text(str(os.getpid()))


def train_rank(raw: dict[str, Any], limit_bytes: int) -> dict[str, Any]:
    """In a rank: build the trainer and train (with a memory limit of ``limit_bytes`` on what
    it allocates from the start of the build, when given); each phase's peak above the size
    before the trainer was built, that size, the rank's weights, the second step's time and
    the final loss."""
    import torch.distributed as dist

    from dtrain.train.job import build_job_config, build_trainer

    # A tiny model trained first, in the same process, so that what any first run loads or
    # allocates once (lazy imports, the process group's buffers, the allocator's arenas) is
    # in the baseline, not in the peak.
    warm = {**raw, "run": {"dir": raw["run"]["dir"] + "-warm-up"}}
    warm["task"] = {**raw["task"], "n_layer": 1, "d_model": 96}
    without_evaluation(build_trainer(build_job_config(warm))).fit()
    cfg = build_job_config(raw)
    gc.collect()
    dist.barrier()
    if limit_bytes:
        enter_cgroup(limit_bytes, dist.get_rank())
    meter = PhaseMeter(Path(raw["run"]["dir"] + f"-rank{dist.get_rank()}"))
    trainer = without_evaluation(build_trainer(cfg))
    model, optimizer = trainer.strategy.model, trainer.optimizer
    meter.mark("set-up")
    step_ends: list[float] = []
    model.register_forward_pre_hook(lambda *_: meter.extend())
    model.register_forward_hook(lambda *_: meter.mark("forward"))
    optimizer.register_step_pre_hook(lambda *_: meter.mark("backward"))  # + loss, clipping
    optimizer.register_step_post_hook(lambda *_: meter.mark("optimizer step"))
    optimizer.register_step_post_hook(lambda *_: step_ends.append(time.perf_counter()))
    trainer.fit()
    meter.mark("end")
    digest = hashlib.sha256()  # of the rank's shards of the trained weights: equal runs
    for param in trainer.strategy.unwrapped.parameters():
        digest.update(param.detach().to_local().numpy().tobytes())
    block = trainer.strategy.unwrapped.blocks[0]  # a DTensor's numel is the whole one's
    return {
        "peaks": meter.peaks,
        "start": meter.start * 1024,
        "weights": trainer.strategy.parameter_bytes(),
        "block": sum(p.numel() * p.element_size() for p in block.parameters()),
        "step": step_ends[-1] - step_ends[-2],  # the second step: optimizer end to end
        "digest": digest.hexdigest(),
    }


def config(
    run_dir: Path, meta: bool, checkpointing: bool, prefetch: bool, ranks: int, args: Any
) -> dict[str, Any]:
    return {
        "run": {"dir": str(run_dir)},
        "strategy": {"name": "fsdp", "backward_prefetch": prefetch},
        "train": {
            "steps": 2,
            "log_every": 1,
            "activation_checkpointing": "full" if checkpointing else "none",
        },
        "data": {"global_batch_size": ranks * args.sequences, "prefetch": 0},
        "eval": {"every": 0, "max_samples": 8, "batch_size": 2},
        "checkpoint": {"every": 0},
        "optim": {"warmup_steps": 0},
        "task": {
            "meta_init": meta,
            "n_layer": args.n_layer,
            "d_model": args.d_model,
            "n_head": 12,
            "generate_tokens": 0,
        },
    }


def cleanup() -> None:
    for group in CGROUP.glob(f"dtrain-bench-meta-{os.getpid()}-*"):
        for _ in range(50):
            try:
                group.rmdir()
                break
            except OSError:
                time.sleep(0.1)


# glibc's malloc raises its mmap threshold to the largest block freed (up to 32 MiB), after
# which a model's tensors come from the heap, whose freed pages it keeps: the resident peak
# then counts memory torch has given back. A fixed threshold returns large blocks to the
# kernel when freed, so the peak is what was live.
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": "131072"}
# The ranks name their cgroups after this process, which removes them (a rank's parent may be
# a fork server, not this process).
RANK_ENV = {"DTRAIN_BENCH_META_PID": str(os.getpid())}

# The limited runs are made where the whole build peaks this much above the meta build (a
# cgroup also charges the page cache, the page tables: a limit needs room on both sides).
SEPARATE = 1.1
# The runs at each world size: (meta-built, activation checkpointing, FSDP's backward
# prefetching: strategy.backward_prefetch).
RUNS = {
    "meta-built": (True, True, True),
    "built whole": (False, True, True),
    "meta-built, no checkpointing": (True, False, True),
    "meta-built, backward_prefetch = false": (True, True, False),
}


def launch(scratch: Path, name: str, ranks: int, args: Any, limit: int = 0) -> list[dict[str, Any]]:
    meta, checkpointing, prefetch = RUNS[name]
    folder = scratch / f"{ranks}-{name.replace(' ', '_').replace(',', '')}-{limit}"
    raw = config(folder, meta, checkpointing, prefetch, ranks, args)
    try:
        return run_ranks(
            train_rank,
            ranks,
            raw,
            limit,
            timeout=3600,
            env=RANK_ENV,
            collective_timeout=600,
        )
    except RankFailed as exc:
        first = str(exc).splitlines()[0]
        found = re.match(r"rank (\d+)", first)
        if found and "-9" in first:  # SIGKILL: the kernel's OOM killer, at the limit
            trail = Path(f"{folder}-rank{found[1]}")
            done = trail.read_text() if trail.exists() else ""  # the last phase it ended
            after = PHASES[min(PHASES.index(done) + 1, len(PHASES) - 1)] if done else PHASES[0]
            raise RankFailed(f"rank {found[1]} killed by the kernel in {after}") from None
        raise
    finally:
        for trail in scratch.glob(f"{folder.name}-rank*"):
            trail.unlink()
        shutil.rmtree(folder, ignore_errors=True)
        shutil.rmtree(str(folder) + "-warm-up", ignore_errors=True)
        cleanup()


def measure(scratch: Path, ranks: int, args: Any) -> dict[str, Any]:
    """The free runs at ``ranks``, then the two builds under a limit between their peaks."""
    free = {}
    for name in RUNS:
        results = launch(scratch, name, ranks, args)
        peaks = {p: max(r["peaks"].get(p, 0) for r in results) for p in PHASES}
        free[name] = {
            "phases": peaks,
            "peak": max(peaks.values()),
            "start": max(r["start"] for r in results),
            "weights": max(r["weights"] for r in results),
            "block": results[0]["block"],
            "step": max(r["step"] for r in results),
            "digests": [r["digest"] for r in results],
        }
        print(f"{ranks} ranks, {name}: peak {free[name]['peak'] / MIB:.0f} MiB", flush=True)
    meta, whole = free["meta-built"], free["built whole"]
    start = max(meta["start"], whole["start"])
    limit = int((meta["peak"] + whole["peak"]) / 2)  # above the start
    outcome = {}
    for name in ("meta-built", "built whole"):
        if whole["peak"] < SEPARATE * meta["peak"]:
            outcome[name] = "not run: no limit lies clearly between the peaks"
            continue
        try:
            launch(scratch, name, ranks, args, limit)
            outcome[name] = "trained"
        except RankFailed as exc:
            outcome[name] = "failed: " + str(exc).splitlines()[0][:100]
        print(f"{ranks} ranks, {name}, start + {limit / MIB:.0f} MiB: {outcome[name]}", flush=True)
    return {
        "free": free,
        "limit": limit,
        "start": start,
        "outcome": outcome,
        "estimate": estimated_peak(scratch, ranks, args),
    }


def estimated_peak(scratch: Path, ranks: int, args: Any) -> int:
    """``dtrain estimate``'s peak for the meta-built run (the model on the meta device)."""
    from dtrain.estimate import estimate_memory
    from dtrain.train.job import build_job_config

    raw = config(scratch / "estimate", True, True, True, ranks, args)
    return estimate_memory(build_job_config(raw), ranks).peak


def report(ranks: int, result: dict[str, Any]) -> list[str]:
    free = result["free"]
    weights = free["meta-built"]["weights"]
    share = 4 * weights  # weights, gradients, AdamW's 2 moments
    whole_state = ranks * share
    limit, start = result["limit"], result["start"]
    limited = f"limited to the start + {limit / MIB:,.0f} MiB"
    if result["outcome"]["meta-built"].startswith("not run"):
        limited = "under a limit"
    lines = [
        f"**{ranks} ranks.** A rank's share: weights W = {weights / MIB:,.1f} MiB, "
        f"gradients W, AdamW's moments 2W: {share / MIB:,.1f} MiB (the whole model's "
        f"{whole_state / MIB:,.0f} MiB / {ranks}); the whole fp32 weights: "
        f"{ranks * weights / MIB:,.0f} MiB = {ranks / 4:g}x the share. Start of a rank "
        f"(torch, the process group): {start / MIB:,.0f} MiB.",
        "",
        "| build | " + " | ".join(PHASES) + f" | peak | x share | step 2 (s) | {limited} |",
        "|---|" + "---:|" * (len(PHASES) + 3) + "---|",
    ]
    for name, run in free.items():
        cells = [f"{run['phases'][p] / MIB:,.0f}" for p in PHASES]
        ratio = f"{run['peak'] / share:.2f}x"
        if name == "meta-built":
            ratio = f"**{ratio}**"
        lines.append(
            f"| {name} | {' | '.join(cells)} | {run['peak'] / MIB:,.0f} | {ratio} "
            f"| {run['step']:.1f} | {result['outcome'].get(name, '(not run)')} |"
        )
    meta = free["meta-built"]
    meta_peak, phases, block = meta["peak"], meta["phases"], meta["block"]
    quiet = free["meta-built, backward_prefetch = false"]
    same = "bit-identical" if quiet["digests"] == meta["digests"] else "NOT identical"
    plain = free["meta-built, no checkpointing"]["peak"]

    def beyond(phase: str, held: int, unit: int, name: str, what: str) -> str:
        """The phase's peak as ``held`` x W and the rest, in ``unit``s."""
        rest = phases[phase] - held * weights
        return (
            f"{phase} {phases[phase] / MIB:,.0f} = {held}W + {rest / MIB:,.0f} "
            f"({rest / unit:.1f}{name}: {what})"
        )

    lines += [
        "",
        f"Meta-built peak / share: {meta_peak / MIB:,.0f} / {share / MIB:,.0f} MiB = "
        f"**{meta_peak / share:.2f}x** (target <= 1.3x: "
        f"{'met' if meta_peak <= 1.3 * share else 'not met'}). Where it goes, in MiB, with "
        f"B = {block / MIB:,.1f} MiB one block's fp32 weights: "
        f"{beyond('set-up', 1, weights, 'W', 'the module being made whole')}; "
        + beyond("forward", 3, block, "B", "FSDP's gathered blocks, a block's recomputation")
        + "; "
        + beyond(
            "backward",
            4,
            block,
            "B",
            "a block's gathered parameters and unsharded gradients, the next block's prefetched "
            "all-gather buffer, the last block's reduce-scatter input",
        )
        + "; "
        + beyond("optimizer step", 4, weights, "W", "AdamW's foreach temporaries")
        + ". 3W: weights and moments; 4W: and the gradients (nearly all made by the "
        "backward's peak). Without activation checkpointing the peak is "
        f"{plain / MIB:,.0f} MiB ({plain / meta_peak:.2f}x this one). Without FSDP's "
        "backward prefetching (`strategy.backward_prefetch = false`: each block gathered "
        f"when its own backward begins) the "
        f"backward's peak is {quiet['phases']['backward'] / MIB:,.0f} MiB "
        f"({(phases['backward'] - quiet['phases']['backward']) / block:.1f}B less), the "
        f"peak {quiet['peak'] / share:.2f}x the share; the trained weights are {same} "
        f"on every rank; step 2 {quiet['step']:.1f} s against {meta['step']:.1f} s. "
        f"`dtrain estimate` of the meta-built run: peak {result['estimate'] / MIB:,.0f} MiB "
        f"({result['estimate'] / meta_peak:.2f}x the measured).",
    ]
    if limited != "under a limit":
        lines += [
            "",
            f"The limit above the start, {limit / MIB:,.0f} MiB, is {limit / whole_state:.2f}x "
            "the whole model's weights, gradients and AdamW state and "
            f"{limit / (ranks * weights):.2f}x its fp32 weights.",
        ]
    return lines


def main() -> None:
    if any(os.environ.get(k) != v for k, v in MALLOC_ENV.items()):
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, **MALLOC_ENV})
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n-layer", type=int, default=12)
    parser.add_argument("--d-model", type=int, default=768)
    parser.add_argument("--ranks", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--sequences", type=int, default=1, help="of 128 bytes per rank")
    parser.add_argument("--write-docs", action="store_true", help="update docs/benchmarks.md")
    args = parser.parse_args()
    if os.geteuid() != 0 or not (CGROUP / "cgroup.procs").exists():
        raise SystemExit("needs root and the cgroup v1 memory controller at /sys/fs/cgroup/memory")
    scratch = Path(f"/tmp/dtrain-bench-meta-{os.getpid()}")
    started = time.time()
    try:
        results = {ranks: measure(scratch, ranks, args) for ranks in args.ranks}
    finally:
        cleanup()
        shutil.rmtree(scratch, ignore_errors=True)
    lines = [
        f"GPT {args.n_layer} x d{args.d_model}, {args.sequences} sequence(s) of 128 bytes "
        "per rank, 2 AdamW steps (foreach); MiB above each rank's start, the largest rank's "
        "peak within each phase (backward includes the loss and gradient clipping; end: the "
        "final checkpoint and the task's after-training hook); activation checkpointing on "
        "every block unless the row says otherwise.",
        "",
    ]
    for ranks, result in results.items():
        lines += [*report(ranks, result), ""]
    print("\n".join(lines))
    print(f"{time.time() - started:.0f} s")
    if args.write_docs:
        body = "\n".join(
            [
                "## Meta-device initialization under FSDP (`bench_meta_init.py`)",
                "",
                f"Command: `sudo {command_line()}`  ",
                f"Machine: {machine_line()}  ",
                f"Date: {time.strftime('%Y-%m-%d')}; glibc's mmap threshold fixed at 128 KiB "
                "(MALLOC_MMAP_THRESHOLD_), so freed tensors leave the resident size; each "
                "rank's limit is a cgroup v1 memory limit on what it allocates from its start "
                "on (page cache included), set at the mean of the two builds' peaks.",
                "",
                *lines,
                "Target: the meta-built peak <= 1.3x the rank's share of weights, gradients and "
                "optimizer state (above the runtime's baseline, the rank's start). What FSDP holds "
                "beyond the share at the peak is about 4 blocks' weights at either world size "
                "(torch's FSDP2 in backward: a block's gathered parameters and their unsharded "
                "gradients, the next block's prefetched all-gather buffer, the last block's "
                "reduce-scatter input, which torch keeps until the next reduce-scatter; "
                "src/dtrain/estimate/fsdp.py), while the share falls as 1/N: with the blocks "
                "holding nearly all the weights, the ratio is about 1 + N / (number of blocks) "
                "-- 1.3x needs N <= 0.3 x the blocks. Without the backward prefetch "
                "(`strategy.backward_prefetch = false`, opt-in: on a GPU the prefetch overlaps "
                "each all-gather with the backward before it) FSDP holds 3 blocks: about "
                "1 + 0.75 N / (number of blocks). On 4 "
                "ranks a rank's share equals the whole fp32 weights, so building the model whole "
                "costs no more than training does (equal peaks); on 8 the whole build is the "
                "peak, and only the meta build trains under a limit below it. Step 2 is one "
                "step's wall time in each run, on 2 cores shared with other jobs: no speed "
                "comparison (on CPU gloo's all-gathers are synchronous, so the prefetch has "
                "nothing to overlap here; on a GPU it hides each block's all-gather behind "
                "the backward before it).",
            ]
        )
        print(f"wrote {update_section('bench_meta_init', body)}")


if __name__ == "__main__":
    main()
