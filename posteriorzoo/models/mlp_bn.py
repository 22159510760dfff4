"""A ReLU MLP with BatchNorm after every hidden layer: by default the EMP paper's MLP.

Ensemble Model Patching (seed 001, Table 3) counts an MLP of ``L = 100`` fully connected
layers with ``H = 100`` units: 1,009,900 parameters, and 1,129,100 once its BN and output
layers are patched with ``K = 5`` components. Both figures are this network's: a scalar
input, 99 hidden layers of 100 units each followed by BatchNorm (whose shift plays the
part of the bias, so the Linear layers have none) and a 100-unit output layer without
bias: ``100 + 98 x 10,000 + 10,000`` weights and ``99 x 200`` BN parameters.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from torch import Tensor, nn

from posteriorzoo.errors import ZooSchemaError
from posteriorzoo.models.mlp import _check_widths
from posteriorzoo.models.registry import register
from posteriorzoo.options import check_bool

__all__ = ["BatchNormMLP"]

#: The EMP paper's MLP: input 1, L = 100 layers of H = 100 units.
SEED_WIDTHS = (1,) + (100,) * 100


class BatchNormMLP(nn.Module):
    """Linear (no bias) - BatchNorm - ReLU for every hidden layer, then a Linear output.

    Parameters
    ----------
    widths : sequence of int, default ``(1,) + (100,) * 100``
        Input dimension, hidden widths..., output dimension.
    output_bias : bool, default False
        Whether the output layer has a bias (the EMP paper's count has none).

    Notes
    -----
    Input ``(N, widths[0])`` (trailing axes flattened) -> ``(N, widths[-1])``. Keys:
    ``layers.{i}.weight`` for every layer, ``norms.{i}.*`` for the BN after hidden layer
    ``i``, ``layers.{L-1}.bias`` with ``output_bias``. Parameters:
    ``sum(widths[i] * widths[i+1]) + 2 * sum(widths[1:-1])`` (+ ``widths[-1]``).
    """

    def __init__(self, widths: Sequence[int] = SEED_WIDTHS, output_bias: bool = False) -> None:
        super().__init__()
        self.widths = _check_widths(widths)
        output_bias = check_bool("output_bias", output_bias)
        pairs = list(zip(self.widths[:-1], self.widths[1:], strict=True))
        self.layers = nn.ModuleList(
            nn.Linear(a, b, bias=output_bias and i == len(pairs) - 1)
            for i, (a, b) in enumerate(pairs))
        self.norms = nn.ModuleList(nn.BatchNorm1d(b) for _, b in pairs[:-1])
        self.relu = nn.ReLU()

    def forward(self, x: Tensor) -> Tensor:
        """Map ``(N, widths[0])`` inputs to ``(N, widths[-1])`` outputs."""
        x = x.flatten(1)
        for layer, norm in zip(self.layers[:-1], self.norms, strict=True):
            x = self.relu(norm(layer(x)))
        return self.layers[-1](x)


def _input_shape(options: Mapping[str, Any]) -> tuple[int, ...]:
    return (_check_widths(options["widths"])[0],)


@register(
    "mlp-bn",
    num_classes=None,
    input_shape=_input_shape,
    description="ReLU MLP with BatchNorm after each hidden layer, no hidden biases; default: "
                "the EMP paper's L=100, H=100 network (1,009,900 parameters)",
    options={"widths": SEED_WIDTHS, "output_bias": False},
)
def _build_mlp_bn(num_classes: int | None, widths: Sequence[int],
                  output_bias: bool) -> BatchNormMLP:
    checked = _check_widths(widths)
    # As for mlp: num_classes is redundant with widths[-1] and must agree with it.
    if num_classes is not None and num_classes != checked[-1]:
        raise ZooSchemaError(
            f"mlp-bn: num_classes={num_classes!r} differs from widths[-1]={checked[-1]}")
    return BatchNormMLP(widths=checked, output_bias=output_bias)
