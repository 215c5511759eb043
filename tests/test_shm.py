"""The shared-memory all-reduce between the ranks of one machine (``comm.transport``;
``dtrain.ext.shm``): its sums against gloo's, bit for bit on two ranks and alike on every rank
with three; chunks and alternating slot sets; a peer that exits or falls behind named within
the timeout; training through it equal to training through gloo; what picks it, and bad
input as one config error."""

from __future__ import annotations

import contextlib
import io
import os
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist

from dtrain.cli import main
from dtrain.comm.mean import divide_
from dtrain.comm.transport import check_transport_job
from dtrain.config import validate_strategy
from dtrain.config.load import build_config
from dtrain.errors import ConfigError
from dtrain.ext.shm import SharedMemoryAllReduce, unavailable_reason
from dtrain.fault.peer_failure import is_collective_failure
from tests.conftest import tiny_raw
from tests.dist_helpers import make_trainer, params_of
from tests.ranks import RankFailed, run_ranks

DTYPES = ("float32", "float64", "bfloat16", "float16")
# Small slots, so that the longer tensors below go through in several chunks.
CAPACITY = 4096


def _inputs(rank: int, dtype: str) -> list[torch.Tensor]:
    """Tensors of several lengths (one chunk, exactly one slot, several chunks) and signs,
    different on every rank."""
    gen = torch.Generator().manual_seed(100 + rank)
    kind = getattr(torch, dtype)
    per_slot = CAPACITY // torch.empty(0, dtype=kind).element_size()
    lengths = [1, 7, per_slot, per_slot + 1, 5 * per_slot + 3]
    return [(torch.randn(n, generator=gen) * 3).to(kind) for n in lengths]


def _sums(dtype: str) -> dict[str, Any]:
    """Every input summed by the segment and by gloo, in turn (so both slot sets are used
    many times)."""
    shared = SharedMemoryAllReduce(None, CAPACITY, timeout_s=30.0)
    ours, gloos = [], []
    for tensor in _inputs(dist.get_rank(), dtype):
        mine = tensor.clone()
        shared.all_reduce_(mine)
        theirs = tensor.clone()
        dist.all_reduce(theirs)
        ours.append(mine.double().numpy())
        gloos.append(theirs.double().numpy())
    shared.close()
    return {"ours": ours, "gloo": gloos, "calls": shared._calls}


@pytest.mark.parametrize("dtype", DTYPES)
def test_two_ranks_sum_as_gloo_does_bit_for_bit(dtype: str) -> None:
    ranks = run_ranks(_sums, 2, dtype)
    for rank in ranks:
        for ours, gloo in zip(rank["ours"], rank["gloo"]):
            np.testing.assert_array_equal(ours, gloo)
    # The chunks: 1 + 1 + 1 + 2 + 6 calls.
    assert ranks[0]["calls"] == 11


def test_three_ranks_agree_bit_for_bit_and_sum_correctly() -> None:
    ranks = run_ranks(_sums, 3, "float32")
    exact = [
        sum(_inputs(r, "float32")[i].double() for r in range(3)).numpy()
        for i in range(len(ranks[0]["ours"]))
    ]
    for index, want in enumerate(exact):
        for rank in ranks:
            np.testing.assert_array_equal(rank["ours"][index], ranks[0]["ours"][index])
            # Two fp32 additions, each off by at most half an ulp of its result.
            tol = (
                2
                * 2.0**-24
                * np.abs(np.stack([_inputs(r, "float32")[index].numpy() for r in range(3)])).sum(0)
            )
            assert np.all(np.abs(rank["ours"][index] - want) <= tol + 1e-30)


def _means(dtype: str) -> dict[str, Any]:
    """Every input averaged through the segment with the division folded into the copy, and
    divided first, then summed (what a mean hook did before)."""
    shared = SharedMemoryAllReduce(None, CAPACITY, timeout_s=30.0)
    size = dist.get_world_size()
    folded, separate = [], []
    for tensor in _inputs(dist.get_rank(), dtype):
        folded.append(shared.all_reduce_(tensor.clone(), divisor=size).double().numpy())
        separate.append(shared.all_reduce_(divide_(tensor.clone(), size)).double().numpy())
    shared.close()
    return {"folded": folded, "separate": separate}


@pytest.mark.parametrize(("world", "dtype"), [(2, "float32"), (2, "bfloat16"), (3, "float32")])
def test_a_mean_divides_in_the_copy_bit_for_bit(world: int, dtype: str) -> None:
    # 3 ranks: a division that is not a multiplication by an exact reciprocal.
    for rank in run_ranks(_means, world, dtype):
        assert len(rank["folded"]) == len(_inputs(0, dtype))
        for folded, separate in zip(rank["folded"], rank["separate"]):
            np.testing.assert_array_equal(folded, separate)


def _sum_on_rank0(shared: SharedMemoryAllReduce) -> dict[str, Any]:
    """Rank 0's all-reduce: how long until it failed, its error, and whether the trainer would
    take it for a collective's failure (and name the peer)."""
    started = time.monotonic()
    try:
        shared.all_reduce_(torch.ones(10))
    except RuntimeError as error:
        return {
            "s": time.monotonic() - started,
            "text": str(error),
            "ours": is_collective_failure(error),
        }
    return {"s": time.monotonic() - started, "text": "", "ours": False}


