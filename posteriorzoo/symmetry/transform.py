"""Applying elements of the symmetry group to a state_dict.

An element is a permutation per unit space, a positive scale vector per scale variable
and a softmax shift. Scalings are applied first, in the input's coordinates, then
permutations: axis 0 (the writers) of every tensor, then axis 1 (the readers), because a
grouped convolution's input axis is local to the output group its row belongs to.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch

from posteriorzoo.symmetry.structure import SymmetryStructure, TensorAxis, UnitSpace

State = dict[str, torch.Tensor]


def _grouped_unit_index(tensor: torch.Tensor, axis: TensorAxis) -> np.ndarray:
    """For a grouped reader, the input unit of each (row, local column): shape (rows, cols)."""
    rows, local = tensor.shape[0], tensor.shape[1]
    per_group_rows = rows // axis.groups
    group = np.arange(rows) // per_group_rows
    return group[:, None] * local + np.arange(local)[None, :]


def _scale_axis(tensor: torch.Tensor, axis: TensorAxis, factors: np.ndarray) -> torch.Tensor:
    """``tensor`` multiplied along ``axis`` by ``factors ** axis.power`` (per unit)."""
    powered = factors.astype(np.float64) ** axis.power
    if axis.groups > 1:
        multiplier = powered[_grouped_unit_index(tensor, axis)]
    else:
        multiplier = np.repeat(powered, axis.block)
        shape = [1] * tensor.dim()
        shape[axis.axis] = multiplier.shape[0]
        multiplier = multiplier.reshape(shape)
    if multiplier.ndim == 2:
        multiplier = multiplier.reshape(*multiplier.shape, *([1] * (tensor.dim() - 2)))
    return tensor * torch.as_tensor(multiplier, dtype=tensor.dtype)


def _permute_axis(tensor: torch.Tensor, axis: TensorAxis, order: np.ndarray) -> torch.Tensor:
    """``tensor`` with units reordered along ``axis``: new position p holds old unit order[p]."""
    if axis.groups > 1:
        # Rows already hold their new groups; within new group b the local columns are
        # reordered as the block of `order` that group b reads.
        local = tensor.shape[1]
        per_group_rows = tensor.shape[0] // axis.groups
        result = torch.empty_like(tensor)
        for group in range(axis.groups):
            block = order[group * local:(group + 1) * local]
            columns = torch.as_tensor(block % local)
            rows = slice(group * per_group_rows, (group + 1) * per_group_rows)
            result[rows] = tensor[rows].index_select(1, columns)
        return result
    index = (order[:, None] * axis.block + np.arange(axis.block)[None, :]).reshape(-1)
    return tensor.index_select(axis.axis, torch.as_tensor(index))


def apply_symmetry(state: Mapping[str, torch.Tensor], structure: SymmetryStructure,
                   permutations: Mapping[int, np.ndarray] | None = None,
                   scales: Mapping[int, np.ndarray] | None = None,
                   softmax_shift: float = 0.0) -> State:
    """Apply a group element to ``state`` and return the new state (same keys and shapes).

    Parameters
    ----------
    permutations : mapping of space index to int array (size,), optional
        New position p of the space holds old unit ``order[p]``.
    scales : mapping of scale-variable index to positive float array (size,), optional
    softmax_shift : float
        Added to every output bias (the softmax is invariant to it).
    """
    result = {key: value.clone() for key, value in state.items()}
    for index, factors in (scales or {}).items():
        variable = structure.scales[index]
        for axis in (*variable.writers, *variable.readers):
            result[axis.key] = _scale_axis(result[axis.key], axis, np.asarray(factors))
    permutations = permutations or {}
    for side in ("writers", "readers"):
        for index, order in permutations.items():
            space: UnitSpace = structure.spaces[index]
            for axis in getattr(space, side):
                result[axis.key] = _permute_axis(result[axis.key], axis, np.asarray(order))
    if softmax_shift and structure.output_bias is not None:
        result[structure.output_bias] = result[structure.output_bias] + softmax_shift
    return result


def sample_permutations(structure: SymmetryStructure, rng: np.random.Generator
                        ) -> dict[int, np.ndarray]:
    """A uniformly random permutation of every permutable space.

    Spaces read or written by a grouped convolution get block-structured permutations:
    whole groups are swapped (the same block order on the convolution's input and output
    spaces, unless one of them is fixed) and units are permuted within each group.
    """
    # Grouped layers that share a space must swap their groups in the same way.
    leader: dict[str, str] = {}
    for space in structure.spaces:
        layers = sorted(layer for layer, _, _ in space.group_constraints)
        for layer in layers:
            leader.setdefault(layer, layer)
        for layer in layers[1:]:
            old, new = leader[layer], leader[layers[0]]
            leader = {k: (new if v == old else v) for k, v in leader.items()}
    # A fixed space on either side of a grouped layer forbids swapping its groups.
    frozen = {leader[layer] for layer in structure.fixed_group_layers()}
    block_orders: dict[str, np.ndarray] = {}
    result = {}
    for index in structure.permutable():
        space = structure.spaces[index]
        if not space.group_constraints:
            result[index] = rng.permutation(space.size)
            continue
        layer, _, groups = space.group_constraints[0]
        key = leader[layer]
        if key not in block_orders:
            block_orders[key] = np.arange(groups) if key in frozen else rng.permutation(groups)
        per_group = space.size // groups
        blocks = [block * per_group + rng.permutation(per_group) for block in block_orders[key]]
        result[index] = np.concatenate(blocks)
    return result
