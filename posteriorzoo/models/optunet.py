"""OptuNet: the paper's 392-parameter MNIST network, and its 355-parameter v1.

Layer list (Laurent et al., ICLR 2024, appendix B.2), with spatial sizes for a
28x28 input::

    conv1  Conv2d(1 -> 2, k=4, no bias)            28 -> 25
    relu1, pool1 MaxPool2d(3, stride 3)            25 -> 8
    conv2  Conv2d(2 -> 10, k=5, groups=2, no bias)  8 -> 4
    relu2, pool2 global average pool                4 -> 1
    flatten, dropout, fc Linear(10 -> num_classes)
"""

from __future__ import annotations

from torch import Tensor, nn

from posteriorzoo.models.registry import register
from posteriorzoo.options import check_integer, check_probability

__all__ = ["OptuNet", "OptuNetV1"]

_INPUT_SHAPE = (1, 28, 28)
_FEATURES = 10  # channels after conv2, i.e. the input width of the head


def _add_trunk(model: nn.Module) -> None:
    # Attributes are set on the model itself rather than a sub-module so the
    # state_dict keys stay "conv1.weight"/"conv2.weight", as in the paper's tables.
    model.conv1 = nn.Conv2d(1, 2, kernel_size=4, bias=False)
    model.relu1 = nn.ReLU()
    model.pool1 = nn.MaxPool2d(kernel_size=3, stride=3)
    model.conv2 = nn.Conv2d(2, _FEATURES, kernel_size=5, groups=2, bias=False)
    model.relu2 = nn.ReLU()
    model.pool2 = nn.AdaptiveAvgPool2d(1)
    model.flatten = nn.Flatten(1)


def _trunk_forward(model: nn.Module, x: Tensor) -> Tensor:
    x = model.pool1(model.relu1(model.conv1(x)))
    x = model.pool2(model.relu2(model.conv2(x)))
    return model.flatten(x)


class OptuNet(nn.Module):
    """The paper's OptuNet (392 parameters with 10 classes).

    Parameters
    ----------
    num_classes : int, default 10
        Outputs of the ``fc`` layer.
    dropout : float, default 0.0
        Dropout probability on the input of ``fc`` (the paper's MC Dropout
        uses 0.2). Adds no parameters.

    Notes
    -----
    Input ``(N, 1, 28, 28)`` -> logits ``(N, num_classes)``. The global average
    pool makes any input of at least 16x16 pixels valid. State-dict keys:
    ``conv1.weight`` (2, 1, 4, 4), ``conv2.weight`` (10, 1, 5, 5),
    ``fc.weight`` (num_classes, 10), ``fc.bias`` (num_classes,).
    """

    def __init__(self, num_classes: int = 10, dropout: float = 0.0) -> None:
        super().__init__()
        num_classes = check_integer("num_classes", num_classes, 1)
        _add_trunk(self)
        self.dropout = nn.Dropout(check_probability("dropout", dropout))
        self.fc = nn.Linear(_FEATURES, num_classes)

    def forward(self, x: Tensor) -> Tensor:
        """Map images ``(N, 1, H, W)`` to logits ``(N, num_classes)``."""
        return self.fc(self.dropout(_trunk_forward(self, x)))


class OptuNetV1(nn.Module):
    """OptuNet with the two-layer head of the authors' ``optuMNIST`` v1 (355 parameters).

    Same trunk as :class:`OptuNet`; the head is ``fc1`` Linear(10 -> 3), ReLU,
    ``fc2`` Linear(3 -> num_classes).

    Parameters
    ----------
    num_classes : int, default 10
        Outputs of ``fc2``.
    dropout : float, default 0.0
        Dropout probability on the input of the last layer ``fc2``.

    Notes
    -----
    Input ``(N, 1, 28, 28)`` -> logits ``(N, num_classes)``.
    """

    def __init__(self, num_classes: int = 10, dropout: float = 0.0) -> None:
        super().__init__()
        num_classes = check_integer("num_classes", num_classes, 1)
        _add_trunk(self)
        self.fc1 = nn.Linear(_FEATURES, 3)
        self.relu3 = nn.ReLU()
        self.dropout = nn.Dropout(check_probability("dropout", dropout))
        self.fc2 = nn.Linear(3, num_classes)

    def forward(self, x: Tensor) -> Tensor:
        """Map images ``(N, 1, H, W)`` to logits ``(N, num_classes)``."""
        x = self.relu3(self.fc1(_trunk_forward(self, x)))
        return self.fc2(self.dropout(x))


@register(
    "optunet",
    num_classes=10,
    input_shape=_INPUT_SHAPE,
    description="OptuNet, the paper's 392-parameter MNIST CNN (grouped conv2)",
    options={"dropout": 0.0},
)
def _build_optunet(num_classes: int, dropout: float) -> OptuNet:
    return OptuNet(num_classes=num_classes, dropout=dropout)


@register(
    "optunet-v1",
    num_classes=10,
    input_shape=_INPUT_SHAPE,
    description="OptuNet v1, 355 parameters: head Linear(10->3)+ReLU+Linear(3->10)",
    options={"dropout": 0.0},
)
def _build_optunet_v1(num_classes: int, dropout: float) -> OptuNetV1:
    return OptuNetV1(num_classes=num_classes, dropout=dropout)
