"""Layer shapes of OptuNet-shaped networks, read from a built model, and their flat weights.

An *OptuNet-shaped* network is, for an input ``(C, H, W)``::

    conv1  Conv2d(C -> C1, (K1h, K1w), groups G1, stride 1, no padding, no bias)
    ReLU, MaxPool2d((PKh, PKw), stride (PSh, PSw), no padding, floor mode)
    conv2  Conv2d(C1 -> C2, (K2h, K2w), groups G2, stride 1, no padding, no bias)
    ReLU, global average pool                                   -> (C2,)
    head   Linear(C2 -> num_classes)                            (``optunet``)
       or  Linear(C2 -> hidden), ReLU, Linear(hidden -> classes) (``optunet-v1``)

:func:`describe_model` reads every size from the modules of a built model (and refuses
anything else, with the reason); :class:`NetLayout` packs the weights into one flat
float32 vector in state_dict order, which is what the numba kernels work on.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from posteriorzoo.models import OptuNet, OptuNetV1

__all__ = ["ARCHITECTURES", "DIM_NAMES", "NetLayout", "UnsupportedModelError", "describe_model"]

#: Registry names whose forward pass is the OptuNet-shaped one the kernels implement.
ARCHITECTURES = ("optunet", "optunet-v1")

# Positions in the int64 ``dims`` vector handed to the kernels (see NetLayout.dims).
DIM_NAMES = ("in_channels", "height", "width",
             "c1", "k1h", "k1w", "g1",
             "pool_kh", "pool_kw", "pool_sh", "pool_sw",
             "c2", "k2h", "k2w", "g2",
             "hidden", "num_classes")


class UnsupportedModelError(ValueError):
    """The model is not OptuNet-shaped (the message says which part is not)."""


def _pair(value: int | tuple[int, ...]) -> tuple[int, int]:
    if isinstance(value, int):
        return value, value
    first, second = value
    return int(first), int(second)


@dataclass(frozen=True)
class NetLayout:
    """Shapes of one OptuNet-shaped network for one input size.

    Attributes
    ----------
    input_shape : (int, int, int)
        ``(C, H, W)`` of one example.
    conv1, conv2 : (int, int, int, int, int)
        ``(out_channels, in_channels_per_group, kernel_h, kernel_w, groups)``.
    pool : (int, int, int, int)
        Max-pool ``(kernel_h, kernel_w, stride_h, stride_w)``.
    hidden : int
        Width of the hidden head layer (``optunet-v1``), 0 for a single linear head.
    num_classes : int
        Outputs.
    keys : tuple of str
        State-dict keys in state_dict order, e.g. ``("conv1.weight", "conv2.weight",
        "fc.weight", "fc.bias")``.
    shapes : tuple of tuple of int
        The shape of each key's tensor.
    """

    input_shape: tuple[int, int, int]
    conv1: tuple[int, int, int, int, int]
    pool: tuple[int, int, int, int]
    conv2: tuple[int, int, int, int, int]
    hidden: int
    num_classes: int
    keys: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]

    @property
    def sizes(self) -> tuple[int, ...]:
        """Number of elements of each key's tensor."""
        return tuple(int(np.prod(shape)) for shape in self.shapes)

    @property
    def num_params(self) -> int:
        """Length of the flat parameter vector (392 for OptuNet)."""
        return sum(self.sizes)

    def dims(self) -> np.ndarray:
        """int64 vector of length 17 in :data:`DIM_NAMES` order, for the kernels."""
        c1, _, k1h, k1w, g1 = self.conv1
        c2, _, k2h, k2w, g2 = self.conv2
        return np.array([*self.input_shape, c1, k1h, k1w, g1, *self.pool,
                         c2, k2h, k2w, g2, self.hidden, self.num_classes], dtype=np.int64)

    def views(self, flat: np.ndarray) -> dict[str, np.ndarray]:
        """``{key: array}`` views into ``flat`` (shape ``(num_params,)``) in state_dict
        layout; writing to ``flat`` changes them (no copy)."""
        out, start = {}, 0
        for key, shape, size in zip(self.keys, self.shapes, self.sizes, strict=True):
            out[key] = flat[start:start + size].reshape(shape)
            start += size
        return out

    def flatten(self, state: Mapping[str, torch.Tensor | np.ndarray]) -> np.ndarray:
        """A new float32 vector ``(num_params,)`` holding ``state`` (keys as :attr:`keys`)."""
        parts = []
        for key, shape in zip(self.keys, self.shapes, strict=True):
            value = state[key]
            array = value.detach().cpu().numpy() if isinstance(value, torch.Tensor) else value
            if tuple(array.shape) != shape:
                raise ValueError(f"{key}: shape {tuple(array.shape)}, expected {shape}")
            parts.append(np.asarray(array, dtype=np.float32).reshape(-1))
        return np.ascontiguousarray(np.concatenate(parts))


