"""``dtrain estimate``: per-rank memory from the meta device, measured passes on fake tensors,
against the peaks real runs reach."""

from __future__ import annotations

import json
import resource
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import Dataset

from dtrain.cli import main
from dtrain.compute.precision import Precision
from dtrain.config import OptimConfig
from dtrain.errors import UserError
from dtrain.estimate.fsdp import Moment, Unit, fsdp_moments
from dtrain.estimate.kernels import BYTES_PER_BF16_PRODUCT, kernel_bytes
from dtrain.estimate.layout import TensorInfo, model_tensors, optimizer_bytes
from dtrain.estimate.memory import estimate_memory
from dtrain.estimate.probe import fake_batch, fake_model, profile_pass
from dtrain.estimate.report import parse_bytes
from dtrain.models.gpt import GPT, GPTConfig
from dtrain.parallel.recipe import Recipe
from dtrain.train.job import build_job_config
from tests.conftest import tiny_config, tiny_raw
from tests.estimate_helpers import peak_after_warm_up, peaks_after_warm_ups
from tests.ranks import run_ranks
from tests.tasks import lm_loss
from tests.test_cli import run_cli
from tests.test_fault import assert_bit_equal

CPU = torch.device("cpu")


class _NoMode:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *args: object) -> None:
        return None


@pytest.mark.parametrize("precision", ["fp32", "bf16-mixed"])
def test_a_pass_on_fake_tensors_measures_what_real_tensors_take(precision: str) -> None:
    # The same forward and backward, once on real tensors and once on fake ones: the bytes
    # saved for backward and the pass's peak agree to the byte (autocast casts the same way).
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, seq_len=32, n_layer=2, n_head=2, d_model=64))
    batch = (torch.randint(0, 64, (4, 32)), torch.randint(0, 64, (4, 32)))
    autocast = Precision(precision, CPU).autocast

    def measure(m: nn.Module, inputs: Any, targets: Any, mode: Any) -> tuple[int, int, int]:
        blocks = list(m.blocks)  # type: ignore[arg-type]
        profile = profile_pass(
            m, (inputs, targets), lambda: lm_loss(m(inputs), targets).sum(), blocks, autocast, mode
        )
        return profile.saved.activations(0), profile.saved.activations(1), profile.working

    real = measure(model, *batch, _NoMode())
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode()
    fake = fake_model(model, mode)
    assert real == measure(fake, *fake_batch(batch, mode), mode)
    saved, checkpointed, working = real
    assert 0 < checkpointed < saved <= working


@pytest.mark.parametrize("every", [1, 2, 3])
def test_checkpointing_every_k_credits_what_the_checkpointed_pass_reaches(every: int) -> None:
    # What the estimate credits to the activations with every k-th of 4 blocks checkpointed
    # (read from the pass without checkpointing) against the peak of a real pass with it:
    # never more (backward frees a block's saved tensors before it recomputes an earlier
    # one), and the most of it (the rest is the pass's temporaries).
    def run(checkpoint_every: int) -> Any:
        torch.manual_seed(0)
        model = GPT(GPTConfig(vocab_size=64, seq_len=32, n_layer=4, n_head=2, d_model=64))
        inputs, targets = torch.randint(0, 64, (4, 32)), torch.randint(0, 64, (4, 32))
        blocks = list(model.blocks)  # type: ignore[arg-type]
        if checkpoint_every:
            Recipe(Precision("fp32", CPU), checkpoint_every).apply(blocks)
        return profile_pass(
            model,
            (inputs, targets),
            lambda: lm_loss(model(inputs), targets).sum(),
            blocks,
            Precision("fp32", CPU).autocast,
            _NoMode(),
        )

    credited = run(0).saved.activations(every)
    measured = run(every).working
    assert 0.8 * measured <= credited <= measured, (credited, measured)


@pytest.mark.parametrize("precision", ["fp32", "bf16-mixed"])
def test_the_estimate_counts_onednn_kernels_for_bfloat16_products(
    tmp_path: Path, precision: str
) -> None:
    # The fake pass of the tests' GPT finds its 12 distinct bfloat16 matrix products (4 addmm
    # in forward, 8 mm in backward; its output projection runs in float32) in bf16-mixed, and
    # the estimate counts their kernels; fp32 products leave none (MKL). The slow test below
    # measures what they keep.
    raw = tiny_raw(tmp_path, train={"precision": precision})
    estimate = estimate_memory(build_job_config(raw), 2)
    kernels = [line.bytes for line in estimate.lines if line.what.startswith("oneDNN")]
    if precision == "fp32":
        assert kernels == []
        return
    assert kernels == [12 * BYTES_PER_BF16_PRODUCT]


