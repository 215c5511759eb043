"""A loop of the user's own with two models and two optimizers (``run.wrap``, ``run.update``;
docs/own-loop.md), the GAN of examples/own_loop_gan.py: on 2 ranks it trains both models as one
process does, under ddp, allreduce and fsdp, and under tensor parallelism (a further model
cut by its plan, or whole where it has none); SIGTERM stops it, and the resumed run is
bit-identical to an uninterrupted one, both optimizers included; a model trained without being
wrapped, and the other mistakes of further models, are one line."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import REPO, tiny_raw
from tests.own_loop_tensor import distill_params
from tests.own_loops import (
    frozen_teacher,
    gan_params,
    half_ring_gan,
    loud_critic_gan,
    models_mistake,
)
from tests.ranks import run_ranks
from tests.test_cli import run_cli, write_tiny_config
from tests.test_ddp import assert_params_close
from tests.test_fault import JOB, assert_bit_equal

GAN = str(REPO / "examples" / "own_loop_gan.py")
# Accumulation over 2 micro-batches, an uneven split (4 + 3 samples): the exact global mean of
# both models' losses.
UNEVEN = {"data": {"global_batch_size": 7, "micro_batches": 2}, "train": {"steps": 8}}


def initial_critic() -> dict[str, np.ndarray]:
    """The critic's parameters before training, as the example builds it after the generator
    (every rank seeded with run.seed = 0)."""
    from examples.own_loop_gan import LATENT, MLP

    from dtrain.checkpoint.rng import seed_everything

    seed_everything(0)
    MLP(LATENT, 64, 64, 2)
    critic = MLP(2, 64, 64, 1)
    return {f"critic.{k}": v.detach().numpy().copy() for k, v in critic.state_dict().items()}


@pytest.mark.parametrize("strategy", ["ddp", "allreduce", "fsdp"])
def test_two_models_on_two_ranks_equal_one_process(tmp_path: Path, strategy: str) -> None:
    sections = {**UNEVEN, "strategy": {"name": strategy}}
    single = run_ranks(gan_params, 1, tiny_raw(tmp_path / "one", **sections))[0]["params"]
    pair = [r["params"] for r in run_ranks(gan_params, 2, tiny_raw(tmp_path / "two", **sections))]
    # Both models trained: the critic is no longer the one every rank built.
    initial = initial_critic()
    assert initial.keys() == {k for k in single if k.startswith("critic.")}
    assert all(not np.allclose(initial[k], single[k]) for k in initial)
    if strategy != "fsdp":  # fsdp's whole state is rank 0's only
        assert_params_close(pair[0], pair[1], rtol=0, atol=0)
    assert_params_close(single, pair[0])


def test_further_models_under_tensor_parallelism_equal_one_process(tmp_path: Path) -> None:
    """A further model with a plan (a smaller GPT) is cut over the tensor-parallel group, one
    without (a linear probe) is whole on each rank, a frozen one is rank 0's everywhere; with
    the main model cut too, 2 ranks train all three as one process does (within 1e-5)."""
    single = run_ranks(distill_params, 1, tiny_raw(tmp_path / "one", **UNEVEN))[0]
    tensor = {"name": "tensor", "tensor_parallel": 2}
    pair = run_ranks(distill_params, 2, tiny_raw(tmp_path / "two", **UNEVEN, strategy=tensor))
    assert pair[0]["cut"]["probe"] == [] and single["cut"]["student"] == []
    assert "blocks.0.attn.qkv.weight" in pair[0]["cut"]["student"]
    for mine in pair:
        assert np.array_equal(mine["anchor"], single["anchor"])  # rank 0's seed, everywhere
    assert_params_close(single["params"], pair[0]["params"])
    for name in ("student.blocks.0.attn.qkv.weight", "probe.weight", "blocks.0.attn.qkv.weight"):
        assert name in single["params"]


def test_a_further_optimizer_steps_on_the_count_the_ranks_agree_on(tmp_path: Path) -> None:
    # Items vary from step to step: each step's scale assumes the count of the step before,
    # and run.update() rescales the critic's gradients for the count agreed within the step;
    # the reference agrees on every count before the forward (one process).
    sections = {**UNEVEN, "train": {"steps": 6}}
    single = run_ranks(half_ring_gan, 1, tiny_raw(tmp_path / "one", **sections), True)[0]
    pair = run_ranks(half_ring_gan, 2, tiny_raw(tmp_path / "two", **sections))
    assert_params_close(pair[0], pair[1], rtol=0, atol=0)
    assert_params_close(single, pair[0])


@pytest.mark.parametrize(
    ("strategy", "saved_as"),
    [
        ("ddp", "critic.optimizer.pt"),
        # Three pairs of processes (~4 s, more when loaded) against the default suite's time
        # budget; fsdp's further model is trained by the default suite (equal to one process).
        pytest.param("fsdp", "dcp", marks=pytest.mark.slow),
    ],
)
def test_sigterm_stops_two_optimizers_and_resumes_bit_identically(
    tmp_path: Path, strategy: str, saved_as: str
) -> None:
    job = {**JOB, "strategy": {"name": strategy}}
    reference = run_ranks(gan_params, 2, tiny_raw(tmp_path / "ref", job))
    run_dir = tmp_path / "pre"
    stopped = run_ranks(gan_params, 2, tiny_raw(run_dir, job), (1, 6, "SIGTERM"))
    assert [s["steps"] for s in stopped] == [6, 6]
    assert stopped[1]["preempted"] == "SIGTERM"
    # The critic's model and optimizer: files of rank 0 (replicated), or shards.
    assert (run_dir / "checkpoints" / "step-00000006" / saved_as).exists()
    resumed = run_ranks(gan_params, 2, tiny_raw(run_dir, job))
    assert_bit_equal(reference[0]["params"], resumed[0]["params"])


def test_a_further_optimizer_s_fp16_overflow_skips_it_and_halves_the_loss_scale(
    tmp_path: Path,
) -> None:
    # fp16-mixed from a loss scale of 2**14: the critic's gradients (its losses 2**10 times the
    # generator's) overflow float16, the generator's do not. Each such step the critic's update
    # is skipped on every rank and the scale halved once at the step's end (as torch's
    # GradScaler halves once for any of a step's optimizers), until it fits; the generator
    # steps throughout. (Before: the scale never fell, and the critic never trained.)
    run_dir = tmp_path / "run"
    fp16 = {"steps": 10, "precision": "fp16-mixed", "loss_scale_init": 2.0**14}
    ranks = run_ranks(loud_critic_gan, 2, tiny_raw(run_dir, **{**UNEVEN, "train": fp16}))
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    events = [r for r in map(json.loads, lines) if r.get("kind") == "event"]
    skipped = [
        (e["step"], e["model"], e["loss_scale"]) for e in events if e["name"] == "skipped_update"
    ]
    assert 2 <= len(skipped) < 10, skipped
    assert skipped == [(s + 1, "critic", 2.0 ** (14 - s)) for s in range(len(skipped))]
    assert not [e for e in events if e["name"] in ("overflow", "step_skipped", "rollback")]
    assert ranks[0]["scale"] == ranks[1]["scale"] == 2.0 ** (14 - len(skipped))
    assert_bit_equal(ranks[0]["params"], ranks[1]["params"])
    assert all(np.isfinite(v).all() for v in ranks[0]["params"].values())


@pytest.mark.parametrize(
    ("kind", "says"),
    [
        ("not wrapped", ["step 1: a MLP with trainable parameters ran in the loop outside"]),
        ("wrap after start", ["run.wrap('late', ...) after the loop started"]),
        ("update of another optimizer", ["run.update() of an optimizer run.wrap() did not"]),
    ],
)
def test_a_mistake_with_further_models_is_one_line(
    tmp_path: Path, kind: str, says: list[str]
) -> None:
    said = run_ranks(models_mistake, 1, tiny_raw(tmp_path / "run", train={"steps": 2}), kind)[0]
    assert [part for part in says if part not in said] == []
    assert "\n" not in said


def test_a_frozen_teacher_is_rank_0_s_on_every_rank_and_the_student_trains_alike(
    tmp_path: Path,
) -> None:
    raw = tiny_raw(tmp_path / "run", **UNEVEN)
    ranks = run_ranks(frozen_teacher, 2, raw)
    single = run_ranks(frozen_teacher, 1, tiny_raw(tmp_path / "one", **UNEVEN))[0]
    for rank in ranks:
        assert rank["optimizer"] is None
        assert not rank["requires_grad"]
    assert_bit_equal(ranks[0]["teacher"], ranks[1]["teacher"])
    assert_bit_equal(single["teacher"], ranks[0]["teacher"])  # rank 0 built it as one process
    assert_params_close(single["student"], ranks[0]["student"])


def test_a_strategy_that_cannot_wrap_a_further_model_says_so_in_one_line(tmp_path: Path) -> None:
    raw = tiny_raw(tmp_path / "run", train={"steps": 2}, strategy={"name": "localsgd"})
    said = run_ranks(models_mistake, 1, raw, "wrap")[0]
    assert "run.wrap('critic', ...) under strategy.name = 'localsgd'" in said
    assert "wrapped under ddp, allreduce, fsdp" in said


@pytest.mark.slow  # a whole launch (~15 s loaded); the default suite trains the same loop in
# pairs of processes above
def test_the_gan_example_runs_under_dtrain_train(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    config = write_tiny_config(tmp_path / "tiny.toml", run_dir)
    result = run_cli("train", str(config), f"--run.script={GAN}", "--train.steps=4", "--nproc", "2")
    assert result.returncode == 0, result.stderr[-3000:]
    final = run_dir / "checkpoints" / "step-00000004"
    assert (final / "COMMITTED.json").exists()
    assert (final / "critic.model.pt").exists() and (final / "critic.optimizer.pt").exists()
