"""Checkpoint size against time (issue 30): save, verify and resume as the state grows, each
against this machine's own disk measured in the same run, by the same ranks, on the same bytes.

For each size of training state (model + optimizer, default 0.25, 1 and 4 GB) and each layout
-- ``replicated`` (ddp and the other replicated strategies: rank 0 writes the model and the
optimizer whole, every rank its RNG) and ``sharded`` (fsdp: every rank half, through
``torch.distributed.checkpoint``) -- two ranks (gloo, one process each) measure, in order:

- ``disk write``: the same bytes written by the same ranks as plain files (64 MiB writes,
  fsync): the baseline of a save;
- ``save, blocking``: ``Checkpointer.save(blocking=True)``, from the call to the commit;
- ``save, async``: the time the loop is blocked (the snapshot), and to the commit;
- ``disk read``: every rank reads the bytes of its share of the verification (cold page cache:
  ``posix_fadvise(DONTNEED)`` on the files): the baseline of a verification, and of a resume;
- ``verify, rank 0 alone``: the way before issue 30 (``verify_checkpoint`` on rank 0 while the
  others waited in a collective), cold;
- ``verify, shared``: every rank its share, the words through the job's store
  (``resume.verify_together``), cold;
- ``resume``: ``resolve_resume`` (verification included) and the load of every part each rank
  loads (replicated: every rank loads the model and the optimizer; sharded: its shards), cold.

It also reports the longest time any rank spent in a collective during a save and during a
resume: only those waits are bounded by ``dist.timeout_s`` (default 300 s). The ratios are
dtrain's time over the disk's own (1.00x: the disk's speed).

    python benchmarks/bench_checkpoint_size.py                    # 0.25, 1, 4 GB (~15 min here)
    python benchmarks/bench_checkpoint_size.py --sizes 0.05 --no-docs

The folder (``--root``, default ``/tmp/dtrain-bench-ckpt-size``: the real disk here, not a
tmpfs) is removed at the end. Writes docs/benchmarks.md's section "bench_checkpoint_size".
"""

from __future__ import annotations

import argparse
import datetime
import os
import shutil
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from _report import ROOT, write_report_section

sys.path.insert(0, str(ROOT))  # tests/: the test aids of a source checkout
from tests.ranks import run_ranks

CHUNK = 64 * 2**20
TENSOR_FLOATS = 16 * 2**20  # 64 MB tensors, as a large model's layers are


# ---------------------------------------------------------------------------------------------
# Inside each rank