@pytest.mark.slow
@pytest.mark.skipif(
    not torch.ops.mkldnn._is_mkldnn_bf16_supported(), reason="no bfloat16 oneDNN kernels here"
)
def test_a_cpu_keeps_onednn_kernels_per_bfloat16_product_shape() -> None:
    # In a fresh process: a bf16-mixed pass at new shapes keeps resident memory after its
    # tensors are freed (oneDNN's compiled kernels), about what the estimate counts for the
    # distinct products its fake pass ran; fp32 keeps none and the estimate counts none.
    (bf16, fp32), *_ = run_ranks(_kept_by_new_shapes, 1, ["bf16-mixed", "fp32"], init_group=False)
    kept, products = bf16
    assert products == 12  # 4 addmm (forward), 8 mm (backward) of the blocks' linear maps
    counted = kernel_bytes(products, Precision("bf16-mixed", CPU))
    assert 0.75 <= counted / kept <= 1.25, (counted, kept)
    kept, products = fp32
    assert kernel_bytes(products, Precision("fp32", CPU)) == 0
    assert kept < counted / 4, kept


def _kept_by_new_shapes(precisions: list[str]) -> list[tuple[int, int]]:
    from tests.estimate_helpers import kept_by_new_shapes

    return [kept_by_new_shapes(p) for p in precisions]


def test_the_state_a_rank_holds_follows_the_layout() -> None:
    # 10 rows sharded over 4 ranks: 3 rows each (padded); a column-wise cut halves the rows
    # first, a row-wise one the columns (its bias stays whole).
    weight = TensorInfo("w", (10, 6), torch.float32, True, True)
    assert weight.local_bytes(1, 4) == 3 * 6 * 4
    assert weight.gathered_bytes(1, 4) == 12 * 6 * 4
    col = TensorInfo("c", (8, 6), torch.float32, True, True, "colwise")
    row = TensorInfo("r", (8, 6), torch.float32, True, True, "rowwise")
    assert (col.local_shape(2), row.local_shape(2)) == ((4, 6), (8, 3))
    tied = GPT(GPTConfig(vocab_size=64, seq_len=8, n_layer=1, n_head=2, d_model=16))
    infos = model_tensors(tied)
    # The tied head once (parameters() yields a shared tensor once).
    assert sum(t.bytes for t in infos) == 4 * sum(p.numel() for p in tied.parameters())
    params = sum(t.bytes for t in infos)
    adamw = optimizer_bytes(infos, OptimConfig(name="adamw"), 1, 1, CPU)
    assert adamw.state == 2 * params + 4 * len(infos)  # two moments, one step count each
    # foreach AdamW's temporary: the square roots of the decaying group (the matrices).
    matrices = sum(t.bytes for t in infos if len(t.shape) >= 2)
    assert adamw.temporary == matrices
    assert optimizer_bytes(infos, OptimConfig(name="sgd"), 1, 1, CPU).state == params
    still = optimizer_bytes(infos, OptimConfig(name="sgd", momentum=0.0), 1, 1, CPU)
    assert still.state == 0


@pytest.mark.parametrize("implementation", ["foreach", "fused"])
def test_the_adamw_step_s_temporaries_are_those_estimated(implementation: str) -> None:
    from torch.profiler import ProfilerActivity, profile

    from dtrain.compute.optim import build_optimizer

    model = GPT(GPTConfig(vocab_size=64, seq_len=8, n_layer=2, n_head=2, d_model=32))
    for param in model.parameters():
        param.grad = torch.ones_like(param)
    cfg = OptimConfig(name="adamw", implementation=implementation)  # type: ignore[arg-type]
    optimizer = build_optimizer(model.named_parameters(), cfg)
    optimizer.step()  # the state is made in the first step; the temporaries in every step
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        optimizer.step()
    allocations = sorted(
        (event.time_range.start, event.cpu_memory_usage)
        for event in prof.events()
        if event.cpu_memory_usage and not event.cpu_children
    )
    held = peak = 0
    for _, change in allocations:
        held += change
        peak = max(peak, held)
    estimated = optimizer_bytes(model_tensors(model), cfg, 1, 1, CPU).temporary
    # Scalars aside (the step counts' updates: a few bytes each), and for foreach 4 KB more
    # than the largest group (measured: 111,488 bytes against 107,520; 0 fused): 5% slack.
    assert estimated <= peak <= 1.05 * estimated + 1024, (peak, estimated)


