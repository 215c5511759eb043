"""``allreduce`` gives the training math of one process, and of torch DDP: equal parameters.

Process start-up dominates these tests, so every 2-rank training runs in one pair of processes
(module fixture ``pair``) and every 1-process baseline in one more (``single``); each test then
asserts one property of those runs.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch import nn

from dtrain.config import Config
from dtrain.parallel.allreduce import AllReduceStrategy
from dtrain.parallel.grad_sync import assign_buckets
from dtrain.task import Task, task_config
from tests.conftest import tiny_raw
from tests.dist_helpers import make_trainer, synced_backward
from tests.ranks import run_ranks
from tests.tasks import TinyOptions, tiny_gpt

ATOL = 1e-6  # the bound: parameters equal within 1e-6


def max_diff(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> float:
    assert a.keys() == b.keys()
    return max(float(np.abs(a[k] - b[k]).max()) for k in a)


# -- a model where some parameters get no gradient ------------------------------------------


class GatedGPT(nn.Module):
    """The tiny GPT plus a parameter used only by samples whose first token is a multiple of 4
    (so on some steps only one rank, or no rank, gives it a gradient) and one never used."""

    def __init__(self, gpt: nn.Module, vocab: int = 64) -> None:
        super().__init__()
        self.gpt = gpt
        self.gate = nn.Parameter(torch.zeros(vocab))
        self.never = nn.Linear(4, 4)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        logits = self.gpt(idx)
        picked = idx[:, 0] % 4 == 0
        if picked.any():  # data-dependent: the gate is in the graph only for these samples
            logits = logits + picked[:, None, None] * self.gate
        return logits


@task_config(TinyOptions)
def gated_gpt(cfg: Config) -> Task:
    task = tiny_gpt(cfg)
    task.model = GatedGPT(task.model)
    return task


# -- what runs inside the ranks --------------------------------------------------------------


@torch.no_grad()
def _params(module: nn.Module) -> dict[str, np.ndarray]:
    return {k: v.detach().cpu().numpy().copy() for k, v in module.state_dict().items()}


def _register_hook(trainer: Any, hook_name: str) -> None:
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    target = trainer.strategy  # ddp and allreduce take a DDP comm hook alike
    if hook_name == "fp16":
        target.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif hook_name == "powersgd":
        state = powerSGD_hook.PowerSGDState(
            process_group=None, matrix_approximation_rank=1, start_powerSGD_iter=2
        )
        target.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
    else:
        raise ValueError(hook_name)


class _CollectiveCounter:
    """Counts every ``torch.distributed.all_reduce`` call and, separately, those made while
    the strategy is inside ``no_backward_sync()``."""

    def __init__(self, strategy: AllReduceStrategy) -> None:
        self.calls = 0
        self.calls_in_local_steps = 0
        self.launches_in_local_steps = 0
        self.local_steps = 0
        self._inside = False
        original_all_reduce = dist.all_reduce
        original_no_sync = strategy.no_backward_sync

        def all_reduce(*args: Any, **kwargs: Any) -> Any:
            self.calls += 1
            self.calls_in_local_steps += self._inside
            return original_all_reduce(*args, **kwargs)

        def no_backward_sync() -> Any:
            return self._window(strategy, original_no_sync())

        dist.all_reduce = all_reduce
        strategy.no_backward_sync = no_backward_sync  # type: ignore[method-assign]

    def _window(self, strategy: AllReduceStrategy, inner: Any) -> Any:
        from contextlib import contextmanager

        @contextmanager
        def window() -> Iterator[None]:
            before = strategy.launches
            self._inside = True
            try:
                with inner:
                    yield
            finally:
                self._inside = False
                self.local_steps += 1
                self.launches_in_local_steps += strategy.launches - before

        return window()


def _one_step_grads(raw_cfg: dict[str, Any]) -> dict[str, bool | None]:
    """After one synchronized step: which of GatedGPT's ``never`` parameters has a gradient,
    and whether it is all zeros."""
    trainer = make_trainer(raw_cfg)
    batch = next(trainer.loader)
    from dtrain.data.loader import to_device

    micro = [to_device(trainer.task.split_batch(m), trainer.runtime.device) for m in batch.micro]
    scale = torch.tensor(1.0 / 64)
    synced_backward(trainer.strategy, micro, trainer.task.loss_fn, scale)
    grad = trainer.strategy.unwrapped.never.weight.grad
    return {
        "has_grad": grad is not None,
        "zeros": None if grad is None else bool((grad == 0).all()),
    }


def _hand_loop(raw_cfg: dict[str, Any], keep_grads: bool) -> dict[str, Any]:
    """Three steps of a hand-written loop whose ``zero_grad`` keeps ``.grad`` (zeroed in place,
    so backward accumulates into the buckets) or drops it: the parameters, and whether every
    ``.grad`` was a view of a bucket after each sync (no copy out of the buckets)."""
    from dtrain.data.loader import to_device

    trainer = make_trainer(raw_cfg)
    strategy = trainer.strategy
    assert isinstance(strategy, AllReduceStrategy)
    optimizer = torch.optim.AdamW(strategy.parameters(), lr=1e-2)
    buckets = {b.buffer.untyped_storage().data_ptr() for b in strategy.buckets}
    start = _params(strategy.unwrapped)
    in_buckets = True
    for _ in range(3):
        device = trainer.runtime.device
        micro = [to_device(trainer.task.split_batch(m), device) for m in next(trainer.loader).micro]
        synced_backward(strategy, micro, trainer.task.loss_fn, torch.tensor(1.0 / 64))
        in_buckets &= all(
            p.grad is not None and p.grad.untyped_storage().data_ptr() in buckets
            for p in strategy.parameters()
        )
        optimizer.step()
        optimizer.zero_grad(set_to_none=not keep_grads)
    end = _params(strategy.unwrapped)
    return {"params": end, "grads_in_buckets": in_buckets, "moved": max_diff(start, end)}


def run_suite(runs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Train each run in turn on this rank; return what each test needs."""
    out: dict[str, dict[str, Any]] = {}
    original_all_reduce = dist.all_reduce
    for run in runs:
        if run.get("one_step"):
            out[run["name"]] = _one_step_grads(run["raw"])
            continue
        if "keep_grads" in run:
            out[run["name"]] = _hand_loop(run["raw"], run["keep_grads"])
            continue
        trainer = make_trainer(run["raw"])
        if run.get("hook"):
            _register_hook(trainer, run["hook"])
        counter = None
        if isinstance(trainer.strategy, AllReduceStrategy) and dist.is_initialized():
            counter = _CollectiveCounter(trainer.strategy)
        try:
            trainer.fit()
        finally:
            dist.all_reduce = original_all_reduce
        result: dict[str, Any] = {"params": _params(trainer.strategy.unwrapped)}
        strategy = trainer.strategy
        if isinstance(strategy, AllReduceStrategy):
            module = strategy.unwrapped
            result["buckets"] = len(strategy.buckets)
            result["bucket_sizes"] = [len(b.params) for b in strategy.buckets]
            result["tensors"] = sum(1 for p in module.parameters() if p.requires_grad)
            result["launches"] = strategy.launches
            result["steps"] = trainer.step
            result["parameter_bytes"] = strategy.parameter_bytes()
            result["tied"] = getattr(module, "head", None) is not None and (
                module.head.weight is module.tok_emb.weight
            )
        if counter is not None:
            result["calls_in_local_steps"] = counter.calls_in_local_steps
            result["launches_in_local_steps"] = counter.launches_in_local_steps
            result["local_steps"] = counter.local_steps
        out[run["name"]] = result
    return out


