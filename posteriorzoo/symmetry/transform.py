"""Applying elements of the symmetry group to checkpoints.

An element is a permutation per unit space, a positive scale vector per scale variable,
a vector of signs (+1 or -1) per sign variable and a softmax shift. Scalings and sign
flips are applied first (both are diagonal, so their order does not matter), in the
input's coordinates, then permutations: axis 0 (the writers) of every tensor, then
axis 1 (the readers), because a grouped convolution's input axis is local to the output
group its row belongs to.

Everything works on a *batch*: ``{key: tensor of shape (B, *shape)}`` with one group
element per checkpoint, so a whole collection is transformed without a Python loop over
checkpoints. :func:`apply_symmetry` is the one-checkpoint form.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch

from posteriorzoo._api import public
from posteriorzoo.symmetry.structure import (
    ScaleVariable,
    SignVariable,
    SymmetryStructure,
    TensorAxis,
    UnitSpace,
)

State = dict[str, torch.Tensor]


def _grouped_unit_index(rows: int, local: int, groups: int, device: torch.device
                        ) -> torch.Tensor:
    """For a grouped reader, the input unit of each (row, local column): shape (rows, local)."""
    group = torch.arange(rows, device=device) // (rows // groups)
    return group[:, None] * local + torch.arange(local, device=device)[None, :]


def _unit_multiplier(factors: torch.Tensor, shape: torch.Size, axis: TensorAxis
                     ) -> torch.Tensor:
    """Per-entry multipliers ``factors ** power`` broadcastable to ``(B, *shape)``.

    ``factors``: (B, size) scales (or signs) of the units indexing ``axis``.
    """
    powered = factors ** axis.power
    trailing = len(shape) - 2
    if axis.groups > 1:
        index = _grouped_unit_index(shape[0], shape[1], axis.groups, factors.device)
        return powered[:, index].reshape(*powered.shape[:1], shape[0], shape[1],
                                         *([1] * trailing))
    multiplier = powered.repeat_interleave(axis.block, dim=1)
    view = [multiplier.shape[0]] + [1] * len(shape)
    view[axis.axis + 1] = multiplier.shape[1]
    return multiplier.reshape(view)


def _permute_axis(tensor: torch.Tensor, axis: TensorAxis, order: torch.Tensor
                  ) -> torch.Tensor:
    """``tensor`` (B, *shape) with units reordered along ``axis``: new position p of
    checkpoint b holds old unit ``order[b, p]``."""
    batch = tensor.shape[0]
    if axis.groups > 1:
        # Rows already hold their new groups; within new group g the local columns are
        # reordered as the block of `order` that group g reads.
        rows, local = tensor.shape[1], tensor.shape[2]
        group = torch.arange(rows, device=tensor.device) // (rows // axis.groups)
        columns = order.reshape(batch, axis.groups, local)[:, group, :] % local
        index = columns.reshape(batch, rows, local, *([1] * (tensor.dim() - 3)))
        return tensor.gather(2, index.expand_as(tensor))
    index = (order[:, :, None] * axis.block
             + torch.arange(axis.block, device=order.device)).reshape(batch, -1)
    view = [batch] + [1] * (tensor.dim() - 1)
    view[axis.axis + 1] = index.shape[1]
    return tensor.gather(axis.axis + 1, index.reshape(view).expand_as(tensor))


def _multiply(result: State, variable: ScaleVariable | SignVariable,
              factors: torch.Tensor | np.ndarray) -> None:
    """Multiply every writer and reader of ``variable`` in ``result`` by its factors."""
    for axis in (*variable.writers, *variable.readers):
        tensor = result[axis.key]
        multiplier = _unit_multiplier(
            torch.as_tensor(factors, dtype=tensor.dtype, device=tensor.device),
            tensor.shape[1:], axis)
        result[axis.key] = ((tensor + axis.epsilon) * multiplier - axis.epsilon
                            if axis.epsilon else tensor * multiplier)


def transformed_batch(states: Mapping[str, torch.Tensor], structure: SymmetryStructure,
                      permutations: Mapping[int, torch.Tensor | np.ndarray] | None = None,
                      scales: Mapping[int, torch.Tensor | np.ndarray] | None = None,
                      softmax_shift: torch.Tensor | np.ndarray | None = None,
                      signs: Mapping[int, torch.Tensor | np.ndarray] | None = None
                      ) -> State:
    """:func:`apply_symmetry_batch` without its copies: tensors the element leaves alone
    are the input's own objects.

    The canonicalizer chains one such call per scale variable and per unit space (dozens
    for a ResNet-18); copying the untouched tensors each time was two thirds of its time.
    It copies once, at the end, instead.
    """
    result = dict(states)
    for index, factors in (scales or {}).items():
        _multiply(result, structure.scales[index], factors)
    for index, factors in (signs or {}).items():
        _multiply(result, structure.signs[index], factors)
    device = next(iter(states.values())).device if states else None
    permutations = {index: torch.as_tensor(order if isinstance(order, torch.Tensor)
                                           else np.asarray(order), dtype=torch.long,
                                           device=device)
                    for index, order in (permutations or {}).items()}
    for side in ("writers", "readers"):
        for index, order in permutations.items():
            space: UnitSpace = structure.spaces[index]
            for axis in getattr(space, side):
                result[axis.key] = _permute_axis(result[axis.key], axis, order)
    if softmax_shift is not None and structure.output_bias is not None:
        bias = result[structure.output_bias]
        shift = torch.as_tensor(softmax_shift, dtype=bias.dtype,
                                device=bias.device).reshape(-1, 1)
        result[structure.output_bias] = bias + shift
    return result


def unshared(result: Mapping[str, torch.Tensor], states: Mapping[str, torch.Tensor]) -> State:
    """``result`` with a copy of every tensor that is still one of ``states``' objects."""
    return {key: value.clone() if value is states.get(key) else value
            for key, value in result.items()}