def test_fsdp_holds_four_blocks_in_backward_as_torch_schedules_them() -> None:
    # Blocks of B bytes (and gradients, sharded in 2), a root of R: the most FSDP holds in
    # each schedule, counted in blocks (tests/fsdp_census.py counts it on a real run).
    B, R = 100, 10
    block, root = Unit(B, B, B // 2), Unit(R, R, R // 2)

    def most(
        count: int, reshard: bool = True, accumulating: bool = False, prefetch: bool = True
    ) -> Moment:
        moments = fsdp_moments([block] * count, root, reshard, accumulating, prefetch)
        return max(moments, key=lambda m: m.unsharded)

    # backward: a block's parameters and gradients, the next one's prefetched buffer, the
    # last one's reduce-scatter input; the root's parameters and gradients throughout
    assert most(12).unsharded == 4 * B + 2 * R and most(12).backward
    assert (most(2).unsharded, most(1).unsharded) == (3 * B + 2 * R, 2 * B + 2 * R)
    # without backward prefetch: the next block is gathered when its own backward begins
    assert most(12, prefetch=False).unsharded == 3 * B + 2 * R
    assert most(12, reshard=False, prefetch=False).unsharded == 13 * B + 2 * R
    assert most(12, reshard=False).unsharded == 13 * B + 2 * R  # every block stays gathered
    # accumulation: every unit's gradients unsharded, and two blocks gathered
    assert most(12, accumulating=True).unsharded == 14 * B + 2 * R
    # the sum with the gradients reduce-scattered by then: latest in backward at 4 blocks
    assert max(fsdp_moments([block] * 12, root, True, False), key=lambda m: m.total).block == 1


def test_memory_sizes_are_read_with_their_units() -> None:
    assert parse_bytes("80GB") == 80 * 10**9
    assert parse_bytes("80GiB") == 80 * 2**30
    assert parse_bytes("1.5 mb") == 1_500_000
    with pytest.raises(UserError, match="--memory"):
        parse_bytes("80 gigs")


def test_a_model_larger_than_this_machine_is_estimated_without_allocating_it(
    tmp_path: Path,
) -> None:
    # 20 B parameters: 79 GB of float32 weights alone, on a machine of 24 GB. The task builds
    # its model eagerly (no meta_init): the estimate builds it on the meta device all the same.
    task = {"n_layer": 2, "d_model": 28672, "seq_len": 16}
    cfg = tiny_config(tmp_path, task=task, strategy={"name": "fsdp"}, optim={"name": "adamw"})
    estimate = estimate_memory(cfg, 8, budget=parse_bytes("80GB"))
    params = dict((line.what, line.bytes) for line in estimate.lines)["parameters"]
    assert estimate.parameter_count > 19e9
    assert params == pytest.approx(4 * estimate.parameter_count / 8, rel=1e-3)
    # Set-up builds the whole model on every rank (the task does not build it on meta):
    # the peak says so, and that it does not fit.
    assert estimate.phases["set-up"] > 4 * estimate.parameter_count
    assert estimate.fits is False


def unbuildable_task(cfg: Any) -> Any:
    """A task factory that cannot build its model without data (here: ever)."""
    raise RuntimeError("needs its weights on disk")


def estimate_command(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = main(["estimate", "--nproc", "2", "--run.task=tests.tasks:tiny_gpt", *args])
    out, err = capsys.readouterr()
    return code, out, err


def test_the_command_prints_a_table_or_json_and_says_whether_it_fits(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, table, _ = estimate_command(capsys, "--memory", "1GB")
    assert code == 0
    assert "total, forward/backward" in table and "fits in 1.00 GB" in table
    code, out, _ = estimate_command(capsys, "--strategy.name=fsdp", "--memory", "1kB", "--json")
    assert code == 0
    estimate = json.loads(out)
    assert estimate["strategy"] == "fsdp" and estimate["fits"] is False
    assert estimate["peak"] == max(estimate["phases"].values())
    assert set(estimate["lines"]) >= {"parameters", "gradients", "optimizer state (adamw)"}


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["--nproc", "3", "--strategy.name=fsdp", "--strategy.tensor_parallel=2"],
            "strategy.tensor_parallel = 2 does not divide the world size 3",
        ),
        (["--run.task=tests.no_such:build"], "cannot import module 'tests.no_such'"),
        (
            ["--nproc", "4", "--strategy.name=tensor", "--strategy.tensor_parallel=4"],
            "multiples of the tensor-parallel degree 4",
        ),
        (["--train.activation_checkpointing=every:0"], "train.activation_checkpointing"),
        # A model without blocks under FSDP, which `dtrain train` refuses: it was estimated
        # ("fsdp at its peak (backward of block -1)").
        (
            ["--run.task=tests.tasks:mlp_regression", "--strategy.name=fsdp"],
            "strategy.name = 'fsdp': cannot find the repeated blocks of Sequential",
        ),
        (["--memory", "lots"], "--memory 'lots'"),
        (
            ["--run.task=tests.test_estimate:unbuildable_task"],
            "cannot be built on the meta device for an estimate: RuntimeError: needs its weights",
        ),
    ],
)
def test_bad_input_is_one_line_and_exit_code_2(
    capsys: pytest.CaptureFixture[str], args: list[str], message: str
) -> None:
    code, out, err = estimate_command(capsys, *args)
    assert code == 2 and not out
    assert message in err and len(err.strip().splitlines()) == 1, err


