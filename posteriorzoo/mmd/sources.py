"""Where the samples come from: layers of in-memory arrays (or of any source with the same
``read`` interface, such as a collection's), read in blocks.

A *layer* is what one MMD compares: by default one parameter tensor (``conv2.weight``,
``fc.bias``), flattened; with ``group="module"`` the parameters of one module
(``fc.weight`` and ``fc.bias``) concatenated in state_dict order. Only parameters count
(the keys of ``model.named_parameters()``): BatchNorm running statistics and counters
are buffers and are left out unless asked for (``include_buffers=True`` adds the
floating-point buffers such as running_mean / running_var; integer buffers such as
num_batches_tracked are never compared).

Every source cuts a layer into the same blocks of consecutive features (C order), given
only the tensors' shapes: for a zoo, each block is an HDF5 hyperslab (a range of the first
trailing axis, or of a later one when one index of the first is already too big), read
with the chunk cache off so that only the block's bytes are read even when a chunk holds a
whole checkpoint. Small layers are one block, one contiguous read.
"""

from __future__ import annotations

import fnmatch
import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from posteriorzoo.errors import (
    InvalidOptionError,
    NonFiniteWeightsError,
    SampleSizeError,
    ShapeMismatchError,
    UnknownNameError,
)
from posteriorzoo.options import check_choice
from posteriorzoo.vocabulary import LAYER_GROUPS

#: Default budget of one block, summed over all collections compared at once (bytes).
DEFAULT_BLOCK_BYTES = 128 << 20

Index = tuple  # a tuple of slices and ints over a tensor's trailing axes


@dataclass(frozen=True)
class Layer:
    """One compared unit: a name, the state keys it concatenates, its parameter count."""

    name: str
    keys: tuple[str, ...]
    size: int


def block_plan(shape: tuple[int, ...], features: int) -> list[Index]:
    """Cut a tensor of ``shape`` into hyperslabs of at most ``features`` values, in C order.

    Parameters
    ----------
    shape : tuple of int
        One checkpoint's tensor shape (without the checkpoint axis).
    features : int
        Largest number of values per block (at least 1).

    Returns
    -------
    list of index tuples
        Applied after a leading ``slice`` over checkpoints; flattening the pieces in order
        gives the flattened tensor.
    """
    features = max(1, int(features))
    total = math.prod(shape)
    if not shape or total <= features:
        return [tuple(slice(None) for _ in shape)]
    inner = math.prod(shape[1:])
    if inner <= features:
        step = max(1, features // max(inner, 1))
        rest = tuple(slice(None) for _ in shape[1:])
        return [(slice(a, min(a + step, shape[0])), *rest) for a in range(0, shape[0], step)]
    return [(a, *sub) for a in range(shape[0]) for sub in block_plan(shape[1:], features)]


def _finite_or_raise(block: np.ndarray, label: str) -> None:
    if not np.isfinite(block).all():
        row = int(np.flatnonzero(~np.isfinite(block).all(axis=1))[0])
        raise NonFiniteWeightsError(f"{label}: checkpoint {row} has NaN or infinite values")


class ArraySource:
    """Samples held in memory: ``{key: array of shape (N, *shape)}``.

    Parameters
    ----------
    name : str
        Shown in reports.
    arrays : mapping of str to array-like
        One entry per layer key, the sample axis first (N >= 2 rows, same N for all).
    """

    def __init__(self, name: str, arrays: Mapping[str, np.ndarray]) -> None:
        self.name = name
        self.label = name
        self.arrays = {key: np.asarray(value) for key, value in arrays.items()}
        rows = {value.shape[0] if value.ndim else 0 for value in self.arrays.values()}
        if len(rows) > 1:
            raise ShapeMismatchError(f"{name}: layers have different numbers of samples {rows}")
        self.rows = rows.pop() if rows else 0
        self.shapes = {key: tuple(value.shape[1:]) for key, value in self.arrays.items()}
        self.provenance: dict = {"name": name, "kind": "arrays", "samples": self.rows}

    def read(self, key: str, index: Index) -> np.ndarray:
        block = self.arrays[key][(slice(None), *index)]
        return block.reshape(self.rows, -1)

    def close(self) -> None:
        pass


def layer_blocks(source, layer: Layer, features: int) -> Iterator[np.ndarray]:
    """The blocks (N, b) of ``layer`` from ``source``, in feature order, finite-checked."""
    for key in layer.keys:
        for index in block_plan(source.shapes[key], features):
            block = source.read(key, index)
            if not np.issubdtype(block.dtype, np.floating):
                block = block.astype(np.float64)
            _finite_or_raise(block, f"{source.label} [{key}]")
            yield block


# ------------------------------------------------------------------------ layer choice
def group_layers(keys: Sequence[str], shapes: Mapping[str, tuple[int, ...]],
                 group: str = "tensor") -> list[Layer]:
    """Layers from keys: one per tensor, or one per module (keys sharing a prefix)."""
    check_choice("group", group, LAYER_GROUPS)
    layers: dict[str, list[str]] = {}
    for key in keys:
        name = key if group == "tensor" else key.rsplit(".", 1)[0] if "." in key else key
        layers.setdefault(name, []).append(key)
    return [Layer(name, tuple(members), sum(math.prod(shapes[k]) for k in members))
            for name, members in layers.items()]


def select_layers(layers: Sequence[Layer], patterns: Sequence[str] | None) -> list[Layer]:
    """The layers whose name (or one of whose keys) matches a pattern (fnmatch), in order.

    Raises
    ------
    UnknownNameError
        A pattern matches nothing.
    InvalidOptionError
        The selection is empty, or a selected layer has no parameters.
    """
    if patterns is not None:
        chosen = []
        for pattern in patterns:
            hits = [layer for layer in layers
                    if fnmatch.fnmatchcase(layer.name, pattern)
                    or any(fnmatch.fnmatchcase(key, pattern) for key in layer.keys)]
            if not hits:
                raise UnknownNameError(
                    f"no layer matches {pattern!r}; layers: "
                    f"{', '.join(layer.name for layer in layers) or 'none'}")
            chosen.extend(hit for hit in hits if hit not in chosen)
        layers = [layer for layer in layers if layer in chosen]
    if not layers:
        raise InvalidOptionError("the layer selection is empty: nothing to compare")
    empty = [layer.name for layer in layers if layer.size == 0]
    if empty:
        raise InvalidOptionError(f"layers without parameters cannot be compared: {empty}")
    return list(layers)


def check_sources(target, methods: Sequence, layers: Sequence[Layer]) -> None:
    """Raise unless every source has >= 2 samples and the layers' shapes of the target."""
    for source in (target, *methods):
        if source.rows < 2:
            raise SampleSizeError(
                f"{source.label}: {source.rows} sample(s); the unbiased MMD needs at least 2")
    for source in methods:
        for layer in layers:
            for key in layer.keys:
                if key not in source.shapes:
                    raise ShapeMismatchError(f"{source.label}: no tensor {key!r} to compare "
                                             f"with the target's")
                if tuple(source.shapes[key]) != tuple(target.shapes[key]):
                    raise ShapeMismatchError(
                        f"{source.label}: {key} has shape {tuple(source.shapes[key])}, the "
                        f"target's is {tuple(target.shapes[key])}")


def features_per_block(rows: int, block_bytes: int) -> int:
    """Features per block so that all ``rows`` rows of a block take about ``block_bytes``
    (counted at 8 bytes per value)."""
    if block_bytes < 1:
        raise InvalidOptionError(f"the block size must be positive, not {block_bytes}")
    return max(1, int(block_bytes) // (8 * max(rows, 1)))
