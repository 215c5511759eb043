"""Mixed precision (``train.precision``): the forward and the loss in a 16-bit format through
``torch.autocast``, the weights, gradients and optimizer state in float32.

=============  ===========================================================================
fp32           everything in float32 (the default)
bf16-mixed     forward and loss under autocast to bfloat16: float32's range, so no loss
               scaling is needed
fp16-mixed     forward and loss under autocast to float16, with dynamic loss scaling
               (:class:`LossScaler`): the loss is multiplied by a power of two before
               backward, so that small gradients stay representable, and the gradients are
               divided by it again before clipping; a step whose gradient overflowed is
               skipped and the scale halved
=============  ===========================================================================

One context (:meth:`Precision.autocast`) covers every forward the trainer runs and the loss
from it, so every strategy computes one process's numbers under the same precision; backward runs
outside it (docs/recipes.md, ``train.precision``).
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from dtrain.errors import UserError

DTYPES: dict[str, torch.dtype] = {"bf16-mixed": torch.bfloat16, "fp16-mixed": torch.float16}


class Precision:
    """What ``train.precision`` names, on this rank's device."""

    def __init__(self, name: str, device: torch.device) -> None:
        self.name = name
        self.dtype = DTYPES.get(name)  # None: fp32
        self.device_type = device.type
        if self.dtype is not None:
            check_supported(name, self.dtype, device)

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        """The context every forward (and its loss) runs in; a no-op in fp32."""
        if self.dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device_type, dtype=self.dtype)

    @property
    def scales_loss(self) -> bool:
        """Whether the format needs a dynamic loss scaler (float16's narrow range)."""
        return self.dtype == torch.float16


def check_supported(name: str, dtype: torch.dtype, device: torch.device) -> None:
    """A one-line error where this device cannot run ``name``."""
    where = f"train.precision = {name!r}"
    if not torch.amp.autocast_mode.is_autocast_available(device.type):
        raise UserError(f"{where}: torch has no autocast for device {device.type!r}; use fp32")
    if device.type == "cuda" and dtype == torch.bfloat16 and not torch.cuda.is_bf16_supported():
        raise UserError(
            f"{where}: GPU {torch.cuda.get_device_name(device)} has no bfloat16 arithmetic "
            "(it needs compute capability 8.0 or newer); use fp16-mixed"
        )
    try:  # a tiny matrix product: where the device lacks the kernels, torch says so here
        with torch.autocast(device.type, dtype=dtype):
            probe = torch.ones(2, 2, device=device)
            (probe @ probe).sum().item()
    except RuntimeError as exc:
        raise UserError(f"{where}: this {device.type} cannot run it ({exc}); use fp32") from None


class LossScaler:
    """Dynamic loss scaling for float16 (torch's ``GradScaler`` rule, in the trainer's hands).

    ``scale`` multiplies the loss before backward; the trainer divides the gradients by it
    after their sync. A step whose gradient norm is not finite while its loss is finite
    overflowed because of the scale: it is skipped on every rank and the scale halved. After
    ``growth_interval`` steps in a row without one the scale doubles. Powers of two only, so
    multiplying and dividing by it is exact. Its state is part of the training state: a
    resumed run scales as the uninterrupted one did.
    """

    def __init__(
        self,
        scale: float = 2.0**16,
        growth_interval: int = 2000,
        min_scale: float = 1.0,
    ) -> None:
        self.scale = scale
        self.growth_interval = growth_interval
        self.min_scale = min_scale
        self.good_steps = 0  # steps since the last overflow or growth
        self._noted = False  # an update within the step overflowed (note_overflow)

    def note_overflow(self) -> None:
        """An update within the step overflowed (a further optimizer's, in a loop of the
        user's own: skipped): the step's :meth:`update` counts it as the step's overflow, as
        torch's ``GradScaler`` halves once for any of a step's optimizers."""
        self._noted = True

    def update(self, overflowed: bool) -> None:
        overflowed, self._noted = overflowed or self._noted, False
        if overflowed:
            self.scale = max(self.min_scale, self.scale / 2)
            self.good_steps = 0
            return
        self.good_steps += 1
        if self.good_steps >= self.growth_interval:
            self.scale *= 2
            self.good_steps = 0

    def state_dict(self) -> dict[str, Any]:
        return {"scale": self.scale, "good_steps": self.good_steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scale = float(state["scale"])
        self.good_steps = int(state["good_steps"])
