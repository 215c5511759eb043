"""The task's model built without memory, and what one micro-batch's forward saves for backward
(docs/strategies.md, "How much memory a rank needs").

The forward runs on *fake* tensors (meta tensors that carry a device) rather than plain meta
ones, because autocast -- ``train.precision`` -- acts on a device's tensors only. Each storage
autograd saves is counted once, the parameters' own left out, and attributed to the block
(:func:`model_blocks`) and, for a pipeline, the layer of the chain that saved it first, so that
activation checkpointing and each stage's share follow from one forward::

    with saved_tensors_hooks(record):   # record: storage -> (bytes, layer, block)
        loss_fn(model(inputs), targets).sum()   # under the run's autocast
"""

from __future__ import annotations

import contextlib
import copy
import functools
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

from dtrain.config import Config
from dtrain.data.loader import map_tensors
from dtrain.errors import UserError
from dtrain.estimate.kernels import Signature, product_signature
from dtrain.task import Task, build_task, resolve_task

OUTSIDE = -1  # saved outside any block


def build_meta_task(cfg: Config) -> Task:
    """The task of ``cfg`` with its model built on the meta device (no memory). A factory
    that fails is a one-line error naming it."""
    factory = resolve_task(cfg.run.task)
    try:
        with torch.device("meta"):
            return build_task(factory, cfg)
    except UserError:
        raise
    except Exception as exc:
        raise UserError(
            f"run.task = {cfg.run.task!r} cannot be built on the meta device for an estimate: "
            f"{type(exc).__name__}: {exc}"
        ) from None


# An estimate reads at most this many samples: a larger micro-batch is their collated batch
# with its leading dimension scaled (a global batch of 10^8 must not build 10^8 samples).
SAMPLED_ROWS = 64


def example_micro_batch(task: Task, rows: int) -> tuple[Any, Any]:
    """The shapes and dtypes of one micro-batch of ``rows`` samples (their values are not
    used): the first samples collated and split as the loader does, at most
    :data:`SAMPLED_ROWS` of them; beyond that, every tensor's leading dimension (the samples,
    or a packed batch's items) scaled from those samples to ``rows``, as a meta tensor."""
    data = task.train_data
    try:
        count = len(data)
    except TypeError:
        raise UserError(
            "the task's train_data has no length: an estimate needs its first samples for the "
            "shape of a micro-batch"
        ) from None
    if count == 0:
        raise UserError("the task's train_data is empty: no micro-batch to measure")
    taken = min(rows, SAMPLED_ROWS)
    batch = task.split_batch(task.collate_fn([data[i % count] for i in range(taken)]))
    if taken == rows:
        return batch
    scaled = _scaled(batch, taken, rows)
    assert isinstance(scaled, tuple)
    return scaled


