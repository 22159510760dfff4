"""Wide ResNet (Zagoruyko & Komodakis, 2016) for CIFAR: ``wrn28-10``.

The original pre-activation network: a 3x3 stem conv with 16 channels, three groups of
``(depth - 4) / 6`` blocks with ``16k, 32k, 64k`` channels (``k`` the widening factor;
the last two groups start with stride 2), each block BN-ReLU-conv3x3-BN-ReLU-conv3x3 with
an identity shortcut or, where the shape changes, a 1x1 conv on the pre-activated input;
then BN, ReLU, global average pool, dropout and a linear ``fc``. Convolutions have no
bias. WRN-28-10 has 36,479,194 parameters with 10 classes and 36,536,884 with 100, the
figures of the original code (and of the Rank-1 paper's "36.5M").

torchvision has no CIFAR Wide ResNet, so the keys follow its ResNet naming where one
applies: ``conv1``, ``layer{1-3}.{i}.{bn1,conv1,bn2,conv2}``, ``layer{1-3}.0.shortcut``
(the 1x1 conv, as this package's CIFAR ResNet-18 names its shortcut), the final ``bn``
and ``fc``.
"""

from __future__ import annotations

from torch import Tensor, nn

from posteriorzoo.errors import InvalidOptionError
from posteriorzoo.models.registry import register
from posteriorzoo.options import check_integer, check_probability

__all__ = ["WideBasicBlock", "WideResNet"]


class WideBasicBlock(nn.Module):
    """Pre-activation block: BN-ReLU-conv3x3 (stride) - BN-ReLU-conv3x3, plus a shortcut.

    The shortcut is the identity when the shape is kept, else a 1x1 conv (stride
    ``stride``) applied to the block's pre-activated input, as in the original code.
    ``(N, in_planes, H, W)`` -> ``(N, planes, ceil(H / stride), ceil(W / stride))``.
    """

    def __init__(self, in_planes: int, planes: int, stride: int = 1) -> None:
        super().__init__()
        self.bn1 = nn.BatchNorm2d(in_planes)
        self.conv1 = nn.Conv2d(in_planes, planes, 3, stride=stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, stride=1, padding=1, bias=False)
        self.relu = nn.ReLU()
        self.projects = stride != 1 or in_planes != planes
        if self.projects:
            self.shortcut = nn.Conv2d(in_planes, planes, 1, stride=stride, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        """Residual block forward pass (shapes in the class docstring)."""
        activated = self.relu(self.bn1(x))
        out = self.conv1(activated)
        out = self.conv2(self.relu(self.bn2(out)))
        return out + (self.shortcut(activated) if self.projects else x)


class WideResNet(nn.Module):
    """Wide ResNet ``depth``-``widen_factor`` for 32x32 images (layout in the module
    docstring).

    Parameters
    ----------
    depth : int, default 28
        ``6 n + 4`` for ``n`` blocks per group.
    widen_factor : int, default 10
        Channels of the three groups are ``16, 32, 64`` times this; small values give
        fast test nets.
    num_classes : int, default 10
    dropout : float, default 0.0
        Dropout probability on the input of ``fc`` (adds no parameters).
    in_channels : int, default 3

    Notes
    -----
    Input ``(N, in_channels, H, W)`` -> logits ``(N, num_classes)``; feature maps are
    ``H, H/2, H/4`` across the groups.
    """

    def __init__(self, depth: int = 28, widen_factor: int = 10, num_classes: int = 10,
                 dropout: float = 0.0, in_channels: int = 3) -> None:
        super().__init__()
        depth = check_integer("depth", depth, 10)
        if (depth - 4) % 6:
            raise InvalidOptionError(f"depth must be 6 n + 4 (10, 16, 22, 28, ...), not {depth}")
        widen_factor = check_integer("widen_factor", widen_factor, 1)
        num_classes = check_integer("num_classes", num_classes, 1)
        in_channels = check_integer("in_channels", in_channels, 1)
        blocks = (depth - 4) // 6
        self.conv1 = nn.Conv2d(in_channels, 16, 3, stride=1, padding=1, bias=False)
        in_planes = 16
        for index in range(3):
            planes = 16 * 2**index * widen_factor
            stride = 1 if index == 0 else 2
            stage = [WideBasicBlock(in_planes, planes, stride)]
            stage += [WideBasicBlock(planes, planes) for _ in range(blocks - 1)]
            self.add_module(f"layer{index + 1}", nn.Sequential(*stage))
            in_planes = planes
        self.bn = nn.BatchNorm2d(in_planes)
        self.relu = nn.ReLU()
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.flatten = nn.Flatten(1)
        self.dropout = nn.Dropout(check_probability("dropout", dropout))
        self.fc = nn.Linear(in_planes, num_classes)

    def features(self, x: Tensor) -> Tensor:
        """Pooled penultimate features ``(N, C, H, W)`` -> ``(N, 64 * widen_factor)``."""
        x = self.layer3(self.layer2(self.layer1(self.conv1(x))))
        return self.flatten(self.pool(self.relu(self.bn(x))))

    def forward(self, x: Tensor) -> Tensor:
        """Map images ``(N, C, H, W)`` to logits ``(N, num_classes)``."""
        return self.fc(self.dropout(self.features(x)))


@register(
    "wrn28-10",
    num_classes=10,
    input_shape=(3, 32, 32),
    description="Wide ResNet 28-10 for CIFAR (pre-activation): 36,479,194 parameters at 10 "
                "classes, 36,536,884 at 100",
    options={"widen_factor": 10, "dropout": 0.0},
)
def _build_wrn28_10(num_classes: int, widen_factor: int, dropout: float) -> WideResNet:
    return WideResNet(depth=28, widen_factor=widen_factor, num_classes=num_classes,
                      dropout=dropout)
