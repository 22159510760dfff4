"""Device names (``cpu``, ``cuda``, ``cuda:N``): parsed from the command line and checked
against what this torch can use, with one-line errors, for every command with
``--device`` (train, canonicalize, mmd, report, evaluate)."""

from __future__ import annotations

import argparse
import re
from typing import TYPE_CHECKING

from posteriorzoo.errors import InvalidOptionError

if TYPE_CHECKING:
    import torch

__all__ = ["check_device", "device_name"]


def device_name(text: str) -> str:
    """argparse type: ``cpu``, ``cuda`` or ``cuda:N``; whether this machine has it is
    checked when the command uses it (:func:`check_device`)."""
    if not re.fullmatch(r"cpu|cuda(:[0-9]{1,3})?", text):
        raise argparse.ArgumentTypeError(f"a device is cpu, cuda or cuda:N, not {text!r}")
    return text


def check_device(name: str | torch.device) -> torch.device:
    """``cpu``, ``cuda`` or ``cuda:N`` as a torch device, refused in one line when it is
    not one of those or this torch cannot use it."""
    import torch  # here: parsing a command line needs no torch

    try:
        device = torch.device(name)
    except (RuntimeError, TypeError) as error:
        raise InvalidOptionError(f"device must be cpu, cuda or cuda:N, not {name!r}") from error
    if device.type not in ("cpu", "cuda"):
        raise InvalidOptionError(f"device must be cpu, cuda or cuda:N, not {name!r}")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise InvalidOptionError(
                f"device {name}: this torch ({torch.__version__}) sees no CUDA GPU; install "
                "a CUDA build of torch on a machine with a GPU, or use --device cpu")
        count = torch.cuda.device_count()
        if device.index is not None and device.index >= count:
            raise InvalidOptionError(f"device {name}: this machine has {count} GPU(s) "
                                     f"(cuda:0 to cuda:{count - 1})")
    return device