# -- the runs --------------------------------------------------------------------------------

GATED = {"task": "tests.test_allreduce:gated_gpt"}


def pair_runs(tmp: Path) -> list[dict[str, Any]]:
    ar = {"name": "allreduce"}
    tiny_buckets = {"name": "allreduce", "bucket_mb": 1e-9}  # every tensor its own bucket

    def spec(name: str, strategy: dict[str, object], **sections: Any) -> dict[str, Any]:
        return {"name": name, "raw": tiny_raw(tmp / name, strategy=strategy, **sections)}

    return [
        spec("allreduce", ar),
        spec("ddp", {"name": "ddp"}),
        spec("tiny_buckets", tiny_buckets),
        # Gradients of 1.7 MB, over torch DDP's 1 MiB first bucket, under bucket_mb.
        spec("wide", ar, task={"d_model": 128}, train={"steps": 2}),
        spec("micro2", ar, data={"global_batch_size": 8, "micro_batches": 2}),
        spec("micro4", tiny_buckets, data={"global_batch_size": 8, "micro_batches": 4}),
        spec("gated", {**ar, "find_unused_parameters": True}, run=GATED),
        spec("gated_lenient", ar, run=GATED),
        {
            **spec("never_exact", {**ar, "find_unused_parameters": True}, run=GATED),
            "one_step": True,
        },
        {**spec("never_lenient", ar, run=GATED), "one_step": True},
        spec("saved", ar, checkpoint={"every": 10}),
        spec("resumed", ar, run={"resume": str(tmp / "saved/checkpoints/step-00000010")}),
        {**spec("ddp_fp16", {"name": "ddp"}, train={"steps": 10}), "hook": "fp16"},
        {**spec("allreduce_fp16", ar, train={"steps": 10}), "hook": "fp16"},
        {**spec("powersgd", ar, train={"steps": 6}), "hook": "powersgd"},
        {**spec("grads_kept", ar), "keep_grads": True},
        {**spec("grads_dropped", ar), "keep_grads": False},
    ]


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, dict[str, Any]]]:
    tmp = tmp_path_factory.mktemp("pair")
    return run_ranks(run_suite, 2, pair_runs(tmp), timeout=240)


