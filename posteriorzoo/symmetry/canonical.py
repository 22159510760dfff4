"""Canonical forms: one representative per symmetry orbit.

The order is fixed: scalings first (so that sort keys do not depend on the input's
scale), then the softmax shift, then permutations, each pass in the network's graph
order so that a layer's incoming weights are already canonical when its own units are
normalised or sorted.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np
import torch

from posteriorzoo.errors import InvalidOptionError
from posteriorzoo.symmetry.structure import ScaleVariable, SymmetryStructure
from posteriorzoo.symmetry.transform import State, apply_symmetry

PERMUTATION_KEYS = ("first", "max", "none")
SCALINGS = ("norm", "std", "none")


@dataclass
class CanonicalReport:
    """What a canonicalization removed, and the units it could not normalise."""

    permutation: str
    scaling: str
    softmax: bool
    dead_units: list[tuple[int, int]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def _unit_rows(state: Mapping[str, torch.Tensor], variable: ScaleVariable, size: int
               ) -> np.ndarray | None:
    """Each unit's incoming values: the rows of the writers that scale exactly by lambda.

    A tensor that also reads the same variable (a layer inside its own residual stream)
    scales by lambda_i / lambda_j, not by lambda_i, so it does not define the scale.
    """
    readers = {axis.key for axis in variable.readers}
    rows = [state[axis.key].detach().double().reshape(size, -1).numpy()
            for axis in variable.writers if axis.key not in readers and axis.power == 1]
    return np.concatenate(rows, axis=1) if rows else None


def canonical_scales(state: State, structure: SymmetryStructure, method: str,
                     report: CanonicalReport) -> State:
    """Give every scalable unit's incoming values unit L2 norm (``norm``) or unit standard
    deviation (``std``), variable by variable in graph order (the scale is pushed forward
    into the next layer)."""
    for index in structure.scalable():
        variable = structure.scales[index]
        size = structure.spaces[variable.space].size
        rows = _unit_rows(state, variable, size)
        if rows is None:
            continue
        spread = np.linalg.norm(rows, axis=1) if method == "norm" else rows.std(axis=1)
        dead = spread <= np.finfo(np.float64).tiny
        report.dead_units += [(index, int(unit)) for unit in np.flatnonzero(dead)]
        factors = np.where(dead, 1.0, 1.0 / np.where(dead, 1.0, spread))
        state = apply_symmetry(state, structure, scales={index: factors})
    return state


def _sort_keys(state: Mapping[str, torch.Tensor], structure: SymmetryStructure, index: int,
               key: str) -> np.ndarray:
    space = structure.spaces[index]
    weight = next((axis.key for axis in space.writers if state[axis.key].dim() >= 2),
                  space.writers[0].key)
    rows = state[weight].detach().double().reshape(space.size, -1).numpy()
    return rows[:, 0] if key == "first" else rows.max(axis=1)


def canonical_permutations(state: State, structure: SymmetryStructure, key: str) -> State:
    """Sort every permutable space's units by ``key`` of their first incoming weight row.

    Around a grouped convolution, units are sorted within their groups; the groups of the
    convolution's input are ordered by their smallest key, and its output groups follow.
    """
    frozen = structure.fixed_group_layers()
    outputs = {layer: index for index, space in enumerate(structure.spaces)
               for layer, side, _ in space.group_constraints if side == "out"}
    for index in structure.permutable():
        space = structure.spaces[index]
        keys = _sort_keys(state, structure, index, key)
        if not space.group_constraints:
            state = apply_symmetry(state, structure,
                                   permutations={index: np.argsort(keys, kind="stable")})
            continue
        layer, side, groups = space.group_constraints[0]
        per_group = space.size // groups
        blocks = [block * per_group + np.argsort(keys[block * per_group:(block + 1) * per_group],
                                                 kind="stable") for block in range(groups)]
        permutations = {}
        block_order = np.arange(groups)
        if side == "in" and layer not in frozen:
            # Groups are ordered by their smallest key; the convolution's output groups
            # move with them in the same step (its input axis is local to each group).
            block_order = np.argsort([keys[block[0]] for block in blocks], kind="stable")
            out = outputs[layer]
            per_out = structure.spaces[out].size // groups
            permutations[out] = np.concatenate([b * per_out + np.arange(per_out)
                                                for b in block_order])
        permutations[index] = np.concatenate([blocks[b] for b in block_order])
        state = apply_symmetry(state, structure, permutations=permutations)
    return state


def canonicalize_state(state: Mapping[str, torch.Tensor], structure: SymmetryStructure,
                       permutation: str = "first", scaling: str = "norm",
                       softmax: bool = True) -> tuple[State, CanonicalReport]:
    """The canonical form of ``state`` under ``structure``'s symmetries, and a report."""
    if permutation not in PERMUTATION_KEYS:
        raise InvalidOptionError(f"permutation must be one of {PERMUTATION_KEYS}")
    if scaling not in SCALINGS:
        raise InvalidOptionError(f"scaling must be one of {SCALINGS}")
    report = CanonicalReport(permutation, scaling, softmax, notes=list(structure.notes))
    result = {key: value.clone() for key, value in state.items()}
    if scaling != "none":
        result = canonical_scales(result, structure, scaling, report)
    if softmax and structure.output_bias is not None:
        bias = result[structure.output_bias]
        result[structure.output_bias] = bias - bias.mean()
    if permutation != "none":
        result = canonical_permutations(result, structure, permutation)
    return result, report
