"""The config's schema: one dataclass per section, each key with its default, its range or
choices and its help, side by side -- validation, the error messages, ``dtrain config --list``
and docs/config.md all come from these declarations. The checks across keys are
:mod:`dtrain.config.checks`'s; reading TOML and overrides is :mod:`dtrain.config.load`'s."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal

import tomli_w

from dtrain.config.fields import option

# The unit a rank reads of a shard in an object store (one range request, one SHA-256 in the
# manifest `dtrain prepare` writes there): data/ reads and writes pieces of this size, and
# data.cache_bytes must hold one.
STORE_PIECE_BYTES = 2**20


@dataclass
class RunConfig:
    dir: str = option(
        "",
        "run folder; empty = runs/<run id>, or runs/<date-time> without one. Resumed if it "
        "exists. s3://bucket/prefix: checkpoints in an object store (docs/multi-host.md)",
    )
    local_dir: str = option(
        "",
        "with run.dir in an object store: this machine's folder for liveness, logs and "
        "metrics as they grow; empty = ~/.cache/dtrain/runs/<scheme>/<bucket>/<prefix>",
    )
    task: str = option("dtrain.tasks.gpt:build", "task factory 'package.module:function'")
    script: str = option(
        "",
        "a training loop of your own: a Python file whose main(run) trains with dtrain.Run "
        "(docs/own-loop.md); empty = dtrain's loop over run.task",
    )
    seed: int = option(0, "seed of the model init, the data order and every rank's RNG", min=0)
    resume: str = option(
        "auto",
        "'auto' (newest valid checkpoint in run.dir), 'never', or a step folder to start from",
    )
    init_from: str = option(
        "",
        "start from these weights, with a fresh optimizer: a .safetensors or torch file, a "
        "Hugging Face folder, a dtrain run folder or step-N checkpoint (a resumed run loads "
        "its checkpoint instead)",
    )
    init_adapter: str = option(
        "",
        "a PEFT adapter folder (adapter_config.json + adapter_model.safetensors) loaded into "
        "the task's PEFT model, over run.init_from's base",
    )


@dataclass
class DataConfig:
    global_batch_size: int = option(
        16,
        "samples per optimizer step, all ranks and micro-steps "
        "together; kept when the world size changes",
        min=1,
    )
    micro_batches: int = option(1, "gradient-accumulation micro-steps per optimizer step", min=1)
    shuffle: Literal["full", "locality", "none"] = option(
        "full", "order of each epoch: full shuffle, shard-local shuffle, or the stored order"
    )
    shuffle_window: int = option(
        0, "locality shuffle: samples per shuffle window (0 = 4 shards)", min=0
    )
    split: Literal["auto", "samples", "tokens"] = option(
        "auto",
        "split of a global batch across ranks: equal samples, or equal tokens for "
        "variable-length data ('auto' picks by the data)",
    )
    num_workers: int = option(0, "DataLoader worker processes per rank", min=0)
    prefetch: int = option(
        -1,
        "steps fetched ahead on a background thread (-1 = 2 on GPU, 0 on CPU, where the thread "
        "would compete with the step for the same cores)",
        min=-1,
    )
    cache_dir: str = option(
        "",
        "shards in an object store: where the ranks of a machine keep the pieces they read "
        "(a folder per dataset in it, shared by them; a folder of this machine; empty = the "
        "system's temporary folder)",
    )
    cache_bytes: int = option(
        2**30,
        "shards in an object store: a machine's cache of pieces read ahead, at most, shared "
        f"by its ranks (at least one piece, {STORE_PIECE_BYTES // 2**20} MiB)",
        min=1,
    )


@dataclass
class TrainConfig:
    steps: int = option(700, "optimizer steps", min=1)
    grad_clip: float = option(1.0, "max global gradient norm (0 = no clipping)", min=0)
    log_every: int = option(10, "steps between metrics lines", min=1)
    precision: Literal["fp32", "bf16-mixed", "fp16-mixed"] = option(
        "fp32",
        "forward and loss under autocast to bfloat16 or float16 (fp16: with dynamic loss "
        "scaling); weights, gradients and optimizer state stay float32, every strategy",
    )
    loss_scale_init: float = option(
        65536.0, "fp16-mixed: the loss scale to start from (a power of two)", min=1
    )
    loss_scale_growth_interval: int = option(
        2000, "fp16-mixed: steps in a row without an overflow before the loss scale doubles", min=1
    )
    activation_checkpointing: str = option(
        "none",
        "recompute the model's blocks in backward instead of keeping their activations: "
        "'none', 'full' (every block) or 'every:K' (every K-th block)",
    )
    compile: bool = option(
        False, "torch.compile each of the model's blocks (regional; checkpoint keys unchanged)"
    )
    profile: str = option(
        "none",
        "torch.profiler traces of steps A to B on every rank, into RUN_DIR/traces: "
        "'steps:A-B', 'steps:A' (one step) or 'none'",
    )
    profile_shapes: bool = option(False, "train.profile: record each op's input shapes")
    profile_stack: bool = option(
        False, "train.profile: record each op's Python stack (bigger traces, slower steps)"
    )


@dataclass
class OptimConfig:
    name: Literal["adamw", "sgd"] = option("adamw", "optimizer")
    lr: float = option(5e-3, "peak learning rate", min=0, min_exclusive=True)
    weight_decay: float = option(0.1, "decoupled weight decay (matrices only)", min=0)
    betas: list[float] = option([0.9, 0.95], "AdamW betas")
    momentum: float = option(0.9, "SGD momentum", min=0, max=1)
    implementation: Literal["foreach", "fused"] = option(
        "foreach",
        "the optimizer's kernels: 'foreach' (each operation once over all tensors; SGD: torch's "
        "default, foreach on CUDA) or 'fused' (the whole update of a tensor in one kernel, no "
        "temporaries: several times faster, docs/benchmarks.md; its results differ from "
        "foreach's in the last bit, so a run resumes bit-identically only under the same "
        "choice). A task's own Task.build_optimizer chooses its own",
    )
    schedule: Literal["cosine", "wsd", "constant"] = option(
        "cosine",
        "learning-rate schedule after the linear warm-up: 'cosine' (decay to min_lr_ratio over "
        "decay_steps), 'wsd' (warm-up, stable at lr, then a linear decay to min_lr_ratio over "
        "the last decay_steps), 'constant' (lr after the warm-up). A task's "
        "Task.build_scheduler replaces it",
    )
    warmup_steps: int = option(30, "linear warm-up steps", min=0)
    decay_steps: int = option(
        0,
        "steps the decay lasts. cosine: from the end of the warm-up, then lr stays at the floor "
        "(0 = until train.steps); wsd: the last decay_steps of train.steps (0 = a fifth of them)",
        min=0,
    )
    min_lr_ratio: float = option(
        0.1, "floor the decay reaches (cosine, wsd), as a fraction of lr", min=0, max=1
    )


@dataclass
class EvalConfig:
    every: int = option(250, "steps between evaluations (0 = only at the end)", min=0)
    batch_size: int = option(64, "samples per rank per evaluation batch", min=1)
    max_samples: int = option(
        512,
        "periodic evaluations use the first N validation samples (0 = all); the final one "
        "always uses the whole set",
        min=0,
    )


@dataclass
class CheckpointConfig:
    every: int = option(100, "steps between checkpoints (0 = only the final one)", min=0)
    keep_last: int = option(2, "newest checkpoints kept", min=1)
    keep_every: int = option(
        0, "also keep every checkpoint whose step divides by this (0 = no)", min=0
    )
    async_save: bool = option(
        True, "write checkpoints in the background; the loop waits only for a memory snapshot"
    )


@dataclass
class FaultConfig:
    nan_rollback_after: int = option(
        3,
        "consecutive steps with a non-finite loss or gradient before rolling back to the last "
        "checkpoint (0 = never roll back, only skip)",
        min=0,
    )
    preempt_signals: list[str] = option(
        ["SIGTERM", "SIGINT", "SIGUSR1"],
        "signals that make every rank save at the next step and exit 0: any of SIGTERM, "
        "SIGINT, SIGHUP, SIGUSR1, SIGUSR2, SIGQUIT, SIGXCPU (the signals that mean 'stop'); "
        "with SIGINT, Ctrl-C saves and a second Ctrl-C stops at once, unsaved",
    )
    preempt_grace_s: float = option(
        120.0, "time the launcher gives workers to save after a preemption signal", min=1
    )
    heartbeat_s: float = option(
        1.0,
        "seconds between liveness beats (names a rank that stops responding)",
        min=0,
        min_exclusive=True,
    )
    audit_sample_ids: bool = option(
        False,
        "write each data-parallel replica's sample ids per step to RUN_DIR/sample_ids/ "
        "(exactly-once audit)",
    )
    recovery: Literal["restart", "inplace"] = option(
        "restart",
        "after a worker fails: restart every worker from the newest checkpoint, or (ddp, "
        "allreduce) the survivors go on at the new world size and a restarted worker heals "
        "from a peer's memory (docs/fault-tolerance.md)",
    )
    min_replicas: int = option(
        1,
        "fault.recovery = 'inplace': the fewest workers training goes on with; a failure that "
        "leaves fewer stops the job (the survivors save a checkpoint; exit code 1)",
        min=1,
    )


@dataclass
class StrategyConfig:
    name: str = option("ddp", "parallel strategy (see `dtrain strategies`)")
    bucket_mb: float = option(25.0, "gradient bucket size in MB", min=0, min_exclusive=True)
    find_unused_parameters: bool = option(False, "ddp: allow parameters that get no gradient")
    sync_batchnorm: bool = option(
        False,
        "ddp, allreduce, fsdp: BatchNorm layers normalize over the whole global (micro-)batch, "
        "their statistics summed exactly over the data-parallel ranks, as one process would "
        "(docs/models.md); false: each rank normalizes over its own share",
    )
    reshard_after_forward: bool = option(
        True,
        "fsdp, and pipeline with data_parallel = 'fsdp': free gathered parameters after "
        "forward (less memory, one more all-gather)",
    )
    backward_prefetch: bool = option(
        True,
        "fsdp: gather the next block's parameters while a block runs backward; false: each "
        "block gathered when its own backward begins -- one block's parameters less at the "
        "peak; on a GPU the all-gather then no longer overlaps compute",
    )
    pipeline_stages: int = option(
        0,
        "pipeline: ranks per pipeline (0 = all); world size / pipeline_stages copies of the "
        "pipeline train data parallel",
        min=0,
    )
    pipeline_schedule: Literal["gpipe", "1f1b", "interleaved-1f1b"] = option(
        "1f1b", "pipeline: micro-batch schedule (data.micro_batches micro-batches per step)"
    )
    pipeline_virtual_stages: int = option(
        2, "pipeline: model chunks per rank with the interleaved-1f1b schedule", min=1
    )
    pipeline_boundaries: list[int] = option(
        [],
        "pipeline: first layer of every stage but the first, e.g. [3, 6] (empty = balancer)",
    )
    pipeline_balance: Literal["profile", "uniform"] = option(
        "profile",
        "pipeline: stage boundaries from measured layer times (exact partition), or equal "
        "layer counts",
    )
    tensor_parallel: int = option(
        0,
        "ranks that split each layer (tensor parallelism): tensor: 0 = all ranks, the rest "
        "train data parallel; fsdp, pipeline: 0 = none",
        min=0,
    )
    data_parallel: Literal["replicate", "fsdp"] = option(
        "replicate",
        "pipeline, tensor: the data-parallel ranks are replicas (gradients all-reduced) or FSDP "
        "shards",
    )
    dp_replicate: int = option(
        1,
        "fsdp (and data_parallel = 'fsdp'): copies of the sharded model, each sharded over "
        "world / (dp_replicate x tensor_parallel x stages) ranks (hybrid sharding)",
        min=1,
    )


@dataclass
class CommConfig:
    compression: Literal["none", "fp16", "bf16", "powersgd", "topk"] = option(
        "none",
        "gradient compression of ddp and allreduce: none, fp16, bf16, powersgd (low rank, "
        "error feedback) or topk (largest entries, error feedback)",
    )
    transport: str = option(
        "backend",
        "how ddp and allreduce sum gradients between ranks: 'backend' through dist.backend's "
        "collectives, or an opt-in transport (docs/communication.md)",
    )
    powersgd_rank: int = option(4, "powersgd: rank of the low-rank approximation", min=1)
    powersgd_start_step: int = option(
        10,
        "powersgd: steps of plain all-reduce before compressing (at least 2, as torch's "
        "PowerSGD requires)",
        min=0,
    )
    powersgd_factors: Literal["fp32", "fp16", "bf16"] = option(
        "fp32",
        "powersgd: the format its factors (and the small tensors it sends whole) travel in; "
        "fp16 or bf16 halve the bytes (the products and the error feedback keep the gradients' "
        "precision)",
    )
    topk_fraction: float = option(
        0.01,
        "topk: fraction of each bucket's entries sent per step",
        min=0,
        max=1,
        min_exclusive=True,
    )
    sync_every: int = option(
        8, "localsgd, diloco: local optimizer steps between synchronizations (H)", min=1
    )
    local_start_step: int = option(
        0,
        "localsgd, diloco: steps of plain data parallelism first (gradients all-reduced every "
        "step, one model), then local steps (post-local SGD; DiLoCo's start from a "
        "data-parallel model)",
        min=0,
    )
    outer_lr: float = option(
        0.7,
        "diloco: learning rate of the outer Nesterov step (the DiLoCo paper's, for H in the "
        "hundreds; at small H lower it and outer_momentum, e.g. 0.5 and 0.5 at H = 8: "
        "docs/communication.md)",
        min=0,
        min_exclusive=True,
    )
    outer_momentum: float = option(
        0.9, "diloco: momentum of the outer Nesterov step (the DiLoCo paper's)", min=0, max=1
    )


@dataclass
class BalanceConfig:
    mode: Literal["off", "throughput"] = option(
        "off",
        "per-rank batch shares: 'off' (equal), or 'throughput' (in proportion to each rank's "
        "measured speed; ddp and allreduce). Per-rank timing and straggler reports run either way",
    )
    every: int = option(
        10, "steps between gathers of every rank's timing (and updates of the shares)", min=1
    )
    window_s: float = option(
        1.0,
        "seconds a timing window lasts at least: where balance.every steps take less, the "
        "gathers are spaced by the steps that fit in this time at the ranks' mean step time "
        "(at most 1000); 0 = exactly every balance.every steps",
        min=0,
    )
    smoothing: float = option(
        0.5,
        "weight of the newest timing window in the smoothed per-item times (1 = no smoothing)",
        min=0,
        max=1,
        min_exclusive=True,
    )
    max_change: float = option(
        0.25, "largest relative change of a rank's weight in one update", min=0, min_exclusive=True
    )
    hysteresis: float = option(
        0.05,
        "shares move only when the predicted step time would drop by more than this fraction",
        min=0,
    )
    min_weight: float = option(
        0.1,
        "floor of a rank's weight, as a fraction of an equal share (no rank gets nothing)",
        min=0,
        max=1,
        min_exclusive=True,
    )
    max_micro_batch: int = option(
        0,
        "samples a rank holds per micro-batch at most; a larger share accumulates over more "
        "micro-steps (0 = the equal split's micro-batch, global_batch_size / (ranks x "
        "micro_batches) rounded up)",
        min=0,
    )
    straggler_threshold: float = option(
        1.25,
        "a rank whose time per item (data + compute) exceeds the other ranks' median by this "
        "factor is a straggler",
        min=1,
        min_exclusive=True,
    )
    straggler_window: int = option(
        50, "steps a rank must stay that slow before it is named in the log", min=1
    )


@dataclass
class MetricsConfig:
    tensorboard: bool = option(
        False,
        "also write TensorBoard event files to RUN_DIR/tensorboard (needs the tensorboard "
        "extra: pip install -e '.[tensorboard]' in dtrain's clone)",
    )
    trackers: list[Literal["wandb", "mlflow"]] = option(
        [],
        "experiment trackers that get the run's config and records beside metrics.jsonl, from "
        "rank 0: 'wandb', 'mlflow' (each needs its extra: pip install -e '.[wandb]'); "
        "docs/observability.md",
    )
    project: str = option(
        "",
        "the trackers' W&B project and MLflow experiment; empty = WANDB_PROJECT and "
        "MLFLOW_EXPERIMENT_NAME, else each tracker's default",
    )
    tags: list[str] = option(
        [],
        "tags of the tracker runs, each 'name' or 'key=value' (MLflow's tags are key-value; "
        "W&B's are added to WANDB_TAGS)",
    )
    tracking_uri: str = option(
        "",
        "MLflow's tracking URI (a server http://host:5000, sqlite:///mlflow.db, a folder); "
        "empty = MLFLOW_TRACKING_URI, else MLflow's default",
    )


@dataclass
class DistConfig:
    backend: Literal["auto", "gloo", "nccl"] = option("auto", "collective backend")
    device: Literal["auto", "cpu", "cuda"] = option("auto", "compute device")
    timeout_s: float = option(300.0, "collective timeout in seconds", min=0, min_exclusive=True)
    threads: int = option(0, "torch threads per worker (0 = cores / local workers)", min=0)
    pin_cores: bool = option(
        False,
        "CPU workers: bind each worker of a machine to its own equal share of the cores (when "
        "every worker gets at least its threads); false = the OS places them",
    )
    connect_timeout_s: float = option(
        30.0,
        "at start, how long a rank tries to reach the job's store and its peers before it fails "
        "naming the address it could not reach",
        min=0,
        min_exclusive=True,
    )


@dataclass
class Config:
    run: RunConfig = field(default_factory=RunConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    strategy: StrategyConfig = field(default_factory=StrategyConfig)
    comm: CommConfig = field(default_factory=CommConfig)
    dist: DistConfig = field(default_factory=DistConfig)
    fault: FaultConfig = field(default_factory=FaultConfig)
    balance: BalanceConfig = field(default_factory=BalanceConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    # The task's own options, validated against the task's config class when it declares one.
    task: Any = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)  # the [task] section too, a dict or its dataclass

    def to_toml(self) -> str:
        return tomli_w.dumps(self.to_dict())


def describe_options() -> list[tuple[str, Any, str]]:
    """(key, default, help) for every documented option, in declaration order."""
    cfg = Config()
    return [
        (f"{s.name}.{f.name}", getattr(getattr(cfg, s.name), f.name), f.metadata.get("help", ""))
        for s in dataclasses.fields(cfg)
        if s.name != "task"
        for f in dataclasses.fields(getattr(cfg, s.name))
    ]
