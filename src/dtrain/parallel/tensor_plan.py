"""What tensor parallelism cuts: the model names it (``model.tensor_parallel_plan(degree)``
returns ``{module name: "colwise" | "rowwise"}``; the built-in GPT cuts the attention's heads
and the MLP's hidden units, Megatron-style), and this checks it against the model; a Hugging
Face model without that method gets the plan dtrain knows for it (:mod:`.hf_plan`), if any."""

from __future__ import annotations

from torch import nn
from torch.distributed.tensor.parallel import ParallelStyle

from dtrain.errors import ConfigError
from dtrain.parallel.hf_plan import KNOWN, STYLES, hf_plan, knows
from dtrain.parallel.transposed import FusedHeadsAttention


def model_plan(model: nn.Module, degree: int, held_only: bool = False) -> dict[str, ParallelStyle]:
    """The parallel style of each linear map the model's plan cuts at ``degree``; with
    ``held_only``, of those this rank holds (a pipeline stage's: the others hold no
    parameters here)."""
    plan_of = getattr(model, "tensor_parallel_plan", None)
    if not callable(plan_of):
        return _known_plan(model, degree, held_only)
    try:
        plan = dict(plan_of(degree))
    except ValueError as exc:
        raise ConfigError(f"strategy.tensor_parallel = {degree}: {exc}") from None
    styles: dict[str, ParallelStyle] = {}
    for name, style in plan.items():
        module = model.get_submodule(name)
        if held_only and not any(True for _ in module.parameters(recurse=False)):
            continue
        if not isinstance(module, nn.Linear) or style not in STYLES:
            raise ConfigError(
                f"{type(model).__name__}.tensor_parallel_plan: {name} = {style!r}; expected an "
                "nn.Linear cut 'colwise' or 'rowwise'"
            )
        cut = module.out_features if style == "colwise" else module.in_features
        if cut % degree:
            raise ConfigError(
                f"strategy.tensor_parallel = {degree}: {name} has {cut} features to cut "
                f"{style}, not a multiple of {degree}"
            )
        styles[name] = STYLES[style]()
    return styles


def has_plan(model: nn.Module) -> bool:
    """Whether the model names its cuts, or dtrain knows them (:mod:`.hf_plan`)."""
    return callable(getattr(model, "tensor_parallel_plan", None)) or knows(model)


def _known_plan(model: nn.Module, degree: int, held_only: bool) -> dict[str, ParallelStyle]:
    """The plan of a Hugging Face model dtrain knows (:mod:`dtrain.parallel.hf_plan`)."""
    kind = type(model).__name__
    try:
        plan = hf_plan(model, degree)
    except ValueError as exc:
        raise ConfigError(
            f"strategy.tensor_parallel = {degree} cannot split {kind}: {exc}"
        ) from None
    if plan is None:
        raise ConfigError(
            f"strategy.tensor_parallel = {degree} cannot split {kind}: expected a model with a "
            "tensor_parallel_plan(degree) method returning {module name: 'colwise' | 'rowwise'} "
            f"for the nn.Linear layers to cut, or one whose plan dtrain knows ({KNOWN}); "
            "give the model that method, or use ddp or fsdp"
        )
    if held_only:  # a pipeline stage's: the layers it holds parameters of
        plan = {
            name: style
            for name, style in plan.items()
            if any(True for _ in model.get_submodule(name).parameters())
        }
    return plan


def check_not_sharded(model: nn.Module, styles: dict[str, ParallelStyle]) -> None:
    """FSDP cannot shard what is cut inside blocks (GPT-2's fused q|k|v): on a 1-D bias it
    would lay its shards over tensor parallelism's as over a plain cut, and the whole tensor it
    then describes (saves, exports) is not the model's."""
    fused = [name for name, style in styles.items() if isinstance(style, FusedHeadsAttention)]
    if fused:
        raise ConfigError(
            f"FSDP with tensor parallelism cannot shard {type(model).__name__}: {fused[0]}'s "
            "fused q|k|v projection is cut by head, which FSDP's layout over it does not "
            "describe; use strategy.name = 'tensor' with data_parallel = 'replicate', or fsdp "
            "without tensor_parallel"
        )


def check_no_dropout(model: nn.Module) -> None:
    """Every rank of a tensor-parallel group computes the replicated activations itself; with
    dropout each would draw its own mask, and the copies would drift apart."""
    for name, module in model.named_modules():
        if isinstance(module, nn.Dropout) and module.p > 0:
            raise ConfigError(
                f"strategy.name = 'tensor' needs a model without dropout, but {name} drops "
                f"p = {module.p}: the ranks of a tensor-parallel group would draw different "
                "masks for the activations they all hold; set the model's dropout to 0"
            )
