"""Where and how the torch engine trains: a device, bf16 autocast, channels-last.

On a GPU a ResNet-18 trains in minutes per checkpoint instead of the 45-53 CPU-hours of
these 2 cores. There it runs under bf16 autocast (matrix products in bfloat16, weights and
optimiser state in float32) with channels-last activations (the layout the GPU's
convolution kernels want), and the data set sits on the device: batches are gathered and
augmented there (the random crops and flips are drawn from the same seeded CPU generator
as on CPU, so a run sees the same examples in the same order on every device).

Every choice is an option, so the GPU's code path runs on CPU too (``make test`` trains
with ``TrainingDevice("cpu", autocast=True, channels_last=True)``). The defaults are the
fast ones of each device: float32 and the standard layout on CPU (bit for bit the torch
engine of before), bf16 and channels-last on CUDA.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import torch

from posteriorzoo.devices import check_device

__all__ = ["CPU", "TrainingDevice", "check_device", "resolve_device"]


@dataclass(frozen=True)
class TrainingDevice:
    """A device and how the torch engine computes on it (module docstring).

    ``autocast`` and ``channels_last`` default to the device's fast choice: True on CUDA,
    False on CPU.
    """

    name: str = "cpu"
    autocast: bool | None = None
    channels_last: bool | None = None

    @property
    def device(self) -> torch.device:
        return torch.device(self.name)

    @property
    def mixed(self) -> bool:
        """Whether the forward and backward passes run under bf16 autocast."""
        return self.device.type == "cuda" if self.autocast is None else self.autocast

    @property
    def memory_format(self) -> torch.memory_format:
        wanted = (self.device.type == "cuda" if self.channels_last is None
                  else self.channels_last)
        return torch.channels_last if wanted else torch.contiguous_format

    def place(self, model: torch.nn.Module) -> torch.nn.Module:
        """``model`` on the device, in its memory format (in place, as ``Module.to``)."""
        # Module.to accepts memory_format (as Tensor.to); torch's stubs omit it.
        return model.to(self.device, memory_format=self.memory_format)  # type: ignore[call-overload]

    def inputs(self, images: torch.Tensor) -> torch.Tensor:
        """A batch of images in the model's memory format (on the device already)."""
        if images.dim() == 4 and self.memory_format is torch.channels_last:
            return images.contiguous(memory_format=torch.channels_last)
        return images

    def compute(self) -> contextlib.AbstractContextManager[Any]:
        """The context of a forward pass (and its backward): bf16 autocast or nothing."""
        if not self.mixed:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=torch.bfloat16)

    @property
    def is_cpu_default(self) -> bool:
        """Plain float32 on CPU: the torch engine as it always was."""
        return (self.device.type == "cpu" and not self.mixed
                and self.memory_format is torch.contiguous_format)


#: Plain float32 on CPU.
CPU = TrainingDevice()


def resolve_device(device: str | torch.device | TrainingDevice | None) -> TrainingDevice:
    """A :class:`TrainingDevice` from a name (checked by :func:`check_device`) or itself."""
    if device is None:
        return CPU
    if isinstance(device, TrainingDevice):
        check_device(device.name)
        return device
    return TrainingDevice(str(check_device(device)))
