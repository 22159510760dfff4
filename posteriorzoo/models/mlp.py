"""Fully connected ReLU network; ``widths=(2, 2, 1)`` is the paper's Fig. 1 toy."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from torch import Tensor, nn

from posteriorzoo.errors import InvalidOptionError, ZooSchemaError
from posteriorzoo.models.registry import register
from posteriorzoo.options import check_integer, check_probability

__all__ = ["MLP"]

_DEFAULT_WIDTHS = (2, 2, 1)


def _check_widths(widths: Sequence[int]) -> tuple[int, ...]:
    if isinstance(widths, (str, bytes)) or not isinstance(widths, Sequence):
        raise InvalidOptionError(f"widths must be a sequence of integers, got {widths!r}")
    if len(widths) < 2:
        raise InvalidOptionError(f"widths needs an input and an output size, got {widths!r}")
    return tuple(check_integer("every entry of widths", w, 1) for w in widths)


class MLP(nn.Module):
    """ReLU multilayer perceptron.

    ``layers[i]`` is ``Linear(widths[i] -> widths[i + 1])``; ReLU follows every
    layer but the last, so ``layers.{i}.weight`` indexes weight matrices
    consecutively (convenient for per-layer symmetry and MMD code).

    Parameters
    ----------
    widths : sequence of int, default (2, 2, 1)
        Input dimension, hidden widths..., output dimension.
    dropout : float, default 0.0
        Dropout probability on the input of the last layer. Adds no parameters.

    Notes
    -----
    Input ``(N, widths[0])`` (trailing axes are flattened, so ``(N, 1, 28, 28)``
    works with ``widths[0] == 784``) -> output ``(N, widths[-1])``.
    Parameter count: ``sum(widths[i] * widths[i+1] + widths[i+1])``.
    """

    def __init__(self, widths: Sequence[int] = _DEFAULT_WIDTHS, dropout: float = 0.0) -> None:
        super().__init__()
        self.widths = _check_widths(widths)
        pairs = zip(self.widths[:-1], self.widths[1:], strict=True)
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in pairs)
        self.relu = nn.ReLU()
        self.dropout = nn.Dropout(check_probability("dropout", dropout))

    def forward(self, x: Tensor) -> Tensor:
        """Map ``(N, widths[0])`` inputs to ``(N, widths[-1])`` outputs."""
        x = x.flatten(1)
        for layer in self.layers[:-1]:
            x = self.relu(layer(x))
        return self.layers[-1](self.dropout(x))


def _mlp_input_shape(options: Mapping[str, Any]) -> tuple[int, ...]:
    return (_check_widths(options["widths"])[0],)


@register(
    "mlp",
    num_classes=None,
    input_shape=_mlp_input_shape,
    description="fully connected ReLU network; widths=(2, 2, 1) is the paper's toy",
    options={"widths": _DEFAULT_WIDTHS, "dropout": 0.0},
)
def _build_mlp(num_classes: int | None, widths: Sequence[int], dropout: float) -> MLP:
    checked = _check_widths(widths)
    # num_classes is redundant with widths[-1]; a disagreement means the caller
    # (e.g. a zoo manifest) describes a different network than the one requested.
    if num_classes is not None and num_classes != checked[-1]:
        raise ZooSchemaError(
            f"mlp: num_classes={num_classes!r} differs from widths[-1]={checked[-1]}"
        )
    return MLP(widths=checked, dropout=dropout)
