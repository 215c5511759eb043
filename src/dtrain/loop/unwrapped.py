"""Naming a model that a loop of the user's own trains without giving it to the run.

Its gradients would never be synchronized (each rank would step its own copy apart from the
others'), and no checkpoint would hold it. Which parameters a backward reaches is only known in
the autograd graph, where a sharded strategy's parameters are stand-ins of the module's own; a
module, though, keeps its identity under every wrapper. So, for the process's first step only
(it costs a Python call per module called), a global forward pre-hook notes the first module
called with gradients enabled that holds parameters requiring them outside every model the run
holds; the step (or the update) names it in one line. A model first used on a later step
is not seen."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn
from torch.nn.modules.module import register_module_forward_pre_hook
from torch.utils.hooks import RemovableHandle

from dtrain.errors import UserError


class UnwrappedWatch:
    """The first module called outside ``known`` with trainable parameters of its own, while
    it is open."""

    def __init__(self, known: Iterable[nn.Module]) -> None:
        self.known = {id(module) for module in known}
        self.seen: nn.Module | None = None
        self._handle: RemovableHandle | None = register_module_forward_pre_hook(self._called)

    def _called(self, module: nn.Module, args: Any) -> None:
        if self.seen is not None or id(module) in self.known or not torch.is_grad_enabled():
            return
        # Its own trainable parameters, or a part's outside every known model (a container
        # of a known model and a head of its own): named by the outermost module called.
        for part in module.modules():
            if id(part) not in self.known and any(
                p.requires_grad for p in part.parameters(recurse=False)
            ):
                self.seen = module
                return

    def check(self, step: int) -> None:
        """Raise the one line that names the module seen, if any."""
        if self.seen is None:
            return
        kind = type(self.seen).__name__
        self.close()
        raise UserError(
            f"step {step}: a {kind} with trainable parameters ran in the loop outside every "
            "model the run holds: its gradients are never synchronized over the ranks, nor is "
            "it checkpointed; give it to run.wrap(name, model, optimizer=...) (frozen: "
            "without optimizer) and call what that returns"
        )

    def close(self) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None