@pytest.fixture(scope="module")
def single(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("single")
    runs = [
        {"name": "plain", "raw": tiny_raw(tmp / "plain", strategy={"name": "allreduce"})},
        {"name": "gated", "raw": tiny_raw(tmp / "gated", run=GATED)},
        {"name": "start", "raw": tiny_raw(tmp / "start", train={"steps": 1})},
    ]
    return run_ranks(run_suite, 1, runs, timeout=120)[0]


# -- the tests -------------------------------------------------------------------------------


def test_two_ranks_equal_one_process_and_ddp(pair: list[Any], single: dict[str, Any]) -> None:
    rank0, rank1 = pair
    ours = rank0["allreduce"]
    assert max_diff(ours["params"], rank1["allreduce"]["params"]) == 0  # replicas identical
    assert ours["tied"]  # the head still shares the embedding's weight
    diff_single = max_diff(ours["params"], single["plain"]["params"])
    diff_ddp = max_diff(ours["params"], rank0["ddp"]["params"])
    print(f"allreduce vs one process: {diff_single:.2e}; vs ddp: {diff_ddp:.2e}")
    assert diff_single <= ATOL
    assert diff_ddp <= ATOL
    # Training did move the parameters (so equality above is not trivial).
    assert max_diff(ours["params"], single["start"]["params"]) > 1e-3


def test_one_launch_per_bucket_per_step(pair: list[Any]) -> None:
    run = pair[0]["allreduce"]
    assert run["launches"] == run["steps"] * run["buckets"]
    tiny = pair[0]["tiny_buckets"]
    assert tiny["bucket_sizes"] == [1] * tiny["tensors"]  # every tensor is its own bucket
    assert tiny["launches"] == tiny["steps"] * tiny["tensors"]
    # The first bucket is bounded by bucket_mb as every other, as the ddp strategy's: a model
    # under it is one collective a step (the README model's step paid a second one).
    wide = pair[0]["wide"]
    assert wide["parameter_bytes"] > 1024 * 1024
    assert wide["buckets"] == 1
    assert wide["launches"] == wide["steps"] == 2


def test_every_tensor_its_own_bucket_keeps_parity(pair: list[Any], single: dict[str, Any]) -> None:
    assert max_diff(pair[0]["tiny_buckets"]["params"], single["plain"]["params"]) <= ATOL
    assert max_diff(pair[0]["tiny_buckets"]["params"], pair[1]["tiny_buckets"]["params"]) == 0


@pytest.mark.parametrize("name,micro", [("micro2", 2), ("micro4", 4)])
def test_accumulation_sends_nothing_on_local_micro_steps(
    pair: list[Any], single: dict[str, Any], name: str, micro: int
) -> None:
    for rank in pair:
        run = rank[name]
        assert run["local_steps"] == run["steps"] * (micro - 1)
        assert run["calls_in_local_steps"] == 0  # no all_reduce at all, from anyone
        assert run["launches_in_local_steps"] == 0
        assert run["launches"] == run["steps"] * run["buckets"]  # only on the final micro-step
    diff = max_diff(pair[0][name]["params"], single["plain"]["params"])
    print(f"{name}: allreduce with accumulation vs one process: {diff:.2e}")
    assert diff <= ATOL


def test_parameters_without_gradient(pair: list[Any], single: dict[str, Any]) -> None:
    # find_unused_parameters: exactly one process's math, also for momentum and weight decay.
    diff = max_diff(pair[0]["gated"]["params"], single["gated"]["params"])
    print(f"gated model vs one process: {diff:.2e}")
    assert diff <= ATOL
    assert max_diff(pair[0]["gated"]["params"], pair[1]["gated"]["params"]) == 0
    # Without it a parameter no rank used gets a zero gradient; replicas still stay identical.
    assert max_diff(pair[0]["gated_lenient"]["params"], pair[1]["gated_lenient"]["params"]) == 0
    for rank in pair:
        assert rank["never_exact"] == {"has_grad": False, "zeros": None}
        assert rank["never_lenient"] == {"has_grad": True, "zeros": True}


def test_ddp_comm_hooks_plug_in(pair: list[Any]) -> None:
    # The same torch DDP hook gives the same result in ddp and in allreduce.
    diff = max_diff(pair[0]["allreduce_fp16"]["params"], pair[0]["ddp_fp16"]["params"])
    print(f"fp16_compress_hook: allreduce vs ddp: {diff:.2e}")
    assert diff <= ATOL
    # PowerSGD uses index(), is_last(), gradients() of the bucket; it must run and keep
    # replicas identical.
    assert max_diff(pair[0]["powersgd"]["params"], pair[1]["powersgd"]["params"]) == 0


def test_gradients_live_in_the_buckets(pair: list[Any]) -> None:
    # After a sync every .grad is a view of its bucket, whether zero_grad drops it (copied in
    # once) or keeps it (backward accumulates into the bucket); both train the same bits.
    for rank in pair:
        kept, dropped = rank["grads_kept"], rank["grads_dropped"]
        assert kept["grads_in_buckets"] and dropped["grads_in_buckets"]
        assert max_diff(kept["params"], dropped["params"]) == 0
    assert max_diff(pair[0]["grads_kept"]["params"], pair[1]["grads_kept"]["params"]) == 0
    assert pair[0]["grads_kept"]["moved"] > 1e-3  # it trained: the equalities are not trivial


def test_resume_from_a_checkpoint_continues_exactly(pair: list[Any]) -> None:
    # 20 steps with a checkpoint at step 10; a new run resumed from it ends equal.
    assert pair[0]["resumed"]["launches"] == 10 * pair[0]["resumed"]["buckets"]
    assert max_diff(pair[0]["resumed"]["params"], pair[0]["saved"]["params"]) == 0
    assert max_diff(pair[0]["saved"]["params"], pair[0]["allreduce"]["params"]) == 0


def test_parameter_bytes_count_a_tied_weight_once(pair: list[Any]) -> None:
    run = pair[0]["allreduce"]
    total = sum(v.nbytes for k, v in run["params"].items() if k != "head.weight")
    assert run["parameter_bytes"] == total


# -- pure functions, no processes ------------------------------------------------------------


def test_assign_buckets_bounds_sizes_and_keeps_order() -> None:
    tensors = [torch.zeros(n) for n in (10, 10, 10, 30, 5, 5)]  # float32: 4 bytes each
    assert assign_buckets(tensors, cap_bytes=80) == [[0, 1], [2], [3], [4, 5]]
    assert assign_buckets(tensors, cap_bytes=10**6) == [[0, 1, 2, 3, 4, 5]]
    assert assign_buckets(tensors, cap_bytes=1) == [[i] for i in range(6)]


def test_assign_buckets_separates_dtypes() -> None:
    tensors = [torch.zeros(2), torch.zeros(2, dtype=torch.float64), torch.zeros(2)]
    assert assign_buckets(tensors, cap_bytes=1000) == [[0, 2], [1]]
