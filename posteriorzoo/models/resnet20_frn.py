"""ResNet-20 with Filter Response Normalization and SiLU: ``resnet20-frn-silu``.

The architecture of the HMC reference posterior of the NeurIPS 2021 competition
"Approximate inference in Bayesian deep learning" (Izmailov et al. 2021, "What are
Bayesian neural network posteriors really like?"; google-research ``bnn_hmc``,
``make_resnet20_frn_fn`` with ``activation=swish``), and of the fifth folder of the
authors' release, ``cifar10-resnet20-frn-silu``.

**Layout, from torch-uncertainty's code** (read at ``torch_uncertainty/models/resnet/
std.py`` and ``layers/filter_response_norm.py``, whose networks the release saves): a
CIFAR stem (3x3 conv, stride 1, no max-pool) ``conv1``, ``bn1``, SiLU; three stages
``layer{1,2,3}`` of three :class:`FRNBasicBlock` with ``width * (1, 2, 4)`` channels, the
last two starting with stride 2; global average pool; linear ``linear``. A block is
``conv1``, ``bn1``, SiLU, ``conv2``, ``bn2``, plus the shortcut (identity, or
``shortcut.0`` a 1x1 conv and ``shortcut.1`` an FRN where the shape changes), then SiLU.
Each ``bn*`` is a :class:`FilterResponseNorm2d` (torch-uncertainty passes it as the
ResNet's ``normalization_layer``, hence the BatchNorm names) with parameters ``tau``,
``beta``, ``gamma`` of shape ``(1, C, 1, 1)``; its thresholded linear unit (TLU,
``max(y, tau)``) is inside it and SiLU follows it (torch-uncertainty's ``activation_fn``),
as in ``bnn_hmc``, whose ``_resnet_layer`` is conv, FRN (with its TLU), activation. So a
release checkpoint (keys ``model.`` + these) loads with no key map.

**Assumptions** (the release's archives could not be read from here):

- ``conv_bias=True``: every convolution has a bias, as in ``bnn_hmc``
  (``use_bias=True``) and torch-uncertainty's ``resnet20`` of 2024 (``conv_bias=True`` by
  default); ``conv_bias=False`` builds the variant without (torch-uncertainty's
  default since 2025). The keys tell which: with the wrong setting, import names the
  missing or unexpected ``*.bias`` key.
- ``eps = 1e-6`` in every FRN (both codes' default; it is not stored in a checkpoint).
- Layout differences with ``bnn_hmc`` itself (not with the release): its stride-2
  convolutions pad "SAME" (one row and column, after), torch's ``padding=1`` pads before
  and after; its pool is an 8x8 average pool, here a global one (the same on 32x32
  inputs). A ``bnn_hmc`` (haiku) checkpoint needs a key map and this padding difference
  in mind; torch-uncertainty's do not.

Weights use PyTorch's default module initialisation and FRN's ``tau = 0``, ``beta = 0``,
``gamma = 1``, as torch-uncertainty's.

Symmetries: permutations of the hidden channels (tied along the residual streams) and a
positive scale of every convolution's output channels, which the FRN after it normalises
away up to its eps; SiLU lets no scale through (see :mod:`posteriorzoo.symmetry.structure`).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from posteriorzoo.models.registry import register
from posteriorzoo.models.resnet import _add_stages, _image_shape
from posteriorzoo.options import check_bool, check_integer, check_number, check_probability

__all__ = ["FRNBasicBlock", "FilterResponseNorm2d", "ResNet20FRN"]

_BLOCKS_PER_STAGE = (3, 3, 3)


class FilterResponseNorm2d(nn.Module):
    """Filter Response Normalization with its thresholded linear unit (Singh & Krishnan 2020).

    ``nu2 = mean over H, W of x**2``; ``y = gamma * x / sqrt(nu2 + eps) + beta``;
    ``z = max(y, tau)``, every parameter one value per channel, shaped ``(1, C, 1, 1)``.

    Parameters
    ----------
    num_channels : int
    eps : float, default 1e-6
        Added to ``nu2``. It bounds the output of a near-silent channel, and it is the
        only thing that breaks the layer's invariance to a positive scale of its input.

    Notes
    -----
    ``(N, C, H, W)`` -> ``(N, C, H, W)``. The parameters are created in the order
    ``tau``, ``beta``, ``gamma``, as torch-uncertainty's, so state dicts list them alike.
    """

    def __init__(self, num_channels: int, eps: float = 1e-6) -> None:
        super().__init__()
        num_channels = check_integer("num_channels", num_channels, 1)
        self.eps = check_number("eps", eps, 0.0)
        shape = (1, num_channels, 1, 1)
        self.tau = nn.Parameter(torch.zeros(shape))
        self.beta = nn.Parameter(torch.zeros(shape))
        self.gamma = nn.Parameter(torch.ones(shape))

    def forward(self, x: Tensor) -> Tensor:
        """Normalise each channel by its root mean square, then the affine map and TLU."""
        nu2 = x.square().mean(dim=(-2, -1), keepdim=True)
        y = self.gamma * (x * torch.rsqrt(nu2 + self.eps)) + self.beta
        return torch.maximum(y, self.tau)

    def extra_repr(self) -> str:
        return f"{self.tau.shape[1]}, eps={self.eps:g}"


def _conv(in_planes: int, planes: int, kernel: int, stride: int, bias: bool) -> nn.Conv2d:
    return nn.Conv2d(in_planes, planes, kernel, stride=stride, padding=kernel // 2, bias=bias)


class FRNBasicBlock(nn.Module):
    """Two 3x3 conv-FRN layers, SiLU between them and after the sum with the shortcut.

    Parameters
    ----------
    in_planes, planes : int
        Input and output channels.
    stride : int, default 1
        Stride of the first conv and of the projection shortcut.
    conv_bias : bool, default True

    Notes
    -----
    ``(N, in_planes, H, W)`` -> ``(N, planes, ceil(H / stride), ceil(W / stride))``.
    """

    def __init__(self, in_planes: int, planes: int, stride: int = 1,
                 conv_bias: bool = True) -> None:
        super().__init__()
        self.conv1 = _conv(in_planes, planes, 3, stride, conv_bias)
        self.bn1 = FilterResponseNorm2d(planes)
        self.conv2 = _conv(planes, planes, 3, 1, conv_bias)
        self.bn2 = FilterResponseNorm2d(planes)
        self.activation = nn.SiLU()
        # An empty Sequential is the identity and contributes no state_dict keys.
        self.shortcut = nn.Sequential()
        if stride != 1 or in_planes != planes:
            self.shortcut = nn.Sequential(_conv(in_planes, planes, 1, stride, conv_bias),
                                          FilterResponseNorm2d(planes))

    def forward(self, x: Tensor) -> Tensor:
        """Residual block forward pass (shapes in the class docstring)."""
        out = self.activation(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.activation(out + self.shortcut(x))


class ResNet20FRN(nn.Module):
    """ResNet-20 with FRN and SiLU, in torch-uncertainty's layout (module docstring).

    Parameters
    ----------
    num_classes : int, default 10
    width : int, default 16
        Channels of the stem and first stage (then ``2 * width``, ``4 * width``).
    dropout : float, default 0.0
        Dropout probability on the pooled features (the input of ``linear``), for
        last-layer MC Dropout. Adds no parameters.
    in_channels : int, default 3
    conv_bias : bool, default True
        Whether every convolution has a bias (see the module docstring).

    Notes
    -----
    Input ``(N, in_channels, H, W)`` -> logits ``(N, num_classes)``; feature maps are
    ``H, H/2, H/4`` across the stages. With the defaults and 10 classes: 274,042
    parameters (273,258 without the conv biases).
    """

    def __init__(self, num_classes: int = 10, width: int = 16, dropout: float = 0.0,
                 in_channels: int = 3, conv_bias: bool = True) -> None:
        super().__init__()
        num_classes = check_integer("num_classes", num_classes, 1)
        width = check_integer("width", width, 1)
        in_channels = check_integer("in_channels", in_channels, 1)
        conv_bias = check_bool("conv_bias", conv_bias)
        self.conv1 = _conv(in_channels, width, 3, 1, conv_bias)
        self.bn1 = FilterResponseNorm2d(width)
        self.activation = nn.SiLU()
        planes = _add_stages(self, FRNBasicBlock, _BLOCKS_PER_STAGE, width, conv_bias)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.flatten = nn.Flatten(1)
        self.dropout = nn.Dropout(check_probability("dropout", dropout))
        self.linear = nn.Linear(planes, num_classes)

    def features(self, x: Tensor) -> Tensor:
        """Pooled penultimate features: ``(N, C, H, W)`` -> ``(N, 4 * width)``."""
        x = self.activation(self.bn1(self.conv1(x)))
        x = self.layer3(self.layer2(self.layer1(x)))
        return self.flatten(self.pool(x))

    def forward(self, x: Tensor) -> Tensor:
        """Map images ``(N, C, H, W)`` to logits ``(N, num_classes)``."""
        return self.linear(self.dropout(self.features(x)))


@register(
    "resnet20-frn-silu",
    num_classes=10,
    input_shape=_image_shape(32),
    description="ResNet-20 with FRN and SiLU (the NeurIPS 2021 BDL competition's HMC "
                "reference), torch-uncertainty's layout; CIFAR-10 by default",
    options={"width": 16, "dropout": 0.0, "in_channels": 3, "conv_bias": True},
)
def _build_resnet20_frn_silu(num_classes: int, width: int, dropout: float, in_channels: int,
                             conv_bias: bool) -> ResNet20FRN:
    return ResNet20FRN(num_classes=num_classes, width=width, dropout=dropout,
                       in_channels=in_channels, conv_bias=conv_bias)