def test_the_help_says_what_is_counted() -> None:
    help_text = run_cli("estimate", "--help").stdout
    assert "--memory" in help_text and "Not counted" in help_text


# -- against real runs ---------------------------------------------------------------------

# fsdp: what torch's FSDP2 holds unsharded at its peak, counted from its own state after every
# operation of a real step (tests/fsdp_census.py), against the estimate's figure for it. Four
# blocks of d_model 64: the blocks hold 98% of the weights, so what FSDP holds is counted in
# blocks (the root: the tied embedding and head, positions, final norm).
FSDP_CASES: dict[str, dict[str, Any]] = {
    # backward: a block's parameters and gradients, the next one's prefetched flat buffer,
    # the last one's reduce-scatter input -- 4 blocks (2 in forward)
    "default": {},
    # nothing prefetched in backward (strategy.backward_prefetch = false): 3 blocks
    "no backward prefetch": {"strategy": {"backward_prefetch": False}},
    # every block stays gathered from its forward to its backward: 5 blocks
    "no reshard": {"strategy": {"reshard_after_forward": False}},
    # every unit's gradients unsharded until the last micro-batch's backward: 6 blocks
    "2 micro-batches": {"data": {"global_batch_size": 8, "micro_batches": 2}},
}


def fsdp_census_config(run_dir: Path, case: dict[str, Any]) -> dict[str, Any]:
    sections: dict[str, dict[str, Any]] = {
        "task": {"n_layer": 4, "d_model": 64, "seq_len": 8},
        "strategy": {"name": "fsdp"},
        # the census counts step 2's forward and backward (step 1 builds AdamW's state)
        "train": {"steps": 2, "log_every": 1, "activation_checkpointing": "full"},
        "data": {"global_batch_size": 4},
        "optim": {"name": "adamw", "warmup_steps": 0},
        "eval": {"every": 0, "max_samples": 2, "batch_size": 2},
    }
    for name, values in case.items():
        sections[name] = {**sections[name], **values}
    return tiny_raw(run_dir, **sections)


def test_fsdp_in_flight_is_what_torch_holds_unsharded(tmp_path: Path) -> None:
    from tests.fsdp_census import unsharded_peaks_of_each

    raws = [
        fsdp_census_config(tmp_path / str(i), case) for i, case in enumerate(FSDP_CASES.values())
    ]
    ranks = run_ranks(unsharded_peaks_of_each, 2, raws)
    default, off = list(FSDP_CASES).index("default"), list(FSDP_CASES).index("no backward prefetch")
    # Prefetching changes when a block is gathered, not what is computed; and the option
    # reached torch (as the census's 3 blocks against 4 below say too).
    assert_bit_equal(ranks[0][default]["params"], ranks[0][off]["params"])
    for rank in ranks:
        assert rank[default]["prefetch"] == ["default"] * 5  # the 4 blocks and the root
        assert rank[off]["prefetch"] == ["itself"] * 5
    for name, raw, *measured in zip(FSDP_CASES, raws, *ranks):
        estimate = estimate_memory(build_job_config(raw), 2)
        lines = dict((line.what, line.bytes) for line in estimate.lines)
        gathered = sum(v for k, v in lines.items() if k.startswith("fsdp"))
        unsynced = lines.get("gradients of the accumulation micro-steps, before their sync", 0)
        block = measured[0]["block"]
        peak = max(max(rank["peaks"].values()) for rank in measured)
        # Within 5%: the census cannot see the gradient of the tied embedding and head while
        # autograd sums its two uses in its own buffers (2% of the figure here).
        ratio = (gathered + unsynced) / peak
        assert 1.0 <= ratio <= 1.05, (
            f"{name}: estimated {(gathered + unsynced) / block:.2f} blocks unsharded, "
            f"torch held {peak / block:.2f}"
        )