def _peer_exits() -> dict[str, Any]:
    shared = SharedMemoryAllReduce(None, CAPACITY, timeout_s=60.0)
    if dist.get_rank() == 1:
        os._exit(0)  # gone without a word, as after kill -9
    return _sum_on_rank0(shared)


def test_a_peer_that_exits_is_named_by_the_liveness_check_not_the_timeout() -> None:
    result = run_ranks(_peer_exits, 2, raise_on_failure=False)[0]
    # The check of the peers' processes (every 0.1 s) named it, not the timeout (60 s): the
    # error says it exited, and it came in well under half the timeout, whatever the load.
    assert "peer rank 1" in result["text"] and "exited" in result["text"], result
    assert "timed out" not in result["text"], result
    assert result["s"] < 30.0, result
    assert result["ours"], "the trainer must see it as a collective failure and name the peer"


def _peer_late(timeout_s: float) -> dict[str, Any]:
    shared = SharedMemoryAllReduce(None, CAPACITY, timeout_s=timeout_s)
    if dist.get_rank() == 1:
        time.sleep(timeout_s * 4)
        return {}
    return _sum_on_rank0(shared)


def test_a_late_peer_is_named_when_the_timeout_expires() -> None:
    result = run_ranks(_peer_late, 2, 0.5, raise_on_failure=False)[0]
    # Named by the 0.5 s timeout (not before it), while the peer still slept: not by its exit
    # (after 2 s), nor by its late arrival.
    assert result["text"] == (
        "shared-memory all-reduce timed out after 0.5s (dist.timeout_s): rank 0 waited for "
        "peer rank(s) 1"
    ), result
    assert result["s"] >= 0.5, result
    assert result["ours"]


