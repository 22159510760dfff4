"""A model of your own: a multilayer perceptron with LeakyReLU activations.

Registering it under a name (``my-mlp``) is all posteriorzoo needs: every command then
trains, reads, canonicalizes and compares its collections like those of a built-in model.
Load the module before a command with ``posteriorzoo --models my_models ...`` (this folder
on ``PYTHONPATH``, or the current folder) or ``POSTERIORZOO_MODELS=my_models``; in Python,
``import my_models``. See README.md, "Your own model".
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor, nn

from posteriorzoo.errors import InvalidOptionError
from posteriorzoo.models import register
from posteriorzoo.options import check_integer, check_number, check_probability


class LeakyMLP(nn.Module):
    """Flatten, then ``Linear`` and ``LeakyReLU`` for each hidden layer, then the output
    ``Linear`` layer, with dropout of probability ``dropout`` on its input (MC Dropout
    trains with it; it has no weights, so the checkpoints are the same either way)."""

    def __init__(self, sizes: Sequence[int], negative_slope: float, dropout: float) -> None:
        super().__init__()
        pairs = zip(sizes[:-2], sizes[1:-1], strict=True)  # hidden layers
        self.hidden = nn.ModuleList(nn.Linear(a, b) for a, b in pairs)
        self.activation = nn.LeakyReLU(negative_slope)
        self.dropout = nn.Dropout(dropout)
        self.out = nn.Linear(sizes[-2], sizes[-1])

    def forward(self, x: Tensor) -> Tensor:
        x = x.flatten(1)
        for layer in self.hidden:
            x = self.activation(layer(x))
        return self.out(self.dropout(x))


@register("my-mlp", num_classes=10, input_shape=(1, 28, 28),
          description="MLP with LeakyReLU activations (examples/my_models.py)",
          options={"hidden": (32,), "negative_slope": 0.01, "dropout": 0.0})
def build_my_mlp(num_classes: int, hidden: Sequence[int], negative_slope: float,
                 dropout: float) -> LeakyMLP:
    # Options come from spec files and collections: check them, so that a bad value is
    # one clear line rather than an error deep inside torch.
    if not isinstance(hidden, list | tuple):
        raise InvalidOptionError(f"my-mlp option 'hidden' must be a list of widths, "
                                 f"not {hidden!r}")
    widths = [check_integer("my-mlp option 'hidden'", width, 1, 100_000) for width in hidden]
    check_number("my-mlp option 'negative_slope'", negative_slope, 0, strict=True)
    return LeakyMLP((28 * 28, *widths, num_classes), negative_slope,
                    check_probability("my-mlp option 'dropout'", dropout))