# Two models where different parts dominate: activations (2 wide-context blocks), and the
# parameters with their gradients and AdamW state (4 blocks of d_model 384, short context).
SIZES = {
    "activations": {"n_layer": 2, "d_model": 192, "seq_len": 128, "samples": 32},
    "state": {"n_layer": 4, "d_model": 384, "seq_len": 64, "samples": 32},
}
STRATEGIES: dict[str, dict[str, Any]] = {
    "ddp": {"name": "ddp"},
    "fsdp": {"name": "fsdp"},
    # 1F1B with 2 micro-batches of 8 samples on 2 stages
    "pipeline": {"name": "pipeline", "pipeline_balance": "uniform"},
}


def measured_config(run_dir: Path, strategy: str, task: dict[str, Any]) -> dict[str, Any]:
    micro = 2 if strategy == "pipeline" else 1
    return tiny_raw(
        run_dir,
        task=task,
        strategy=STRATEGIES[strategy],
        # 3 AdamW steps: the optimizer's state exists from the first, ddp's staging bucket
        # from the second; the third is a step in its steady state.
        train={"steps": 4, "log_every": 1},
        optim={"name": "adamw", "lr": 1e-3, "warmup_steps": 0},
        data={"global_batch_size": 16, "micro_batches": micro},
    )


def warm_up_config(run_dir: Path, strategy: str) -> dict[str, Any]:
    """The same strategy on a tiny model: what its first run imports, connects and starts
    (modules, the collectives' connections, torch's threads) belongs to the runtime."""
    return measured_config(run_dir, strategy, {"n_layer": 2, "d_model": 32, "seq_len": 16})


def assert_within_15_percent(estimated: int, measured: int, what: str) -> None:
    ratio = estimated / measured
    assert 0.85 <= ratio <= 1.15, f"{what}: estimated {estimated}, measured {measured} B"


def test_the_estimate_is_within_15_percent_of_the_measured_peak(tmp_path: Path) -> None:
    # The measured peak: a rank's resident size above its size before the trainer was built
    # (the kernel's VmHWM), over set-up and 3 training steps, each strategy after a warm-up
    # run of its own, malloc returning freed blocks (tests/estimate_helpers.py). Here the
    # three strategies run one after the other in the same two processes; the slow test
    # below runs each size and strategy in fresh processes.
    size = SIZES["activations"]
    pairs = [
        (measured_config(tmp_path / name, name, size), warm_up_config(tmp_path / "w", name))
        for name in STRATEGIES
    ]
    peaks = run_ranks(peaks_after_warm_ups, 2, pairs)
    for (raw, _), *measured in zip(pairs, *peaks):
        estimate = estimate_memory(build_job_config(raw), 2)
        assert_within_15_percent(estimate.peak, max(measured), raw["strategy"]["name"])


@pytest.mark.slow
@pytest.mark.parametrize("strategy", sorted(STRATEGIES))
@pytest.mark.parametrize("size", sorted(SIZES))
def test_the_estimate_is_within_15_percent_at_two_sizes(
    tmp_path: Path, strategy: str, size: str
) -> None:
    raw = measured_config(tmp_path / "run", strategy, SIZES[size])
    peaks = run_ranks(peak_after_warm_up, 2, raw, warm_up_config(tmp_path / "w", strategy))
    estimate = estimate_memory(build_job_config(raw), 2)
    assert_within_15_percent(estimate.peak, max(peaks), f"{strategy}, {size}")