def _scaled(batch: Any, taken: int, rows: int) -> Any:
    """``batch`` of ``taken`` samples as one of ``rows``: each tensor's leading dimension
    multiplied by ``rows / taken`` (rounded up), on the meta device (no memory)."""

    def scale(tensor: torch.Tensor) -> torch.Tensor:
        if tensor.dim() == 0:
            return tensor
        leading = -(-tensor.shape[0] * rows // taken)
        return torch.empty((leading, *tensor.shape[1:]), dtype=tensor.dtype, device="meta")

    return map_tensors(batch, scale)


def fake_model(model: nn.Module, mode: FakeTensorMode) -> nn.Module:
    """A copy of ``model`` whose parameters and buffers are fake CPU tensors (no memory),
    tied parameters still one."""
    memo: dict[int, Any] = {}
    with mode:
        for tensor in (*model.parameters(), *model.buffers()):
            if id(tensor) in memo:
                continue
            fake = torch.empty_strided(tensor.shape, tensor.stride(), dtype=tensor.dtype)
            if isinstance(tensor, nn.Parameter):
                fake = nn.Parameter(fake, requires_grad=tensor.requires_grad)
            memo[id(tensor)] = fake
    return copy.deepcopy(model, memo)


def fake_batch(batch: Any, mode: FakeTensorMode) -> Any:
    """``batch`` with every tensor a fake CPU tensor of its shape and dtype."""

    def fake(tensor: torch.Tensor) -> torch.Tensor:
        with mode:
            return torch.empty_strided(tensor.shape, tensor.stride(), dtype=tensor.dtype)

    return map_tensors(batch, fake)


def cut_for_tensor_parallel(model: nn.Module, styles: dict[str, str], degree: int) -> None:
    """Give each linear map the plan cuts the part one rank of ``degree`` holds (column-wise:
    1/degree of its outputs; row-wise: of its inputs), in place: the model's forward then
    computes what one rank of a tensor-parallel group computes (the all-reduce after a
    row-wise map keeps its shape)."""
    for name, style in styles.items():
        linear = model.get_submodule(name)
        assert isinstance(linear, nn.Linear)
        with torch.no_grad():
            if style == "colwise":
                rows = linear.out_features // degree
                linear.weight = nn.Parameter(linear.weight[:rows].clone())
                if linear.bias is not None:
                    linear.bias = nn.Parameter(linear.bias[:rows].clone())
                linear.out_features = rows
            else:
                cols = linear.in_features // degree
                linear.weight = nn.Parameter(linear.weight[:, :cols].clone())
                linear.in_features = cols


def storage_key(tensor: torch.Tensor) -> tuple[int, int]:
    """One storage's identity while it lives, and its bytes."""
    storage = tensor.untyped_storage()
    return storage._cdata, storage.nbytes()


@dataclass
class SavedProfile:
    """What one micro-batch's forward saved for backward, storage by storage."""

    # storage -> (bytes, index of the block that saved it first; OUTSIDE: none)
    saved: dict[int, tuple[int, int]] = field(default_factory=dict)
    # each block's input storages (what a checkpointed block keeps)
    block_inputs: dict[int, dict[int, int]] = field(default_factory=dict)

    def activations(self, checkpoint_every: int = 0, through: int | None = None) -> int:
        """Bytes kept for backward at their most with every ``checkpoint_every``-th block
        checkpointed (0: none). A checkpointed block keeps only its inputs, and in backward
        recomputes what it saved, one block at a time; backward runs the blocks in reverse,
        so while block b is recomputed the blocks after it have freed theirs: the most is
        at the end of forward (everything kept) or at some checkpointed block's
        recomputation (what the blocks before it keep, its inputs, its saved tensors).
        What no block saved (embeddings, head, loss) counts throughout. ``through``: only
        what the blocks up to that one and no block saved (in that block's forward the
        later blocks' is not made yet; in its backward it is freed)."""

        def checkpointed(block: int) -> bool:
            return checkpoint_every > 0 and block >= 0 and block % checkpoint_every == 0

        if through is None:  # the last block that saved anything
            last = max([b for _, b in self.saved.values()] + [*self.block_inputs, OUTSIDE])
        else:
            last = through

        def kept_before(stop: int) -> dict[int, int]:
            """What the blocks before ``stop`` and no block keep once their forward ran."""
            kept = {
                key: size
                for key, (size, block) in self.saved.items()
                if block < stop and not checkpointed(block)
            }
            for block, inputs in self.block_inputs.items():
                if block < stop and checkpointed(block):
                    kept.update(inputs)
            return kept

        recomputed: dict[int, int] = {}
        for size, block in self.saved.values():
            if checkpointed(block) and block <= last:
                recomputed[block] = recomputed.get(block, 0) + size
        most = sum(kept_before(last + 1).values())
        for block, size in recomputed.items():
            held = kept_before(block) | self.block_inputs.get(block, {})
            most = max(most, sum(held.values()) + size)
        return most


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from _tensors(item)


class LiveBytes(TorchDispatchMode):
    """Counts the bytes of the storages torch's operations make while it is active, until each
    is freed (a weak reference to the storage says when), and their peak. The storages of
    ``existing`` (the parameters, the batch: made before) are not counted, nor are views of
    them that operations return. ``extra`` is added to the peak's candidates as it is (the
    gradients made so far, which :func:`profile_pass` frees at once)."""

    def __init__(self, existing: set[int]) -> None:
        super().__init__()
        self.existing = existing
        self.live: dict[int, Any] = {}
        self.current = 0
        self.peak = 0
        self.extra = 0
        self.peak_with_extra = 0
        self.products: set[Signature] = set()  # distinct bfloat16 matrix products

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        product = product_signature(func, args)
        if product is not None:
            self.products.add(product)
        for tensor in _tensors(out):
            storage = tensor.untyped_storage()
            key = storage._cdata
            if key in self.live or key in self.existing:
                continue
            size = storage.nbytes()
            self.live[key] = weakref.ref(storage, functools.partial(self._freed, key, size))
            self.current += size
            self.peak = max(self.peak, self.current)
            self.peak_with_extra = max(self.peak_with_extra, self.current + self.extra)
        return out

    def _freed(self, key: int, size: int, _: Any) -> None:
        if self.live.pop(key, None) is not None:
            self.current -= size


@dataclass
class PassProfile:
    """One micro-batch's forward and backward through a model (or a pipeline stage)."""

    saved: SavedProfile
    # Peak bytes of what the pass made (activations, their gradients, temporaries), the
    # parameters' gradients freed as soon as each is complete ...
    working: int
    # ... and with the parameters' gradients kept as they are completed (a first micro-batch
    # whose gradients did not exist before it).
    working_with_grads: int
    grads: int  # bytes of the parameters' gradients the pass made
    # the distinct bfloat16 matrix products it ran (:mod:`.kernels`)
    products: frozenset[Signature] = frozenset()


def profile_pass(
    model: nn.Module,
    inputs: Any,
    run: Callable[[], torch.Tensor],
    blocks: Sequence[nn.Module],
    autocast: Callable[[], contextlib.AbstractContextManager[Any]],
    mode: FakeTensorMode,
) -> PassProfile:
    """Run ``run()`` (the forward and loss, or a stage's forward, of ``inputs``; the model's
    tensors and the inputs fake)
    under ``autocast`` and backward from what it returns, recording what the forward saves
    for backward (by block, :class:`SavedProfile`) and the pass's peak memory
    (:class:`LiveBytes`). A block of ``blocks`` whose forward is checkpointed saves nothing
    the hooks see (its own hooks take over): its inputs are recorded instead."""
    profile = SavedProfile()
    state = {"block": OUTSIDE}
    params = [p for p in model.parameters() if p.requires_grad]
    own = {storage_key(t)[0] for t in (*model.parameters(), *model.buffers())}
    live = LiveBytes(own | {storage_key(t)[0] for t in _tensors(inputs)})

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        key, size = storage_key(tensor)
        if key not in own and key not in profile.saved:
            profile.saved[key] = (size, state["block"])
        return tensor  # held by the graph: no storage is freed, so no key is reused

    def entering(index: int) -> Any:
        def hook(module: nn.Module, args: Any, kwargs: Any) -> None:
            state["block"] = index
            found = dict(storage_key(t) for t in _tensors((args, kwargs)))
            profile.block_inputs[index] = {k: v for k, v in found.items() if k not in own}

        return hook

    def leaving(module: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
        state["block"] = OUTSIDE

    def grad_done(param: torch.Tensor) -> None:
        assert param.grad is not None
        live.extra += storage_key(param.grad)[1]
        param.grad = None  # counted in ``extra`` from here on

    handles: list[Any] = []
    for index, block in enumerate(blocks):
        handles.append(block.register_forward_pre_hook(entering(index), with_kwargs=True))
        handles.append(block.register_forward_hook(leaving, with_kwargs=True))
    handles += [p.register_post_accumulate_grad_hook(grad_done) for p in params]
    try:
        with mode, live:
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), autocast():
                out = run()
            if out.dim() == 0:
                out.backward()
            else:
                out.backward(torch.empty_like(out))
            del out
    finally:
        for handle in handles:
            handle.remove()
    return PassProfile(
        profile, live.peak, live.peak_with_extra, live.extra, frozenset(live.products)
    )
