"""Canonical forms: one representative per symmetry orbit.

The order is fixed: scalings first (so that sort keys do not depend on the input's
scale), then signs, then the softmax shift, then permutations, each pass in the network's
graph order so that a layer's incoming weights are already canonical when its own units
are normalised, flipped or sorted. Every pass works on a batch ``{key: (B, *shape)}`` at
once.

**Sign rule.** Where an odd activation (or an FRN's gamma) allows a unit's sign to be
flipped (see :mod:`posteriorzoo.symmetry.structure`), the canonical sign makes the sum of
the unit's incoming values positive: its weights over all its inputs (and kernel
positions) plus its bias. That sum does not depend on the order of the inputs, and the
inputs' scales and signs are already canonical when it is taken, so it depends only on
the orbit. When it is zero (at most 1e-9 of the sum of absolute values), the sum of
cubes decides, then the sum of fifth powers; a unit for which all three vanish (a dead
unit, or incoming values that come in +/- pairs) keeps its sign and is reported in
:attr:`CanonicalReport.sign_ties`.
Under ``scaling="std"`` the units are first scaled to unit norm, then flipped, then
scaled to unit standard deviation: a standard deviation changes when an input unit is
flipped, a norm does not.

``scaling="minmass"`` first applies ``norm`` (which also fixes the scales a BatchNorm or
an FRN absorbs, on which the mass has no minimum) and then rescales to the minimum mass
over the remaining scalings (:mod:`posteriorzoo.symmetry.minmass`). Both steps depend only on the
orbit, so the result is canonical; without BatchNorm it has the same mass as
:func:`~posteriorzoo.symmetry.min_mass` of the input.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from posteriorzoo._api import public
from posteriorzoo.options import check_choice
from posteriorzoo.symmetry.structure import ScaleVariable, SignVariable, SymmetryStructure
from posteriorzoo.symmetry.transform import State, transformed_batch, unshared
from posteriorzoo.vocabulary import MINMASS_SOLVERS, PERMUTATION_KEYS, SCALINGS


@dataclass
class CanonicalReport:
    """What a canonicalization removed, and the units it could not normalise.

    ``dead_units`` lists ``(scale variable, unit)`` pairs for one checkpoint, or
    ``(checkpoint, scale variable, unit)`` triples for a batch: units with no incoming
    weights, left at scale 1. ``sign_ties`` lists ``(sign variable, unit)`` (or
    ``(checkpoint, sign variable, unit)``): units whose sign the rule cannot decide (see
    the module docstring), left as they are.
    """

    permutation: str
    scaling: str
    softmax: bool
    dead_units: list[tuple[int, ...]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    signs: bool = True
    sign_ties: list[tuple[int, ...]] = field(default_factory=list)


def _unit_rows(states: Mapping[str, torch.Tensor], variable: ScaleVariable | SignVariable,
               size: int) -> torch.Tensor | None:
    """Each unit's incoming values, (B, size, k): the rows of the writers that scale
    exactly by lambda (or flip exactly with the sign).

    A tensor that also reads the same variable (a layer inside its own residual stream)
    scales by lambda_i / lambda_j, not by lambda_i, so it does not define the scale.
    """
    readers = {axis.key for axis in variable.readers}
    rows = [states[axis.key].reshape(states[axis.key].shape[0], size, -1)
            for axis in variable.writers if axis.key not in readers and axis.power == 1]
    return torch.cat(rows, dim=2) if rows else None


def canonical_scales(states: State, structure: SymmetryStructure, method: str,
                     report: CanonicalReport) -> State:
    """Give every scalable unit's incoming values unit L2 norm (``norm``) or unit standard
    deviation (``std``), variable by variable in graph order (the scale is pushed forward
    into the next layer)."""
    tiny = torch.finfo(torch.float64).tiny
    for index in structure.scalable():
        variable = structure.scales[index]
        rows = _unit_rows(states, variable, structure.spaces[variable.space].size)
        if rows is None:
            continue
        rows = rows.double()
        spread = (torch.linalg.vector_norm(rows, dim=2) if method == "norm"
                  else rows.std(dim=2, correction=0))
        dead = spread <= tiny
        report.dead_units += [(int(b), index, int(unit)) for b, unit in dead.nonzero().tolist()]
        factors = torch.where(dead, 1.0, 1.0 / torch.where(dead, 1.0, spread))
        states = transformed_batch(states, structure, scales={index: factors})
    return states


#: A sum of odd powers counts as zero below this fraction of the sum of absolute powers.
SIGN_TOLERANCE = 1e-9


def canonical_signs(states: State, structure: SymmetryStructure, report: CanonicalReport
                    ) -> State:
    """Flip every flippable unit so that the sum of its incoming values is positive (ties:
    sums of cubes, then of fifth powers), variable by variable in graph order."""
    for index in structure.flippable():
        variable = structure.signs[index]
        rows = _unit_rows(states, variable, structure.spaces[variable.space].size)
        if rows is None:
            continue
        rows = rows.double()
        signs = torch.zeros(rows.shape[:2], dtype=torch.float64, device=rows.device)
        for power in (1, 3, 5):
            moment = (rows ** power).sum(dim=2)
            decided = (signs == 0) & (moment.abs() > SIGN_TOLERANCE
                                      * (rows.abs() ** power).sum(dim=2))
            signs = torch.where(decided, torch.sign(moment), signs)
        tied = signs == 0
        report.sign_ties += [(int(b), index, int(unit)) for b, unit in tied.nonzero().tolist()]
        states = transformed_batch(states, structure,
                                      signs={index: torch.where(tied, 1.0, signs)})
    return states


def _sort_keys(states: Mapping[str, torch.Tensor], structure: SymmetryStructure, index: int,
               key: str) -> torch.Tensor:
    """(B, size) sort key of every unit of space ``index``."""
    space = structure.spaces[index]
    weight = next((axis.key for axis in space.writers if states[axis.key].dim() >= 3),
                  space.writers[0].key)
    rows = states[weight].reshape(states[weight].shape[0], space.size, -1)
    return rows[:, :, 0] if key == "first" else rows.amax(dim=2)


def canonical_permutations(states: State, structure: SymmetryStructure, key: str) -> State:
    """Sort every permutable space's units by ``key`` of their first incoming weight row.

    Around a grouped convolution, units are sorted within their groups; the groups of the
    convolution's input are ordered by their smallest key, and its output groups follow.
    """
    frozen = structure.fixed_group_layers()
    outputs = {layer: index for index, space in enumerate(structure.spaces)
               for layer, side, _ in space.group_constraints if side == "out"}
    for index in structure.permutable():
        space = structure.spaces[index]
        keys = _sort_keys(states, structure, index, key)
        if not space.group_constraints:
            order = torch.argsort(keys, dim=1, stable=True)
            states = transformed_batch(states, structure, permutations={index: order})
            continue
        layer, side, groups = space.group_constraints[0]
        batch, per_group = keys.shape[0], space.size // groups
        grouped = keys.reshape(batch, groups, per_group)
        within = (torch.argsort(grouped, dim=2, stable=True)
                  + (torch.arange(groups, device=keys.device) * per_group)[None, :, None])
        permutations = {}
        block_order = torch.arange(groups, device=keys.device).expand(batch, groups)
        if side == "in" and layer not in frozen:
            # Groups are ordered by their smallest key; the convolution's output groups
            # move with them in the same step (its input axis is local to each group).
            block_order = torch.argsort(grouped.amin(dim=2), dim=1, stable=True)
            out = outputs[layer]
            per_out = structure.spaces[out].size // groups
            permutations[out] = (block_order[:, :, None] * per_out
                                 + torch.arange(per_out, device=keys.device)
                                 ).reshape(batch, -1)
        permutations[index] = within.gather(
            1, block_order[:, :, None].expand(batch, groups, per_group)).reshape(batch, -1)
        states = transformed_batch(states, structure, permutations=permutations)
    return states


def check_options(permutation: str, scaling: str, solver: str = "fast") -> None:
    """Raise :class:`InvalidOptionError` for an unknown sort key, scaling or solver (the
    vocabulary's :data:`~posteriorzoo.vocabulary.PERMUTATION_KEYS`, ``SCALINGS`` and
    ``MINMASS_SOLVERS``, which the command line offers)."""
    check_choice("permutation", permutation, PERMUTATION_KEYS)
    check_choice("scaling", scaling, SCALINGS)
    check_choice("solver", solver, MINMASS_SOLVERS)


@public
def canonicalize_batch(states: Mapping[str, torch.Tensor], structure: SymmetryStructure,
                       permutation: str = "first", scaling: str = "norm",
                       softmax: bool = True, solver: str = "fast", signs: bool = True
                       ) -> tuple[State, CanonicalReport]:
    """Canonical forms of a batch ``{key: (B, *shape)}``; dead units and sign ties reported
    as ``(checkpoint, variable, unit)``. ``solver`` is used by ``scaling="minmass"`` only;
    ``signs=False`` leaves the sign flips of odd activations in place."""
    check_options(permutation, scaling, solver)
    report = CanonicalReport(permutation, scaling, softmax, notes=list(structure.notes),
                             signs=signs)
    flip = signs and bool(structure.flippable())
    result = dict(states)
    late_std = flip and scaling == "std"
    if late_std:
        # A standard deviation changes when an input unit flips: norm first, for the sign
        # rule, and std after it (its dead units are the ones reported).
        result = canonical_scales(result, structure, "norm",
                                  CanonicalReport(permutation, scaling, softmax))
    elif scaling != "none":
        result = canonical_scales(result, structure, "std" if scaling == "std" else "norm",
                                  report)
    if scaling == "minmass":
        from posteriorzoo.symmetry.minmass import solve_min_mass_batch

        # the solver works on CPU (scipy, cvxpy); the batch goes back to its device
        device = next(iter(result.values())).device
        result = {key: value.to(device) for key, value in solve_min_mass_batch(
            {key: value.cpu() for key, value in result.items()}, structure,
            solver).states.items()}
    if flip:
        result = canonical_signs(result, structure, report)
    if late_std:
        result = canonical_scales(result, structure, "std", report)
    if softmax and structure.output_bias is not None:
        bias = result[structure.output_bias]
        result[structure.output_bias] = bias - bias.mean(dim=1, keepdim=True)
    if permutation != "none":
        result = canonical_permutations(result, structure, permutation)
    return unshared(result, states), report


@public
def canonicalize_state(state: Mapping[str, torch.Tensor], structure: SymmetryStructure,
                       permutation: str = "first", scaling: str = "norm",
                       softmax: bool = True, solver: str = "fast", signs: bool = True
                       ) -> tuple[State, CanonicalReport]:
    """The canonical form of one checkpoint under ``structure``'s symmetries, and a report
    whose dead units and sign ties are ``(variable, unit)`` pairs."""
    batch, report = canonicalize_batch({key: value[None] for key, value in state.items()},
                                       structure, permutation, scaling, softmax, solver,
                                       signs)
    report.dead_units = [unit[1:] for unit in report.dead_units]
    report.sign_ties = [unit[1:] for unit in report.sign_ties]
    return {key: value[0] for key, value in batch.items()}, report