def _check_conv(name: str, conv: object) -> tuple[int, int, int, int, int]:
    if type(conv) is not nn.Conv2d:
        raise UnsupportedModelError(f"{name} is {type(conv).__name__}, not Conv2d")
    if conv.bias is not None:
        raise UnsupportedModelError(f"{name} has a bias")
    if _pair(conv.stride) != (1, 1) or _pair(conv.dilation) != (1, 1):
        raise UnsupportedModelError(f"{name} has stride {conv.stride} / dilation "
                                    f"{conv.dilation}; only 1 is implemented")
    if conv.padding not in ("valid", 0, (0, 0)):
        raise UnsupportedModelError(f"{name} has padding {conv.padding}")
    kh, kw = _pair(conv.kernel_size)
    groups = int(conv.groups)
    return int(conv.out_channels), int(conv.in_channels) // groups, kh, kw, groups


def _check_linear(name: str, linear: object) -> tuple[int, int]:
    if type(linear) is not nn.Linear:
        raise UnsupportedModelError(f"{name} is {type(linear).__name__}, not Linear")
    if linear.bias is None:
        raise UnsupportedModelError(f"{name} has no bias")
    return int(linear.out_features), int(linear.in_features)


def _check_relu(name: str, module: object) -> None:
    if type(module) is not nn.ReLU:
        raise UnsupportedModelError(f"{name} is {type(module).__name__}, not ReLU")


def describe_model(model: nn.Module, input_shape: tuple[int, int, int]) -> NetLayout:
    """The :class:`NetLayout` of ``model`` for inputs of ``input_shape`` ``(C, H, W)``.

    Raises
    ------
    UnsupportedModelError
        ``model`` is not exactly an :class:`OptuNet` / :class:`OptuNetV1` whose layers
        the kernels implement (dropout > 0, strides, padding, biases, non-float32
        weights, an input too small, ...); the message names the first problem.
    """
    if type(model) not in (OptuNet, OptuNetV1):
        raise UnsupportedModelError(f"{type(model).__name__} is not OptuNet-shaped")
    dropout = model.dropout
    if type(dropout) is not nn.Dropout or dropout.p != 0:
        raise UnsupportedModelError(f"dropout {getattr(dropout, 'p', dropout)} is not "
                                    "implemented (the torch engine trains it)")
    conv1 = _check_conv("conv1", model.conv1)
    conv2 = _check_conv("conv2", model.conv2)
    _check_relu("relu1", model.relu1)
    _check_relu("relu2", model.relu2)
    pool = model.pool1
    if type(pool) is not nn.MaxPool2d or pool.return_indices or pool.ceil_mode:
        raise UnsupportedModelError("pool1 must be a floor-mode MaxPool2d")
    if _pair(pool.padding) != (0, 0) or _pair(pool.dilation) != (1, 1):
        raise UnsupportedModelError("pool1 must have no padding and dilation 1")
    pkh, pkw = _pair(pool.kernel_size)
    psh, psw = _pair(pool.stride if pool.stride is not None else pool.kernel_size)
    avg = model.pool2
    if type(avg) is not nn.AdaptiveAvgPool2d or avg.output_size not in (1, (1, 1)):
        raise UnsupportedModelError("pool2 must be a global average pool")
    if type(model.flatten) is not nn.Flatten:
        raise UnsupportedModelError("flatten must be nn.Flatten")
    if isinstance(model, OptuNetV1):
        hidden, features = _check_linear("fc1", model.fc1)
        _check_relu("relu3", model.relu3)
        num_classes, hidden_in = _check_linear("fc2", model.fc2)
        if hidden_in != hidden:
            raise UnsupportedModelError("fc1 and fc2 do not chain")
        keys: tuple[str, ...] = ("conv1.weight", "conv2.weight", "fc1.weight", "fc1.bias",
                "fc2.weight", "fc2.bias")
    else:
        num_classes, features = _check_linear("fc", model.fc)
        hidden = 0
        keys = ("conv1.weight", "conv2.weight", "fc.weight", "fc.bias")
    state = model.state_dict()
    if tuple(state) != keys:
        raise UnsupportedModelError(f"state_dict keys {tuple(state)} are not {keys}")
    if any(value.dtype != torch.float32 for value in state.values()):
        raise UnsupportedModelError("only float32 weights are implemented")
    c, h, w = (int(d) for d in input_shape)
    c1, cpg1, k1h, k1w, g1 = conv1
    c2, cpg2, k2h, k2w, g2 = conv2
    if c != cpg1 * g1 or c1 % g1 or c1 != cpg2 * g2 or c2 % g2 or features != c2:
        raise UnsupportedModelError(f"channels do not chain for input {input_shape}")
    h1, w1 = h - k1h + 1, w - k1w + 1
    ph, pw = (h1 - pkh) // psh + 1, (w1 - pkw) // psw + 1
    if h1 < pkh or w1 < pkw or ph < k2h or pw < k2w:
        raise UnsupportedModelError(f"input {input_shape} is too small for this network")
    return NetLayout(input_shape=(c, h, w), conv1=conv1, pool=(pkh, pkw, psh, psw),
                     conv2=conv2, hidden=hidden, num_classes=num_classes, keys=keys,
                     shapes=tuple(tuple(v.shape) for v in state.values()))
