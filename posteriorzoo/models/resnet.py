"""ResNets: ResNet-18 in its CIFAR form (3x3 stride-1 stem, no max-pool), and the
ImageNet layout of torchvision (7x7 stride-2 stem, max-pool) for ResNet-18 and ResNet-50.

CIFAR ResNet-18 state-dict keys follow torchvision's layout (``conv1``, ``bn1``,
``layer{1-4}.{0,1}.{conv1,bn1,conv2,bn2}``, ``fc``) except the projection
shortcut, which is ``layer{2-4}.0.shortcut.{0,1}`` (a conv then a BN), as in
torch-uncertainty, whose released checkpoints the paper's zoo comes from. The rest of
torch-uncertainty's ResNet-18 (``style="cifar"``) has our names too, but for its head,
``linear`` (ours ``fc``), which :mod:`posteriorzoo.zoo.keymap` renames on import; its
convolutions have biases when built with ``conv_bias=True`` (the option of that name).

The ImageNet networks (:class:`ImageNetResNet`: ``resnet18-imagenet``, ``resnet50``) are
written here, not imported from torchvision, with torchvision's keys exactly: the
projection shortcut is ``layer{i}.0.downsample.{0,1}``, a bottleneck block has
``conv1/bn1`` (1x1), ``conv2/bn2`` (3x3, carrying the stride, as torchvision's "v1.5")
and ``conv3/bn3`` (1x1, 4x the planes), so torchvision checkpoints load unchanged.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from torch import Tensor, nn

from posteriorzoo.models.registry import register
from posteriorzoo.options import check_bool, check_integer, check_probability

__all__ = ["BasicBlock", "Bottleneck", "ImageNetBasicBlock", "ImageNetResNet", "ResNet18"]

_BLOCKS_PER_STAGE = (2, 2, 2, 2)


class BasicBlock(nn.Module):
    """Two 3x3 conv-BN layers with an identity or 1x1 conv-BN shortcut.

    Parameters
    ----------
    in_planes, planes : int
        Input and output channels.
    stride : int, default 1
        Stride of the first conv (and of the shortcut conv).
    conv_bias : bool, default False
        Whether every convolution has a bias (torch-uncertainty's ``conv_bias``).

    Notes
    -----
    ``(N, in_planes, H, W)`` -> ``(N, planes, ceil(H / stride), ceil(W / stride))``.
    """

    def __init__(self, in_planes: int, planes: int, stride: int = 1,
                 conv_bias: bool = False) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_planes, planes, 3, stride=stride, padding=1, bias=conv_bias)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, stride=1, padding=1, bias=conv_bias)
        self.bn2 = nn.BatchNorm2d(planes)
        self.relu = nn.ReLU()
        # An empty Sequential is the identity and contributes no state_dict keys.
        self.shortcut = nn.Sequential()
        if stride != 1 or in_planes != planes:
            self.shortcut = nn.Sequential(
                nn.Conv2d(in_planes, planes, 1, stride=stride, bias=conv_bias),
                nn.BatchNorm2d(planes),
            )

    def forward(self, x: Tensor) -> Tensor:
        """Residual block forward pass (shapes in the class docstring)."""
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + self.shortcut(x))


def _add_stages(network: nn.Module, block: Callable[[int, int, int, bool], nn.Module],
                blocks_per_stage: tuple[int, ...], width: int, conv_bias: bool) -> int:
    """Register ``layer1``, ``layer2``, ... on ``network``: the CIFAR ResNets' stages.

    Stage ``i`` (from 0) has ``blocks_per_stage[i]`` blocks of ``width * 2**i`` channels,
    the first with stride 2 but in stage 0; a block is built as
    ``block(in_planes, planes, stride, conv_bias)``. One loop for ResNet-18 and
    ResNet-20-FRN, so their stage layout (hence their state-dict keys) cannot drift apart.
    Returns the channels of the last stage, the input width of the head.
    """
    planes = width
    for index, blocks in enumerate(blocks_per_stage):
        out_planes = width * 2**index
        stride = 1 if index == 0 else 2
        stage = [block(planes, out_planes, stride, conv_bias)]
        stage += [block(out_planes, out_planes, 1, conv_bias) for _ in range(blocks - 1)]
        network.add_module(f"layer{index + 1}", nn.Sequential(*stage))
        planes = out_planes
    return planes


class ResNet18(nn.Module):
    """CIFAR-style ResNet-18.

    Stem: 3x3 conv, stride 1, no bias, BN, ReLU, no max-pool. Four stages of
    two :class:`BasicBlock` with ``width * (1, 2, 4, 8)`` channels, the last
    three starting with stride 2; global average pool; dropout; linear ``fc``.

    Parameters
    ----------
    num_classes : int, default 100
        Outputs of ``fc``. With ``width=64`` and 100 classes the network has
        11,220,132 trainable parameters.
    width : int, default 64
        Channels of the stem and first stage; small values give fast test nets.
    dropout : float, default 0.0
        Dropout probability on the pooled features, i.e. the input of ``fc``
        (the paper's last-layer MC Dropout uses 0.5). Adds no parameters.
    in_channels : int, default 3
        Image channels.
    conv_bias : bool, default False
        Give every convolution a bias, as torch-uncertainty's ``resnet(conv_bias=True)``
        does (its default from February 2024 to May 2025; its ResNet baseline, which
        trains with ``conv_bias=False``, and ours have none): then a checkpoint of that
        variant imports. A bias before a BatchNorm changes nothing in training mode.

    Notes
    -----
    Input ``(N, in_channels, H, W)`` -> logits ``(N, num_classes)``; any ``H, W``
    works thanks to the global pool. Feature maps are ``H, H/2, H/4, H/8``
    across the stages (32 -> 4 for CIFAR, 64 -> 8 for TinyImageNet).
    Weights use PyTorch's default module initialisation, as torch-uncertainty
    (the authors' training code) does.
    """

    def __init__(
        self, num_classes: int = 100, width: int = 64, dropout: float = 0.0, in_channels: int = 3,
        conv_bias: bool = False,
    ) -> None:
        super().__init__()
        num_classes = check_integer("num_classes", num_classes, 1)
        width = check_integer("width", width, 1)
        in_channels = check_integer("in_channels", in_channels, 1)
        conv_bias = check_bool("conv_bias", conv_bias)
        self.conv1 = nn.Conv2d(in_channels, width, 3, stride=1, padding=1, bias=conv_bias)
        self.bn1 = nn.BatchNorm2d(width)
        self.relu = nn.ReLU()
        planes = _add_stages(self, BasicBlock, _BLOCKS_PER_STAGE, width, conv_bias)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.flatten = nn.Flatten(1)
        self.dropout = nn.Dropout(check_probability("dropout", dropout))
        self.fc = nn.Linear(planes, num_classes)

    def features(self, x: Tensor) -> Tensor:
        """Pooled penultimate features: ``(N, C, H, W)`` -> ``(N, 8 * width)``."""
        x = self.relu(self.bn1(self.conv1(x)))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.flatten(self.pool(x))

    def forward(self, x: Tensor) -> Tensor:
        """Map images ``(N, C, H, W)`` to logits ``(N, num_classes)``."""
        return self.fc(self.dropout(self.features(x)))


_OPTIONS = {"width": 64, "dropout": 0.0, "in_channels": 3}
#: The CIFAR ResNet-18's options: those and torch-uncertainty's ``conv_bias``.
_CIFAR_OPTIONS = {**_OPTIONS, "conv_bias": False}


def _image_shape(size: int) -> Callable[[Mapping[str, Any]], tuple[int, int, int]]:
    """The input shape rule of a registered ResNet: ``(in_channels, size, size)``, so a
    ResNet trains on a 1-channel data set with ``in_channels = 1``."""
    def shape(options: Mapping[str, Any]) -> tuple[int, int, int]:
        return check_integer("in_channels", options["in_channels"], 1), size, size
    return shape


@register(
    "resnet18",
    num_classes=100,
    input_shape=_image_shape(32),
    description="ResNet-18, CIFAR stem (3x3 stride 1, no max-pool); CIFAR-100 by default",
    options=_CIFAR_OPTIONS,
)
def _build_resnet18(num_classes: int, width: int, dropout: float,
                    in_channels: int, conv_bias: bool) -> ResNet18:
    return ResNet18(num_classes=num_classes, width=width, dropout=dropout,
                    in_channels=in_channels, conv_bias=conv_bias)


@register(
    "resnet18-tiny",
    num_classes=200,
    input_shape=_image_shape(64),
    description="ResNet-18 for TinyImageNet: the CIFAR network at native 64x64, 200 classes",
    options=_CIFAR_OPTIONS,
)
def _build_resnet18_tiny(num_classes: int, width: int, dropout: float,
                         in_channels: int, conv_bias: bool) -> ResNet18:
    # The paper trains TinyImageNet "as for CIFAR-100, at the original
    # resolution", and torch-uncertainty's TinyImageNet recipe builds its ResNet
    # with style="cifar"; so the stem is the CIFAR one, not 7x7/stride 2 + max-pool.
    return ResNet18(num_classes=num_classes, width=width, dropout=dropout,
                    in_channels=in_channels, conv_bias=conv_bias)


# --- the ImageNet layout (torchvision's resnet18 / resnet50) ----------------------------


class ImageNetBasicBlock(nn.Module):
    """torchvision's ``BasicBlock``: :class:`BasicBlock` with the projection shortcut
    named ``downsample`` (its keys ``downsample.0``, ``downsample.1``, as torchvision's).

    ``(N, in_planes, H, W)`` -> ``(N, planes, ceil(H / stride), ceil(W / stride))``.
    """

    expansion = 1

    def __init__(self, in_planes: int, planes: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_planes, planes, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.relu = nn.ReLU()
        self.conv2 = nn.Conv2d(planes, planes, 3, stride=1, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.downsample = _projection(in_planes, planes * self.expansion, stride)

    def forward(self, x: Tensor) -> Tensor:
        """Residual block forward pass (shapes in the class docstring)."""
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + self.downsample(x))


class Bottleneck(nn.Module):
    """torchvision's ``Bottleneck``: 1x1 (``planes``), 3x3 (``planes``, stride), 1x1
    (``4 * planes``) conv-BN layers and an identity or 1x1 conv-BN ``downsample``.

    ``(N, in_planes, H, W)`` -> ``(N, 4 * planes, ceil(H / stride), ceil(W / stride))``.
    """

    expansion = 4

    def __init__(self, in_planes: int, planes: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_planes, planes, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, stride=stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.conv3 = nn.Conv2d(planes, planes * self.expansion, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(planes * self.expansion)
        self.relu = nn.ReLU()
        self.downsample = _projection(in_planes, planes * self.expansion, stride)

    def forward(self, x: Tensor) -> Tensor:
        """Bottleneck block forward pass (shapes in the class docstring)."""
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return self.relu(out + self.downsample(x))


def _projection(in_planes: int, out_planes: int, stride: int) -> nn.Sequential:
    """A 1x1 conv-BN shortcut where the shape changes, else the identity (an empty
    Sequential, which adds no state-dict keys)."""
    if stride == 1 and in_planes == out_planes:
        return nn.Sequential()
    return nn.Sequential(nn.Conv2d(in_planes, out_planes, 1, stride=stride, bias=False),
                         nn.BatchNorm2d(out_planes))


class ImageNetResNet(nn.Module):
    """ResNet in torchvision's ImageNet layout.

    Stem: 7x7 conv, stride 2, no bias, BN, ReLU, 3x3 max-pool with stride 2. Four stages
    of ``blocks`` with ``width * (1, 2, 4, 8)`` planes, the last three starting with
    stride 2; global average pool; dropout; linear ``fc``.

    Parameters
    ----------
    block : ImageNetBasicBlock or Bottleneck
        The residual block class.
    blocks : tuple of 4 int
        Blocks per stage: ``(2, 2, 2, 2)`` for ResNet-18, ``(3, 4, 6, 3)`` for ResNet-50.
    num_classes : int, default 1000
    width : int, default 64
        Planes of the stem and first stage; small values give fast test nets.
    dropout : float, default 0.0
        Dropout probability on the input of ``fc``. Adds no parameters.
    in_channels : int, default 3

    Notes
    -----
    Input ``(N, in_channels, H, W)`` -> logits ``(N, num_classes)``; feature maps are
    ``H/4, H/8, H/16, H/32`` across the stages (224 -> 7 for ImageNet). At ``width=64``
    and 1000 classes: 11,689,512 parameters (ResNet-18), 25,557,032 (ResNet-50), as
    torchvision's.
    """

    def __init__(self, block: type[ImageNetBasicBlock] | type[Bottleneck],
                 blocks: tuple[int, int, int, int], num_classes: int = 1000, width: int = 64,
                 dropout: float = 0.0, in_channels: int = 3) -> None:
        super().__init__()
        num_classes = check_integer("num_classes", num_classes, 1)
        width = check_integer("width", width, 1)
        in_channels = check_integer("in_channels", in_channels, 1)
        self.conv1 = nn.Conv2d(in_channels, width, 7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.relu = nn.ReLU()
        self.maxpool = nn.MaxPool2d(kernel_size=3, stride=2, padding=1)
        in_planes = width
        for index, count in enumerate(blocks):
            planes = width * 2**index
            stride = 1 if index == 0 else 2
            stage = [block(in_planes, planes, stride)]
            in_planes = planes * block.expansion
            stage += [block(in_planes, planes) for _ in range(count - 1)]
            self.add_module(f"layer{index + 1}", nn.Sequential(*stage))
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.flatten = nn.Flatten(1)
        self.dropout = nn.Dropout(check_probability("dropout", dropout))
        self.fc = nn.Linear(in_planes, num_classes)

    def features(self, x: Tensor) -> Tensor:
        """Pooled penultimate features ``(N, C, H, W)`` -> ``(N, fc.in_features)``."""
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.flatten(self.avgpool(x))

    def forward(self, x: Tensor) -> Tensor:
        """Map images ``(N, C, H, W)`` to logits ``(N, num_classes)``."""
        return self.fc(self.dropout(self.features(x)))


@register(
    "resnet18-imagenet",
    num_classes=1000,
    input_shape=_image_shape(224),
    description="ResNet-18, torchvision's ImageNet layout (7x7 stride-2 stem, max-pool), "
                "1000 classes: 11,689,512 parameters",
    options=_OPTIONS,
)
def _build_resnet18_imagenet(num_classes: int, width: int, dropout: float,
                             in_channels: int) -> ImageNetResNet:
    return ImageNetResNet(ImageNetBasicBlock, (2, 2, 2, 2), num_classes=num_classes,
                          width=width, dropout=dropout, in_channels=in_channels)


@register(
    "resnet50",
    num_classes=1000,
    input_shape=_image_shape(224),
    description="ResNet-50, torchvision's ImageNet layout (bottleneck blocks), 1000 classes: "
                "25,557,032 parameters",
    options=_OPTIONS,
)
def _build_resnet50(num_classes: int, width: int, dropout: float,
                    in_channels: int) -> ImageNetResNet:
    return ImageNetResNet(Bottleneck, (3, 4, 6, 3), num_classes=num_classes, width=width,
                          dropout=dropout, in_channels=in_channels)
