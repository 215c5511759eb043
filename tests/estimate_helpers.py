"""Functions that run inside the ranks for the memory-estimate tests and benchmark: a rank's
measured peak while its trainer is built and trains a few steps."""

from __future__ import annotations

import ctypes
import gc
from pathlib import Path
from typing import Any

from dtrain.fault.failpoints import failpoints
from tests.dist_helpers import make_trainer

M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter


class _Stop(Exception):
    pass


def return_freed_memory() -> None:
    """Make glibc hand every allocation of 64 KiB or more straight back to the kernel when it
    is freed (a fixed mmap threshold; by default it grows to 32 MiB as blocks are freed, and
    freed blocks below it stay resident). Then the resident size follows the bytes torch
    holds, and one config's freed tensors do not hide the next one's."""
    libc = ctypes.CDLL("libc.so.6")
    libc.mallopt(M_MMAP_THRESHOLD, 64 * 1024)


def status_bytes(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def peak_of_training(raw: dict[str, Any]) -> int:
    """How far this rank's resident size rose, at its peak, above its size just before the
    trainer of ``raw`` was built, while it was built and trained ``train.steps - 1`` steps
    (the last step's data is fetched, then the run stops: no final evaluation, no final
    checkpoint). The kernel's peak counter (VmHWM) is reset first."""
    import torch.distributed as dist

    steps = raw["train"]["steps"]
    gc.collect()
    if dist.is_initialized():
        dist.barrier()
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current VmRSS
    before = status_bytes("VmRSS")
    peak = 0

    def stop(name: str, **args: Any) -> None:
        nonlocal peak
        if name == "train.before_collective" and args["step"] == steps:
            peak = status_bytes("VmHWM") - before
            raise _Stop

    trainer = make_trainer(raw)
    with failpoints(stop):
        try:
            trainer.fit()
        except _Stop:
            pass
    del trainer
    gc.collect()
    return peak


def peak_after_warm_up(raw: dict[str, Any], warm_up: dict[str, Any]) -> int:
    """:func:`peak_of_training` of ``raw`` in a fresh process, after one run of ``warm_up``
    (the same strategy on a tiny model: what the strategy's first run imports, builds and
    caches -- modules, the collectives' connections, torch's threads -- belongs to the
    runtime, not to the model), with glibc returning freed blocks
    (:func:`return_freed_memory`)."""
    return_freed_memory()
    peak_of_training(warm_up)
    return peak_of_training(raw)


def peaks_after_warm_ups(pairs: list[tuple[dict[str, Any], dict[str, Any]]]) -> list[int]:
    """:func:`peak_after_warm_up` of each ``(config, warm-up)`` in turn, in one process."""
    return_freed_memory()
    out = []
    for raw, warm_up in pairs:
        peak_of_training(warm_up)
        out.append(peak_of_training(raw))
    return out


def peak_after_warm_up_default_malloc(raw: dict[str, Any], warm_up: dict[str, Any]) -> int:
    """:func:`peak_after_warm_up` with glibc's malloc as it comes (its mmap threshold grows as
    blocks are freed, and freed blocks below it stay resident)."""
    peak_of_training(warm_up)
    return peak_of_training(raw)


def kept_by_new_shapes(precision: str) -> tuple[int, int]:
    """Run in a fresh process: one forward and backward of a small GPT at a micro-batch of 8,
    then at 4 (new shapes for every matrix product); the resident size the second kept after
    all its tensors were freed, and the distinct 16-bit matrix products the estimate's fake
    pass counts for it."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from dtrain.compute.precision import Precision
    from dtrain.estimate.probe import fake_batch, fake_model, profile_pass
    from dtrain.models.gpt import GPT, GPTConfig
    from tests.tasks import lm_loss

    return_freed_memory()
    torch.set_num_threads(1)
    model = GPT(GPTConfig(vocab_size=64, seq_len=64, n_layer=2, n_head=2, d_model=96))
    autocast = Precision(precision, torch.device("cpu")).autocast

    def step(rows: int) -> None:
        inputs, targets = torch.randint(0, 64, (rows, 64)), torch.randint(0, 64, (rows, 64))
        with autocast():
            loss = lm_loss(model(inputs), targets).sum()
        loss.backward()
        model.zero_grad(set_to_none=True)
        del loss
        gc.collect()

    step(8)
    before = status_bytes("VmRSS")
    step(4)
    kept = status_bytes("VmRSS") - before
    mode = FakeTensorMode()
    fake = fake_model(model, mode)
    inputs, targets = fake_batch((torch.zeros(4, 64, dtype=torch.long),) * 2, mode)
    profile = profile_pass(
        fake,
        (inputs, targets),
        lambda: lm_loss(fake(inputs), targets).sum(),
        list(fake.blocks),  # type: ignore[arg-type]
        autocast,
        mode,
    )
    return kept, len(profile.products)