@public
def apply_symmetry_batch(states: Mapping[str, torch.Tensor], structure: SymmetryStructure,
                         permutations: Mapping[int, torch.Tensor | np.ndarray] | None = None,
                         scales: Mapping[int, torch.Tensor | np.ndarray] | None = None,
                         softmax_shift: torch.Tensor | np.ndarray | None = None,
                         signs: Mapping[int, torch.Tensor | np.ndarray] | None = None
                         ) -> State:
    """Apply one group element per checkpoint to a batch of checkpoints.

    Parameters
    ----------
    states : mapping of str to tensor of shape (B, *shape)
    permutations : mapping of space index to int array (B, size), optional
        New position p of checkpoint b's space holds its old unit ``order[b, p]``.
    scales : mapping of scale-variable index to positive float array (B, size), optional
    softmax_shift : float array (B,), optional
        Added to every output bias of each checkpoint (the softmax is invariant to it).
    signs : mapping of sign-variable index to array (B, size) of +1 and -1, optional
        Multiply the units' writers and readers (only where an odd activation allows it).

    Returns
    -------
    dict of str to tensor of shape (B, *shape): new tensors, the inputs are not modified.
    """
    return unshared(transformed_batch(states, structure, permutations, scales,
                                      softmax_shift, signs), states)


@public
def stack_states(states: list[Mapping[str, torch.Tensor]]) -> State:
    """Checkpoints with the same keys as one batch ``{key: (B, *shape)}``."""
    return {key: torch.stack([state[key] for state in states]) for key in states[0]}


@public
def apply_symmetry(state: Mapping[str, torch.Tensor], structure: SymmetryStructure,
                   permutations: Mapping[int, np.ndarray] | None = None,
                   scales: Mapping[int, np.ndarray] | None = None,
                   softmax_shift: float = 0.0,
                   signs: Mapping[int, np.ndarray] | None = None) -> State:
    """Apply a group element to one checkpoint; returns a new state (same keys and shapes).

    Parameters
    ----------
    permutations : mapping of space index to int array (size,), optional
        New position p of the space holds old unit ``order[p]``.
    scales : mapping of scale-variable index to positive float array (size,), optional
    softmax_shift : float
        Added to every output bias (the softmax is invariant to it).
    signs : mapping of sign-variable index to array (size,) of +1 and -1, optional
    """
    batch = apply_symmetry_batch(
        {key: value[None] for key, value in state.items()}, structure,
        {index: np.asarray(order)[None] for index, order in (permutations or {}).items()},
        {index: torch.as_tensor(np.asarray(factors, dtype=np.float64))[None]
         for index, factors in (scales or {}).items()},
        np.array([softmax_shift]) if softmax_shift else None,
        {index: torch.as_tensor(np.asarray(values, dtype=np.float64))[None]
         for index, values in (signs or {}).items()})
    return {key: value[0] for key, value in batch.items()}


@public
def sample_signs(structure: SymmetryStructure, rng: np.random.Generator
                 ) -> dict[int, np.ndarray]:
    """Independent uniformly random signs (+1.0 or -1.0) for every flippable unit."""
    return {index: rng.choice([-1.0, 1.0], structure.spaces[structure.signs[index].space].size)
            for index in structure.flippable()}


@public
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
