"""``localsgd`` and ``diloco``: data parallelism that communicates every H steps, not every step
(docs/communication.md, "Fewer rounds", gives the step, the sync and the warm-up at length).

Each rank trains its own replica with the inner optimizer on its share of every global batch;
nothing is synchronized in backward. The replicas meet every H = ``comm.sync_every`` steps
counted from ``comm.local_start_step``, and at the run's last step so that it ends on one model:
localsgd averages the parameters; diloco averages the outer gradient (anchor - replica), steps
the anchor with an outer Nesterov SGD and restarts every replica from it. Floating-point buffers
are averaged with them, in flat buckets of ``strategy.bucket_mb``. The first
``comm.local_start_step`` steps are plain data parallelism (gradients averaged every step).

Clipping is per replica; :meth:`LocalSGDStrategy.clip_grad_norm` returns the largest local norm
over the ranks (+inf where any is not finite), so the NaN guard takes one branch everywhere.
Checkpoints hold every rank's replica and inner optimizer state (the per-rank form), diloco's
``outer`` replicated; resume at another size: docs/communication.md, "Checkpoints and resume".
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from dtrain.checkpoint.forms import Form, Origin, Part
from dtrain.config import CommConfig, Config, StrategyConfig
from dtrain.console import say_line
from dtrain.dist.runtime import Runtime
from dtrain.errors import CheckpointError
from dtrain.parallel.base import Strategy
from dtrain.parallel.grad_sync import MIB, assign_buckets, average_bucket, average_flat, split_like
from dtrain.parallel.recipe import Recipe
from dtrain.task import Task


class LocalSGDStrategy(Strategy):
    """local SGD: a replica per rank, parameters averaged every comm.sync_every steps"""

    name = "localsgd"
    state_form = Form.PER_RANK  # the replicas differ between syncs

    def __init__(
        self,
        runtime: Runtime,
        options: StrategyConfig,
        comm: CommConfig,
        recipe: Recipe,
        *,
        steps: int,
    ) -> None:
        super().__init__(runtime, options, comm, recipe)
        self.steps = steps  # train.steps: the replicas meet at the last step too
        self.params: list[nn.Parameter] = []  # what the inner optimizer updates (tied: once)
        self.param_buckets: list[list[nn.Parameter]] = []
        self.buffer_buckets: list[list[torch.Tensor]] = []  # floating-point buffers
        self.next_step = 1  # the step the next backward is for

    @classmethod
    def from_config(cls, cfg: Config, runtime: Runtime) -> Strategy:
        recipe = Recipe.from_config(cfg, runtime.device)
        return cls(runtime, cfg.strategy, cfg.comm, recipe, steps=cfg.train.steps)

    def warming_up(self, step: int) -> bool:
        """Whether ``step`` is one of the data-parallel steps before the local ones."""
        return step <= self.comm_options.local_start_step

    # -- set-up --------------------------------------------------------------------------

    def setup(self, task: Task) -> None:
        self.module = self.model = self.build_replica(task)
        # parameters() yields a tied parameter once, so it is averaged once.
        self.params = [p for p in self.module.parameters() if p.requires_grad]
        buffers = [b for b in self.module.buffers() if b.is_floating_point()]
        cap = max(1, int(self.options.bucket_mb * MIB))
        self.param_buckets = [[self.params[i] for i in m] for m in assign_buckets(self.params, cap)]
        self.buffer_buckets = [[buffers[i] for i in m] for m in assign_buckets(buffers, cap)]
        if self.data_parallel_size > 1:
            # Replicas start equal (frozen parameters and integer buffers then stay equal).
            self.broadcast_from_first([*self.module.parameters(), *self.module.buffers()])

    # -- the step ------------------------------------------------------------------------

    def sync_gradients(self) -> None:
        # Plain local accumulation: no gradient leaves this rank -- except in the warm-up,
        # where the gradients are averaged as data parallelism does.
        if self.warming_up(self.next_step) and self.data_parallel_size > 1:
            self._average_gradients()

    @torch.no_grad()
    def _average_gradients(self) -> None:
        """Collective: every parameter's gradient becomes the mean over the group. Each
        rank's loss is scaled by ``data_parallel_size / global_items``, so the mean is the
        gradient of the global mean loss, as in ``ddp``. A parameter this rank did not use
        contributes zeros; one that no rank used keeps no gradient (a flag per parameter
        rides in the same buffer), so the optimizer skips it as it would under ``ddp``."""
        for params in self.param_buckets:
            used = [p.grad is not None for p in params]
            grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
            flags = torch.tensor(used, dtype=grads[0].dtype, device=grads[0].device)
            flat = average_flat(
                torch.cat([*(g.reshape(-1) for g in grads), flags]),
                self.data_parallel_group,
                self.comm,
            )
            grads_part, flags_part = flat[: -len(params)], flat[-len(params) :]
            for param, part, anyone in zip(params, split_like(grads_part, params), flags_part):
                if param.grad is not None:
                    param.grad.copy_(part)
                elif anyone > 0:
                    param.grad = part.clone()

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        """Clip this replica's gradient by its own norm; return the largest local norm over the
        ranks (+inf if any rank's is not finite), so that every rank skips or steps alike."""
        local = super().clip_grad_norm(max_norm).detach().float()
        agreed = torch.where(torch.isfinite(local), local, torch.full_like(local, float("inf")))
        agreed = agreed.reshape(1).to(self.runtime.device)
        if self.data_parallel_size > 1:
            with self.comm.waiting():
                dist.all_reduce(agreed, op=dist.ReduceOp.MAX, group=self.data_parallel_group)
            self.comm.all_reduce(agreed.element_size(), self.data_parallel_size)
        return agreed[0]

    def sync_due(self, step: int) -> bool:
        """Whether the replicas meet after ``step``: every H steps counted from the end of the
        warm-up (a resumed run meets at the same steps), and at the last step; never in the
        warm-up, where they do not part."""
        if self.warming_up(step):
            return False
        return self._since_sync(step) == 0 or step == self.steps

    def _since_sync(self, step: int) -> int:
        """Local steps after ``step`` since the replicas last met (0 in the warm-up)."""
        start = self.comm_options.local_start_step
        return (step - start) % self.comm_options.sync_every if step > start else 0

    def agree_on_buffers(self) -> None:
        """Nothing: the replicas' buffers are averaged with their parameters at every
        synchronization (between them each replica is evaluated as it stands)."""

    def after_optimizer_step(self, step: int) -> None:
        self.next_step = step + 1
        if self.sync_due(step):
            self.synchronize()

    @torch.no_grad()
    def synchronize(self) -> None:
        """Collective: average the replicas' parameters and floating-point buffers."""
        buckets: list[Sequence[torch.Tensor]] = [*self.param_buckets, *self.buffer_buckets]
        for tensors in buckets:
            average_bucket(tensors, self.data_parallel_group, self.comm)

    # -- state ---------------------------------------------------------------------------

    def load_beside(self, parts: dict[str, Any], origin: Origin) -> None:
        """After the replicas: every rank took its own when the checkpoint was saved at this
        data-parallel size with one replica per rank, otherwise rank 0's (a checkpoint of a
        replicated strategy, or another world size: see the module's doc)."""
        self.next_step = origin.step + 1
        self._after_load(parts, origin)
        if origin.per_rank and not origin.own and self.runtime.is_main:
            say_line(f"dtrain: {self._resize_message(origin)}")

    def _after_load(self, parts: dict[str, Any], origin: Origin) -> None:
        """What a subclass restores beside the replica (diloco: the anchor)."""

    # What a resume at another data-parallel size starts from, and what it drops when saved
    # {since} local steps after the sync at step {at}.
    _restart = "every rank starts from rank 0's replica and inner optimizer state"
    _dropped = (
        "; it was saved {since} step(s) after the sync at step {at}: the other replicas' local "
        "progress since then is not carried over"
    )

    def _resize_message(self, origin: Origin) -> str:
        since = self._since_sync(origin.step)
        dropped = self._dropped.format(since=since, at=origin.step - since) if since else ""
        return (
            f"{self.name}: {origin.folder} holds {origin.data_parallel_size} replicas and this "
            f"run has {self.data_parallel_size} ranks; {self._restart}{dropped}"
        )


class DiLoCoStrategy(LocalSGDStrategy):
    """DiLoCo: local steps, then an outer Nesterov step on the averaged update every H steps"""

    name = "diloco"
    _restart = (
        "every rank restarts from the anchor (the global model of the last outer step) with "
        "rank 0's inner optimizer state"
    )
    _dropped = (
        "; the replicas' {since} local step(s) since the outer step at step {at} are not "
        "carried over"
    )

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.anchor: list[torch.Tensor] = []  # the global parameters of the last sync
        self.anchor_names: list[str] = []
        self.outer_optimizer: torch.optim.SGD | None = None

    def setup(self, task: Task) -> None:
        super().setup(task)
        assert self.module is not None
        trained = {id(p) for p in self.params}
        # named_parameters() yields a tied parameter once, under its first name.
        self.anchor_names = [n for n, p in self.module.named_parameters() if id(p) in trained]
        self.anchor = [p.detach().clone() for p in self.params]
        self.outer_optimizer = self._build_outer_optimizer()

    @torch.no_grad()
    def after_optimizer_step(self, step: int) -> None:
        if step == self.comm_options.local_start_step:
            # The replicas are one data-parallel model now: the outer steps start from it.
            for anchor, param in zip(self.anchor, self.params):
                anchor.copy_(param)
        super().after_optimizer_step(step)

    def _build_outer_optimizer(self) -> torch.optim.SGD:
        momentum = self.comm_options.outer_momentum
        # torch refuses Nesterov without momentum; with momentum 0 both are plain SGD.
        return torch.optim.SGD(
            self.anchor, lr=self.comm_options.outer_lr, momentum=momentum, nesterov=momentum > 0
        )

    @torch.no_grad()
    def synchronize(self) -> None:
        """Collective: the outer step. Each bucket's outer gradient (anchor - replica) is
        averaged over the group; the outer optimizer moves the anchor by it; every replica
        restarts from the new anchor. Floating-point buffers are averaged."""
        assert self.outer_optimizer is not None
        anchor_of = {id(p): a for p, a in zip(self.params, self.anchor)}
        for bucket in self.param_buckets:
            anchors = [anchor_of[id(p)] for p in bucket]
            # delta: (bucket numel,), this replica's move since the last sync, negated.
            delta = torch.cat([(a - p).reshape(-1) for a, p in zip(anchors, bucket)])
            average_flat(delta, self.data_parallel_group, self.comm)
            for anchor, part in zip(anchors, split_like(delta, anchors)):
                anchor.grad = part
        self.outer_optimizer.step()
        for param, anchor in zip(self.params, self.anchor):
            anchor.grad = None
            param.copy_(anchor)
        for buffers in self.buffer_buckets:
            average_bucket(buffers, self.data_parallel_group, self.comm)

    # -- state ---------------------------------------------------------------------------

    def state_dicts(self, optimizer: torch.optim.Optimizer) -> dict[str, Part]:
        assert self.outer_optimizer is not None
        parts = super().state_dicts(optimizer)
        # The anchor and the outer optimizer are the same on every rank.
        outer = {
            "anchor": dict(zip(self.anchor_names, self.anchor)),
            "optimizer": self.outer_optimizer.state_dict(),
        }
        parts["outer"] = Part(Form.REPLICATED, outer)
        return parts

    @torch.no_grad()
    def _after_load(self, parts: dict[str, Any], origin: Origin) -> None:
        """The anchor and the outer momentum from ``outer``; at another world size every
        replica restarts from the anchor. A checkpoint without ``outer`` (saved by another
        strategy) starts the anchor at rank 0's model with no outer momentum."""
        if "outer" in parts:
            anchor, outer_state = parts["outer"]["anchor"], parts["outer"]["optimizer"]
            if sorted(anchor) != sorted(self.anchor_names):
                raise CheckpointError(
                    f"{origin.folder}: diloco's anchor's parameters do not match the "
                    f"model's ({sorted(set(anchor) ^ set(self.anchor_names))[:5]}); resume "
                    "with the model that saved it"
                )
            for name, tensor in zip(self.anchor_names, self.anchor):
                tensor.copy_(anchor[name])
        else:
            outer_state = None
            for tensor, param in zip(self.anchor, self.params):
                tensor.copy_(param)
            if origin.own and self.data_parallel_size > 1:
                # Each rank took its own replica (localsgd's, at this size): rank 0's is the
                # anchor, which every rank must share.
                self.broadcast_from_first(self.anchor)
        self.outer_optimizer = self._build_outer_optimizer()
        if outer_state is not None:
            self.outer_optimizer.load_state_dict(outer_state)
        # At another world size every replica restarts from the anchor -- after the
        # warm-up; in it, the model (rank 0's, the same on every rank) is already the one.
        if not origin.own and not self.warming_up(self.next_step - 1):
            for param, tensor in zip(self.params, self.anchor):
                param.copy_(tensor)