def _train_both(raws: dict[str, dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, raw in raws.items():
        trainer = make_trainer(raw)
        hook = trainer.strategy.comm_state
        summary = trainer.fit()
        out[name] = {
            "params": params_of(trainer),
            "shared": getattr(hook, "transport", None) is not None,
            "bytes": trainer.strategy.comm.bytes_sent,
            "steps": summary.steps,
        }
    return out


@pytest.mark.parametrize("strategy", ["ddp", "allreduce"])
@pytest.mark.parametrize("compression", ["none", "bf16", "powersgd"])
def test_training_through_shared_memory_equals_training_through_gloo(
    tmp_path: Path, strategy: str, compression: str
) -> None:
    raws = {
        transport: tiny_raw(
            tmp_path / transport,
            strategy={"name": strategy},
            # PowerSGD compresses from step 2 on: 4 of the 6 steps.
            comm={"transport": transport, "compression": compression, "powersgd_start_step": 2},
            train={"steps": 6},
        )
        for transport in ("shm", "backend", "auto")
    }
    ranks = run_ranks(_train_both, 2, raws)
    for rank in ranks:
        assert rank["shm"]["shared"] and rank["auto"]["shared"]
        assert not rank["backend"]["shared"]
        assert rank["shm"]["steps"] == rank["backend"]["steps"] == 6
        # Two ranks: a segment sends what the ring's all-reduce sends, the payload.
        assert rank["shm"]["bytes"] == rank["backend"]["bytes"]
        for key, value in rank["backend"]["params"].items():
            np.testing.assert_array_equal(rank["shm"]["params"][key], value, err_msg=key)
    for key, value in ranks[0]["shm"]["params"].items():
        np.testing.assert_array_equal(ranks[1]["shm"]["params"][key], value, err_msg=key)


def _peer_dies_in_training(raw: dict[str, Any]) -> str:
    trainer = make_trainer(raw)
    if dist.get_rank() == 1:
        calls = [0]

        def die_in_the_fourth_forward(*_: Any) -> None:
            calls[0] += 1
            if calls[0] == 4:  # past that step's other collectives: rank 0 waits in backward
                os._exit(0)

        trainer.strategy.unwrapped.register_forward_pre_hook(die_in_the_fourth_forward)
    try:
        trainer.fit()
    except Exception as error:  # the trainer names the peer (PeerFailure)
        return f"{type(error).__name__}: {error}"
    return "no error"


def test_a_peer_lost_in_backward_is_named(tmp_path: Path) -> None:
    raw = tiny_raw(tmp_path, comm={"transport": "shm"}, train={"steps": 50})
    text = run_ranks(_peer_dies_in_training, 2, raw, raise_on_failure=False)[0]
    assert not isinstance(text, RankFailed), text
    # The error raised in the comm hook came through backward, and the trainer named the peer.
    assert text.startswith("PeerFailure") and "rank 1" in text, text
    assert "shared-memory all-reduce: peer rank 1" in text, text


def test_where_a_segment_cannot_be_used() -> None:
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    assert unavailable_reason(cpu, 2, local_world_size=2, world_size=2) is None
    assert "cuda" in str(unavailable_reason(cuda, 2, local_world_size=2, world_size=2))
    assert "one rank" in str(unavailable_reason(cpu, 1, local_world_size=1, world_size=1))
    assert "1 of 2 ranks here" in str(unavailable_reason(cpu, 2, local_world_size=1, world_size=2))


def _which(raw: dict[str, Any]) -> bool:
    return make_trainer(raw).strategy.comm_state.transport is not None


def test_auto_leaves_topk_and_other_machines_to_the_backend(tmp_path: Path) -> None:
    topk = tiny_raw(tmp_path / "t", comm={"compression": "topk", "transport": "auto"})
    assert run_ranks(_which, 2, topk) == [False, False]  # an all-gather
    powersgd = tiny_raw(tmp_path / "p", comm={"compression": "powersgd", "transport": "auto"})
    assert run_ranks(_which, 2, powersgd) == [True, True]  # sums only
    # Two "machines" of one rank each (as the multi-host tests run them).
    plain = tiny_raw(tmp_path / "n", comm={"transport": "auto"})
    assert run_ranks(_which, 2, plain, env={"LOCAL_WORLD_SIZE": "1"}) == [False, False]
    assert run_ranks(_which, 2, plain) == [True, True]


def _without_room(raw: dict[str, Any]) -> dict[str, Any]:
    """As if rank 0's shared memory were full: ``auto`` goes on through gloo, ``shm`` fails."""
    from dtrain.ext import shm

    shm._create = lambda size: f"cannot reserve {size} bytes in /dev/shm: No space left"
    out: dict[str, Any] = {}
    said = io.StringIO()
    try:
        with contextlib.redirect_stderr(said):
            out["shared"] = _which(raw)
    except shm.SegmentUnavailable as error:
        out["error"] = str(error)
    out["said"] = said.getvalue()
    return out


def test_auto_goes_on_through_gloo_where_no_segment_can_be_made(tmp_path: Path) -> None:
    auto = tiny_raw(tmp_path / "a", comm={"transport": "auto"})
    first, second = run_ranks(_without_room, 2, auto)
    assert first["shared"] is False and second["shared"] is False
    # Said once, by the group's first rank.
    assert "comm.transport = 'auto'" in first["said"] and "through gloo" in first["said"]
    assert second["said"] == ""
    forced = tiny_raw(tmp_path / "s", comm={"transport": "shm"})
    for rank in run_ranks(_without_room, 2, forced):
        assert "could not make its segment" in rank["error"] and "No space left" in rank["error"]


@pytest.mark.parametrize(
    ("sections", "words"),
    [
        ({"comm": {"transport": "shm", "compression": "topk"}}, "comm.compression = 'topk'"),
        ({"comm": {"transport": "shm", "compression": "topk"}}, "summing all-reduces only"),
        ({"comm": {"transport": "shm"}, "dist": {"device": "cuda"}}, "dist.device = 'cuda'"),
        ({"comm": {"transport": "shm"}, "strategy": {"name": "fsdp"}}, "strategy.name = 'fsdp'"),
        ({"comm": {"transport": "tcp"}}, "comm.transport"),
    ],
)
def test_bad_transport_is_a_config_error(sections: dict[str, Any], words: str) -> None:
    # The parent's checks, in its order: the config package's rules, then the extension's own.
    with pytest.raises(ConfigError, match=words.replace("(", r"\(").replace(".", r"\.")):
        cfg = build_config(sections)
        validate_strategy(cfg, 2)
        check_transport_job(cfg, max_nodes=1, nnodes="1")


def test_shm_across_machines_is_refused_before_any_worker_starts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(
        [
            "train",
            "--nnodes",
            "2",
            "--rdzv-endpoint",
            "127.0.0.1:29999",
            "--comm.transport=shm",
            f"--run.dir={tmp_path / 'run'}",
        ]
    )
    assert code == 2
    err = capsys.readouterr().err
    assert "comm.transport = 'shm' needs every rank on one machine" in err
    assert err.count("\n") == 1


def test_a_segment_left_by_a_killed_rank_is_swept(tmp_path: Path) -> None:
    from dtrain.ext import shm

    dead = tmp_path / f"{shm._PREFIX}999999999-abc"  # no such pid
    alive = tmp_path / f"{shm._PREFIX}{os.getpid()}-abc"
    young = tmp_path / f"{shm._PREFIX}999999998-abc"
    for path in (dead, alive, young):
        path.write_bytes(b"x")
    old = time.time() - 2 * shm._STALE_S
    os.utime(dead, (old, old))
    os.utime(alive, (old, old))
    shm._sweep(str(tmp_path))
    assert not dead.exists() and alive.exists() and young.exists()


def test_a_resumed_run_may_change_the_transport() -> None:
    from dtrain.config import Config
    from dtrain.config.resume import config_differences

    saved, current = Config(), Config()
    current.comm.transport = "backend"
    assert config_differences(saved.to_dict(), current.to_dict()) == []
    current.comm.compression = "bf16"  # what is sent: not safe to change
    assert config_differences(saved.to_dict(), current.to_dict()) != []
