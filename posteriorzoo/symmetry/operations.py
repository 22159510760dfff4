"""The operations the symmetry tracer understands, in one table.

Every operation in the table commutes with a permutation of the channels (most act on
each channel separately; softmax mixes them symmetrically). Further properties say
which other symmetries pass through it:

- **positively homogeneous**: ``f(lambda x) = lambda f(x)`` for every ``lambda > 0``, so a
  unit's positive scale passes through (ReLU, LeakyReLU and PReLU with any slope, max and
  average pooling, dropout, reshapes);
- **odd**: ``f(-x) = -f(x)``, so a unit's sign passes through (tanh, sin, softsign,
  hardtanh with symmetric bounds, the shrink functions, and every linear operation:
  identity, average pooling, dropout, reshapes);
- **shift-preserving**: adding one constant to every channel before it adds one constant
  after it, or nothing (pooling, reshapes, softmax). The softmax shift of the output
  biases is only used when nothing else lies between the last layer and the output.

A linear operation has both, so the units before it may be multiplied by any nonzero
real (a positive scale times a sign). The module, functional and tensor-method forms of
an operation share one row of the table, so ``nn.Tanh()(x)``, ``torch.tanh(x)``,
``F.tanh(x)`` and ``x.tanh()`` are traced alike. Subclasses are not matched: a subclass
may override ``forward``.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import fx, nn

from posteriorzoo._api import public


@dataclass(frozen=True)
class OperationProperties:
    """What a channel-permuting operation lets through besides permutations.

    ``homogeneous``: positive scales; ``odd``: signs; ``shift``: a constant added to
    every channel (see the module docstring).
    """

    homogeneous: bool = False
    odd: bool = False
    shift: bool = False


PERMUTE_ONLY = OperationProperties()
HOMOGENEOUS = OperationProperties(homogeneous=True)
ODD = OperationProperties(odd=True)
LINEAR = OperationProperties(homogeneous=True, odd=True)
POOLING = OperationProperties(homogeneous=True, shift=True)  # max pooling
RESHAPE = OperationProperties(homogeneous=True, odd=True, shift=True)  # also averages
SOFTMAX = OperationProperties(shift=True)

#: ``option(name, position, default)``: an argument of a call, or an attribute of a module.
Option = Callable[[str, int, Any], Any]
Rule = OperationProperties | Callable[[Option], OperationProperties]


def _leaky_relu(option: Option) -> OperationProperties:
    # Homogeneous for every slope; a slope of exactly 1 is the identity, also odd.
    return LINEAR if option("negative_slope", 1, 0.01) == 1 else HOMOGENEOUS


def _hardtanh(option: Option) -> OperationProperties:
    low, high = option("min_val", 1, -1.0), option("max_val", 2, 1.0)
    return ODD if low == -high else PERMUTE_ONLY


def _available(owner: object, *names: str) -> tuple[object, ...]:
    # Some functional forms are missing in older torch releases.
    return tuple(getattr(owner, name) for name in names if hasattr(owner, name))


# (rule, module classes, functions, tensor methods): one row per operation.
_TABLE: list[tuple[Rule, tuple[type, ...], tuple[object, ...], tuple[str, ...]]] = [
    (HOMOGENEOUS, (nn.ReLU,), (torch.relu, torch.relu_, F.relu, F.relu_), ("relu", "relu_")),
    (_leaky_relu, (nn.LeakyReLU,), (F.leaky_relu, F.leaky_relu_), ()),
    # PReLU's slope does not scale: max(0, lx) + a min(0, lx) = l (max(0, x) + a min(0, x))
    # for l > 0, whatever the sign of a. Per-channel slopes are permuted with the channels.
    (HOMOGENEOUS, (nn.PReLU,), (torch.prelu, F.prelu), ()),
    (POOLING, (nn.MaxPool1d, nn.MaxPool2d, nn.MaxPool3d, nn.AdaptiveMaxPool1d,
                   nn.AdaptiveMaxPool2d, nn.AdaptiveMaxPool3d),
     (F.max_pool1d, F.max_pool2d, F.max_pool3d, F.adaptive_max_pool1d,
      F.adaptive_max_pool2d, F.adaptive_max_pool3d), ()),
    (RESHAPE, (nn.AvgPool1d, nn.AvgPool2d, nn.AvgPool3d, nn.AdaptiveAvgPool1d,
              nn.AdaptiveAvgPool2d, nn.AdaptiveAvgPool3d),
     (F.avg_pool1d, F.avg_pool2d, F.avg_pool3d, F.adaptive_avg_pool1d,
      F.adaptive_avg_pool2d, F.adaptive_avg_pool3d), ()),
    # Dropout multiplies by a random mask (or by 1 in eval mode): linear in x, but a
    # shift of its input is masked too.
    (LINEAR, (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d),
     _available(F, "dropout", "dropout1d", "dropout2d", "dropout3d"), ()),
    (RESHAPE, (nn.Identity, nn.Flatten), (torch.flatten, operator.neg, torch.neg),
     ("flatten", "view", "reshape", "contiguous", "neg")),
    (ODD, (nn.Tanh,), (torch.tanh, torch.tanh_, F.tanh), ("tanh", "tanh_")),
    (_hardtanh, (nn.Hardtanh,), (F.hardtanh, F.hardtanh_), ()),
    (ODD, (nn.Softsign, nn.Tanhshrink, nn.Hardshrink, nn.Softshrink),
     (F.softsign, F.tanhshrink, F.hardshrink, F.softshrink), ()),
    (ODD, (), (torch.sin, torch.sinh, torch.atan, torch.arctan, torch.asinh, torch.arcsinh,
               torch.erf, torch.special.erf),
     ("sin", "sin_", "sinh", "atan", "arctan", "asinh", "arcsinh", "erf")),
    (PERMUTE_ONLY, (nn.Sigmoid, nn.GELU, nn.ELU, nn.CELU, nn.SELU, nn.SiLU, nn.Mish,
                    nn.Softplus, nn.Hardswish, nn.Hardsigmoid, nn.ReLU6, nn.LogSigmoid),
     (torch.sigmoid, F.sigmoid, F.gelu, F.elu, F.celu, F.selu, torch.selu, F.silu, F.mish,
      F.softplus, F.hardswish, F.hardsigmoid, F.relu6, F.logsigmoid, torch.exp, torch.cos),
     ("sigmoid", "sigmoid_", "exp", "cos")),
    (SOFTMAX, (nn.Softmax, nn.LogSoftmax),
     (torch.softmax, torch.log_softmax, F.softmax, F.log_softmax), ("softmax", "log_softmax")),
]

_BY_MODULE: dict[type, Rule] = {}
_BY_FUNCTION: dict[object, Rule] = {}
_BY_METHOD: dict[str, Rule] = {}
for _rule, _modules, _functions, _methods in _TABLE:
    _BY_MODULE.update(dict.fromkeys(_modules, _rule))
    _BY_FUNCTION.update(dict.fromkeys(_functions, _rule))
    _BY_METHOD.update(dict.fromkeys(_methods, _rule))


def _resolve(rule: Rule, option: Option) -> OperationProperties:
    return rule if isinstance(rule, OperationProperties) else rule(option)


@public
def operation_properties(node: fx.Node, module: nn.Module | None = None
                         ) -> OperationProperties | None:
    """The properties of a traced call, or None if it is not a known per-channel operation.

    Parameters
    ----------
    node : torch.fx.Node
        A ``call_module``, ``call_function`` or ``call_method`` node.
    module : nn.Module, optional
        The module a ``call_module`` node calls.

    Returns
    -------
    OperationProperties or None
    """
    if node.op == "call_module":
        rule = _BY_MODULE.get(type(module))
        if rule is None:
            return None
        return _resolve(rule, lambda name, position, default: getattr(module, name, default))
    if node.op == "call_function":
        try:
            rule = _BY_FUNCTION.get(node.target)
        except TypeError:  # an unhashable callable cannot be in the table
            return None
    elif node.op == "call_method":
        rule = _BY_METHOD.get(str(node.target))
    else:
        return None
    if rule is None:
        return None

    def option(name: str, position: int, default: Any) -> Any:
        if name in node.kwargs:
            return node.kwargs[name]
        return node.args[position] if len(node.args) > position else default

    return _resolve(rule, option)


def is_prelu(node: fx.Node, module: nn.Module | None = None) -> bool:
    """Whether ``node`` is a PReLU, in module or functional form."""
    if node.op == "call_module":
        return type(module) is nn.PReLU
    return node.op == "call_function" and node.target in (torch.prelu, F.prelu)


def prelu_slope(node: fx.Node, module: nn.Module | None = None) -> tuple[str, int] | None:
    """The state key and size of a PReLU's slope, or None if it is not a stored tensor.

    A functional PReLU's slope must come straight from a parameter (a ``get_attr`` node);
    one computed in the graph cannot be followed.
    """
    if node.op == "call_module" and module is not None:
        return f"{node.target}.weight", int(module.weight.numel())
    weight = node.args[1] if len(node.args) > 1 else node.kwargs.get("weight")
    if isinstance(weight, fx.Node) and weight.op == "get_attr":
        shape = getattr(weight.meta.get("tensor_meta"), "shape", None)
        if shape is not None:
            return str(weight.target), math.prod(int(size) for size in shape)
    return None


def label(node: fx.Node, module: nn.Module | None = None) -> str:
    """A readable name of the operation a node performs (for notes and warnings)."""
    if module is not None:
        return type(module).__name__
    if node.op == "call_method":
        return f"Tensor.{node.target}"
    return getattr(node.target, "__name__", str(node.target))