class Collectives:
    """Wall time spent inside the collectives that are bounded by the collective timeout."""

    def __init__(self) -> None:
        import torch.distributed as dist

        self.longest = 0.0
        self.paused = False
        for name in ("broadcast_object_list", "all_gather_object", "gather_object", "barrier"):
            setattr(dist, name, self._timed(getattr(dist, name)))

    def _timed(self, call: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            try:
                return call(*args, **kwargs)
            finally:
                if not self.paused:
                    self.longest = max(self.longest, time.perf_counter() - started)

        return timed

    @contextmanager
    def ours(self) -> Iterator[None]:
        """The benchmark's own barriers do not count."""
        self.paused = True
        try:
            yield
        finally:
            self.paused = False

    def take(self) -> float:
        longest, self.longest = self.longest, 0.0
        return longest


def make_state(total: int, layout: str, rank: int) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """This rank's part of a training state of ``total`` bytes: a third model, two thirds
    optimizer (Adam's two moments), in 64 MB tensors. Replicated: the files rank 0 writes
    (other ranks: none); sharded: this rank's half as DTensors."""
    import torch

    def tensors(nbytes: int) -> list[torch.Tensor]:
        out, left = [], nbytes // 4
        while left > 0:
            n = min(TENSOR_FLOATS, left)
            out.append(torch.empty(n).uniform_())
            left -= n
        return out

    if layout == "replicated":
        if rank != 0:
            return {}, None
        params = tensors(total // 3)
        moments = tensors(2 * total // 3)
        half = len(moments) // 2
        model = {f"layer{i}.weight": t for i, t in enumerate(params)}
        optimizer = {
            "state": {
                i: {"exp_avg": a, "exp_avg_sq": b, "step": torch.tensor(1.0)}
                for i, (a, b) in enumerate(zip(moments[:half], moments[half:]))
            },
            "param_groups": [{"lr": 1e-3, "params": list(range(half))}],
        }
        return {"model.pt": model, "optimizer.pt": optimizer}, None
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    mesh = init_device_mesh("cpu", (2,))
    local = tensors(total // 2)
    third = len(local) // 3
    sharded = {
        "model": {
            f"layer{i}.weight": DTensor.from_local(t, mesh, [Shard(0)])
            for i, t in enumerate(local[:third])
        },
        "optimizer": {
            f"state.{i}.exp_avg": DTensor.from_local(t, mesh, [Shard(0)])
            for i, t in enumerate(local[third:])
        },
    }
    return {}, sharded


def drop_cache(folder: Path) -> None:
    """Evict a folder's files from the page cache (their pages are clean: the writes were
    synced), so that the next read comes from the disk."""
    for path in folder.rglob("*"):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def raw_write(path: Path, nbytes: int) -> None:
    block = bytearray(os.urandom(1024)) * (CHUNK // 1024)
    with open(path, "wb") as fh:
        left = nbytes
        while left > 0:
            fh.write(memoryview(block)[: min(CHUNK, left)])
            left -= CHUNK
        fh.flush()
        os.fsync(fh.fileno())


def raw_read(step_dir: Path, pieces: list[Any]) -> int:
    """Read the byte ranges of ``pieces`` (no hashing); the bytes read."""
    done = 0
    buffer = bytearray(8 * 2**20)
    view = memoryview(buffer)
    for piece in pieces:
        with open(step_dir / piece.name, "rb", buffering=0) as fh:
            fh.seek(piece.start)
            left = piece.length
            while left > 0:
                got = fh.readinto(view[: min(left, len(view))])
                if not got:
                    break
                done += got
                left -= got
    return done


def measure_in_rank(root_text: str, total: int, layout: str, rounds: int) -> dict[str, float]:
    """Every measure ``rounds`` times, interleaved with its baseline; the fastest of each
    (this machine's disk is a virtual one, whose speed moves with its host's load: the
    fastest run is the one least disturbed)."""
    import torch
    import torch.distributed as dist

    from dtrain.checkpoint import read as ckread
    from dtrain.checkpoint import resume
    from dtrain.checkpoint.verify import assign
    from dtrain.checkpoint.write import Checkpointer
    from dtrain.config import Config
    from dtrain.dist.runtime import Runtime
    from dtrain.fault.peer_words import PeerWords
    from dtrain.fault.watchdog import Watchdog

    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    root = Path(root_text)
    timed = Collectives()
    out: dict[str, list[float]] = {}

    def together(name: str, work: Callable[[], Any]) -> Any:
        """Time ``work`` from a barrier to a barrier (the slower rank's time, on both)."""
        with timed.ours():
            dist.barrier()
        started = time.perf_counter()
        value = work()
        with timed.ours():
            dist.barrier()
        out.setdefault(name, []).append(time.perf_counter() - started)
        return value

    files, sharded = make_state(total, layout, rank)
    rng = {"rng": torch.get_rng_state()}
    meta = {"step": 0, "world_size": world} if rank == 0 else None
    state: dict[str, Any] = {"files": {f"rng-rank{rank:05d}.pt": rng, **files}, "sharded": sharded}
    del files, sharded
    # The bytes this rank writes: rank 0 all of a replicated state, every rank half of a
    # sharded one.
    bytes_here = total // world if layout == "sharded" else (total if rank == 0 else 0)
    runtime = Runtime(
        rank=rank,
        world_size=world,
        device=torch.device("cpu"),
        timeout=datetime.timedelta(seconds=300),
    )
    checkpointer = Checkpointer(
        root / "checkpoints", rank=rank, world_size=world, keep_last=1, keep_every=0
    )
    # Warm up: every code path of a save once, on a tiny state, elsewhere.
    Checkpointer(root / "warm-up", rank=rank, world_size=world, keep_last=1, keep_every=0).save(
        0, {f"rng-rank{rank:05d}.pt": rng}, meta, blocking=True
    )

    def save(step: int, blocking: bool) -> None:
        step_meta = meta and {**meta, "step": step}
        checkpointer.save(
            step, state["files"], step_meta, blocking=blocking, sharded=state["sharded"]
        )

    def save_async(step: int) -> None:
        started = time.perf_counter()
        save(step, False)
        out.setdefault("save, async: loop blocked", []).append(time.perf_counter() - started)
        assert checkpointer.wait() is None

    raw = root / f"raw-rank{rank}.bin"
    timed.take()
    step = 0
    for _ in range(rounds):
        # Disk write: the same bytes, as plain files, by the same ranks.
        together("disk write", lambda: raw_write(raw, bytes_here) if bytes_here else None)
        raw.unlink(missing_ok=True)
        step += 1
        together("save, blocking", lambda step=step: save(step, True))
        step += 1
        together("save, async", lambda step=step: save_async(step))
    longest_save = timed.take()
    checkpointer._staged = {}  # the snapshot an async save keeps for the next one
    state.clear()
    step_dir = root / "checkpoints" / f"step-{step:08d}"
    share = assign(ckread.read_marker(step_dir), world)[rank]
    template = make_state(total, layout, rank)[1] if layout == "sharded" else None

    def cold() -> None:
        with timed.ours():
            dist.barrier()
        if rank == 0:
            drop_cache(step_dir)
        with timed.ours():
            dist.barrier()

    dog = Watchdog(rank, world, heartbeat_s=1.0, timeout_s=300.0, run_dir=root)
    dog.start()
    words = PeerWords(dog)
    alone = ckread.verify_checkpoint if rank == 0 else (lambda _: None)

    def shared(key: str) -> None:
        assert resume.verify_together(step_dir, runtime, words, key) is None

    def load() -> None:
        if template is None:
            for name in ("model.pt", "optimizer.pt"):
                ckread.load_file(step_dir, name)  # every rank loads both whole
        else:
            ckread.load_sharded(step_dir, template)
        ckread.load_file(step_dir, f"rng-rank{rank:05d}.pt")

    def resume_and_load() -> None:
        started = time.perf_counter()
        point = resume.resolve_resume(Config(), checkpointer, runtime, lambda _: None, watchdog=dog)
        assert point is not None and point.path == step_dir
        out.setdefault("resume: verify", []).append(time.perf_counter() - started)
        load()

    timed.take()
    longest_resume = 0.0
    for index in range(rounds):
        cold()
        together("disk read", lambda: raw_read(step_dir, share))
        cold()
        together("verify, rank 0 alone", lambda: alone(step_dir))
        cold()
        together("verify, shared", lambda key=f"v{index}": shared(key))
        cold()
        timed.take()
        together("resume", resume_and_load)
        longest_resume = max(longest_resume, timed.take())
    dog.stop()
    best = {name: min(values) for name, values in out.items()}
    best["longest collective, save"] = longest_save
    best["longest collective, resume"] = longest_resume
    return best


# ---------------------------------------------------------------------------------------------
# The run


def report(results: dict[tuple[float, str], list[dict[str, float]]]) -> str:
    lines = [
        "seconds (the slower of the 2 ranks, barrier to barrier; the fastest of the rounds) and",
        "the ratio to the disk's own time for the same bytes by the same ranks (writes: plain",
        "files + fsync; reads: cold page cache). 'blocked': the loop's wait in an async save;",
        "'verify': the ranks together; 'rank 0 alone': as before issue 30; 'resume': verify +",
        "load, of which 'its verify' (replicated: every rank loads the model and optimizer whole)",
        "",
        f"{'state':>7} {'layout':<10} {'disk write':>10} {'save':>14} {'save async':>14} "
        f"{'blocked':>7} {'disk read':>9} {'verify':>14} {'rank 0 alone':>14} "
        f"{'resume':>14} {'its verify':>10}",
    ]
    for (size, layout), ranks in results.items():
        slow = {k: max(r[k] for r in ranks) for k in ranks[0]}
        write, read = slow["disk write"], slow["disk read"]

        def vs(name: str, base: float, slow: dict[str, float] = slow) -> str:
            return f"{slow[name]:6.2f} {slow[name] / base:5.2f}x"

        lines.append(
            f"{size:5.2f}GB {layout:<10} {write:10.2f} {vs('save, blocking', write):>14} "
            f"{vs('save, async', write):>14} {slow['save, async: loop blocked']:7.2f} "
            f"{read:9.2f} {vs('verify, shared', read):>14} "
            f"{vs('verify, rank 0 alone', read):>14} {vs('resume', read):>14} "
            f"{slow['resume: verify']:10.2f}"
        )
    lines += ["", "longest wait inside a collective (bounded by dist.timeout_s, default 300 s):"]
    for (size, layout), ranks in results.items():
        save = max(r["longest collective, save"] for r in ranks)
        resumed = max(r["longest collective, resume"] for r in ranks)
        lines.append(
            f"  {size:5.2f} GB {layout:<10} save {save:7.2f} s   resume {resumed:6.3f} s"
            + (
                f"   (the other ranks wait for rank 0's write: at this pace 300 s is "
                f"~{300 * size / save:.0f} GB)"
                if layout == "replicated"
                else ""
            )
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="0.25,1,4", help="GB of state, comma-separated")
    parser.add_argument("--layouts", default="replicated,sharded")
    parser.add_argument("--root", default="/tmp/dtrain-bench-ckpt-size")
    parser.add_argument("--rounds", type=int, default=2, help="runs of each measure (fastest kept)")
    parser.add_argument("--no-docs", action="store_true")
    args = parser.parse_args()
    root = Path(args.root)
    results: dict[tuple[float, str], list[dict[str, float]]] = {}
    try:
        for size in [float(s) for s in args.sizes.split(",")]:
            for layout in args.layouts.split(","):
                folder = root / f"{layout}-{size:g}GB"
                shutil.rmtree(folder, ignore_errors=True)
                folder.mkdir(parents=True)
                started = time.perf_counter()
                ranks = run_ranks(
                    measure_in_rank,
                    2,
                    str(folder),
                    int(size * 1e9),
                    layout,
                    args.rounds,
                    timeout=3600,
                    collective_timeout=300.0,
                )
                shutil.rmtree(folder, ignore_errors=True)
                results[(size, layout)] = ranks
                print(
                    f"{size:g} GB {layout}: {time.perf_counter() - started:.0f} s",
                    file=sys.stderr,
                    flush=True,
                )
    finally:
        shutil.rmtree(root, ignore_errors=True)
    text = report(results)
    print(text)
    if not args.no_docs:
        write_report_section(
            "bench_checkpoint_size",
            "Checkpoint size: save, verify, resume against the disk (`bench_checkpoint_size.py`)",
            text,
            "2 ranks (gloo), one process each, on this machine's disk",
        )


if __name__ == "__main__":
    main()
