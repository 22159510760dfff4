"""A small convolutional encoder: the BYOV study's network (seed 004, at the size of a CPU).

Layer list, with spatial sizes for a 28x28 input and the default ``widths=(16, 32, 64)``::

    convs.0  Conv2d(in_channels -> 16, k=3, padding 1, no bias)   28 -> 28
    norms.0  GroupNorm(1, 16), ReLU, MaxPool2d(2)                 28 -> 14
    convs.1  Conv2d(16 -> 32, k=3, padding 1, no bias)            14 -> 14
    norms.1  GroupNorm(1, 32), ReLU, MaxPool2d(2)                 14 -> 7
    convs.2  Conv2d(32 -> 64, k=3, padding 1, no bias)             7 -> 7
    norms.2  GroupNorm(1, 64), ReLU
    global average pool, flatten                                   -> (N, 64)

Every block but the last halves the image (max pool). The output is the representation
(``widths[-1]`` features), not class logits: it is an encoder, to be followed by a
projector (self-supervised training) or a linear probe. GroupNorm with one group
normalises each image over its channels and positions, so the network needs no batch
statistics (no buffers: every state_dict entry is a parameter, as BYOV's Bayesian layers
need) and a convolution needs no bias (the norm's shift plays its part).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from torch import Tensor, nn

from posteriorzoo.errors import InvalidOptionError, ZooSchemaError
from posteriorzoo.models.registry import register
from posteriorzoo.options import check_integer

__all__ = ["SmallCNN"]

_DEFAULT_WIDTHS = (16, 32, 64)
_IMAGE_SIZE = 28


def _check_widths(widths: Sequence[int]) -> tuple[int, ...]:
    if isinstance(widths, (str, bytes)) or not isinstance(widths, Sequence) or not widths:
        raise InvalidOptionError(f"widths must be a non-empty sequence of integers, got "
                                 f"{widths!r}")
    return tuple(check_integer("every entry of widths", w, 1) for w in widths)


class SmallCNN(nn.Module):
    """Conv3x3 - GroupNorm - ReLU blocks, max-pooled between them, then a global average.

    Parameters
    ----------
    widths : sequence of int, default (16, 32, 64)
        Output channels of each block; the representation has ``widths[-1]`` features.
    in_channels : int, default 1
        Channels of the input images.

    Notes
    -----
    Input ``(N, in_channels, H, W)`` -> representation ``(N, widths[-1])``. Any image of
    at least ``2 ** (len(widths) - 1)`` pixels a side works (the average pool is
    global). State-dict keys: ``convs.{i}.weight`` ``(widths[i], c_in, 3, 3)`` and
    ``norms.{i}.weight``, ``norms.{i}.bias`` ``(widths[i],)``; parameter count
    ``sum 9 c_in(i) widths[i] + 2 widths[i]``.
    """

    def __init__(self, widths: Sequence[int] = _DEFAULT_WIDTHS, in_channels: int = 1) -> None:
        super().__init__()
        self.widths = _check_widths(widths)
        channels = (check_integer("in_channels", in_channels, 1), *self.widths)
        self.convs = nn.ModuleList(nn.Conv2d(a, b, kernel_size=3, padding=1, bias=False)
                                   for a, b in zip(channels[:-1], channels[1:], strict=True))
        self.norms = nn.ModuleList(nn.GroupNorm(1, b) for b in self.widths)
        self.relu = nn.ReLU()
        self.pool = nn.MaxPool2d(2)

    def forward(self, x: Tensor) -> Tensor:
        """Map images ``(N, in_channels, H, W)`` to representations ``(N, widths[-1])``."""
        last = len(self.convs) - 1
        for index, (conv, norm) in enumerate(zip(self.convs, self.norms, strict=True)):
            x = self.relu(norm(conv(x)))
            if index < last:
                x = self.pool(x)
        return x.mean(dim=(2, 3))


def _input_shape(options: Mapping[str, Any]) -> tuple[int, ...]:
    return (check_integer("in_channels", options["in_channels"], 1), _IMAGE_SIZE, _IMAGE_SIZE)


@register(
    "small-cnn",
    num_classes=None,
    input_shape=_input_shape,
    description="small conv encoder (3x3 conv, GroupNorm, ReLU blocks; output widths[-1] "
                "features): the BYOV study's",
    options={"widths": _DEFAULT_WIDTHS, "in_channels": 1},
)
def _build_small_cnn(num_classes: int | None, widths: Sequence[int],
                     in_channels: int) -> SmallCNN:
    checked = _check_widths(widths)
    # The outputs are the representation, widths[-1]; another num_classes (e.g. from a
    # collection's manifest) describes a different network.
    if num_classes is not None and num_classes != checked[-1]:
        raise ZooSchemaError(f"small-cnn outputs widths[-1] = {checked[-1]} features; "
                             f"num_classes {num_classes} disagrees")
    return SmallCNN(widths=checked, in_channels=in_channels)