@pytest.mark.slow
@pytest.mark.parametrize(
    "strategy, checkpointing", [("ddp", "none"), ("fsdp", "every:2"), ("fsdp", "none")]
)
def test_the_estimate_is_within_15_percent_in_bf16_mixed(
    tmp_path: Path, strategy: str, checkpointing: str
) -> None:
    # bf16-mixed on a CPU: oneDNN's kernels for the bfloat16 products counted, and every:2
    # credited at the activations' real most (both were 0.75-0.8 of the measured peak).
    def bf16(raw: dict[str, Any]) -> dict[str, Any]:
        raw["train"] = {
            **raw["train"],
            "precision": "bf16-mixed",
            "activation_checkpointing": checkpointing,
        }
        return raw

    raw = bf16(measured_config(tmp_path / "run", strategy, SIZES["activations"]))
    warm_up = bf16(warm_up_config(tmp_path / "w", strategy))
    peaks = run_ranks(peak_after_warm_up, 2, raw, warm_up)
    estimate = estimate_memory(build_job_config(raw), 2)
    assert_within_15_percent(estimate.peak, max(peaks), f"{strategy} bf16-mixed {checkpointing}")


@pytest.mark.slow
def test_pipeline_x_fsdp_is_estimated_from_the_first_backward_on(tmp_path: Path) -> None:
    # Pipeline 2 x fsdp 2 on 4 ranks: torch's pipeline keeps a stage's layers gathered and
    # its gradients whole from its first backward to the end of the step, and a layer
    # gathered again in backward keeps its all-gather buffer beside: the peak of the first
    # stage is there, after its first micro-batch's backward (estimated 0.92 of the measured
    # peak while only two gathered layers were counted there). Never below 0.95: an estimate
    # says whether a config fits.
    strategy = {**STRATEGIES["pipeline"], "pipeline_stages": 2, "data_parallel": "fsdp"}
    raw = tiny_raw(
        tmp_path / "run",
        task=SIZES["state"],
        strategy=strategy,
        train={"steps": 4, "log_every": 1},
        optim={"name": "adamw", "lr": 1e-3, "warmup_steps": 0},
        data={"global_batch_size": 16, "micro_batches": 2},
    )
    warm_up = tiny_raw(
        tmp_path / "w",
        task={"n_layer": 2, "d_model": 32, "seq_len": 16},
        strategy=strategy,
        train={"steps": 4, "log_every": 1},
        optim={"name": "adamw", "lr": 1e-3, "warmup_steps": 0},
        data={"global_batch_size": 16, "micro_batches": 2},
    )
    peaks = run_ranks(peak_after_warm_up, 4, raw, warm_up, timeout=600)
    estimate = estimate_memory(build_job_config(raw), 4)
    ratio = estimate.peak / max(peaks)
    assert 0.95 <= ratio <= 1.15, f"estimated {estimate.peak}, measured {max(peaks)} B"


class _CountedRegression(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """96 regression samples that count how many an estimate reads, and refuse to be read
    a thousand times: building a micro-batch of every sample of a huge batch fails at once."""

    reads = 0

    def __len__(self) -> int:
        return 96

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        type(self).reads += 1
        assert type(self).reads < 1000, "the estimate read a sample per row of the batch"
        return torch.full((8,), float(i)), torch.ones(1)


def counted_regression(cfg: Any) -> Any:
    from tests.tasks import mlp_regression

    task = mlp_regression(cfg)
    task.train_data = _CountedRegression()
    return task


@pytest.mark.parametrize("strategy", ["ddp", "pipeline"])
def test_a_huge_batch_is_estimated_from_a_few_samples_scaled(tmp_path: Path, strategy: str) -> None:
    def activations(global_batch: int) -> int:
        cfg = tiny_config(
            tmp_path,
            run={"task": "tests.test_estimate:counted_regression"},
            strategy={"name": strategy},
            # ddp: 2 replicas; pipeline: 2 stages, 2 micro-batches. Either: half a rank's.
            data={"global_batch_size": global_batch, "micro_batches": 1 + (strategy != "ddp")},
        )
        _CountedRegression.reads = 0
        estimate = estimate_memory(cfg, 2)
        assert _CountedRegression.reads <= 64  # probe.SAMPLED_ROWS
        lines = {line.what.split(" (")[0]: line.bytes for line in estimate.lines}
        refused = f"data.global_batch_size = {global_batch} is more than the training set's 96"
        assert any(note.startswith(refused) for note in estimate.notes) == (global_batch > 96)
        return lines["activations"]

    small = activations(2 * 64)  # 64 rows a rank: the samples themselves
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    huge = activations(2 * 64 * 10**6)  # 6.4e7 rows a rank: the 64 scaled
    grown_mib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
    # An MLP saves the same bytes for every row: the activations scale with the rows exactly.
    assert huge == small * 10**6
    assert grown_mib < 64, f"the estimate's peak memory grew by {grown_mib:.0f} MiB"
