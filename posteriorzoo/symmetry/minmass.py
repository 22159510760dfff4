"""Minimum scaled network mass: the scaling that minimises the weights' squared L2 norm.

With u = log(lambda) per scalable unit (0 for fixed units), a weight tensor W whose rows
belong to unit set r and columns to unit set c contributes
``sum_ij M[i, j] * exp(2 u_r[i] - 2 u_c[j])``, with M the squares of W summed over the
kernel (and over a flattened input's spatial block). The total is strictly convex in u
when every unit has weight mass both in and out, so the optimum is unique.

- ``solver="fast"``: Newton's method with a backtracking line search on that function
  (exact gradient and Hessian), to a gradient norm of 1e-11 relative to the mass, or
  until a step no longer lowers the mass.
- ``solver="cvxpy"``: the same problem written for cvxpy (exponential cone), the
  reference.

Weight tensors count as mass, BatchNorm weights as one-dimensional weights (the paper's
extension); biases and running statistics do not. The scaling a BatchNorm absorbs (its
input's scale) is not optimised: it would make the mass unbounded, the preceding
convolution's weights shrinking to zero, so it stays at 1. Units without any incoming or
any outgoing weight mass (a dead unit) make the problem unbounded; they stay at scale 1
and are reported.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np
import torch

from posteriorzoo.errors import InvalidOptionError
from posteriorzoo.symmetry.structure import SymmetryStructure
from posteriorzoo.symmetry.transform import apply_symmetry

SOLVERS = ("fast", "cvxpy")


@dataclass
class _Term:
    """One weight tensor's mass: M (rows, cols) and the unknown index of each row/column
    (-1 for a fixed unit)."""

    key: str
    mass: np.ndarray
    rows: np.ndarray
    cols: np.ndarray


@dataclass
class MinMassResult:
    """Mass before and after, the optimal scales, and each weight tensor's largest |w|."""

    mass_before: float
    mass_after: float
    scales: dict[int, np.ndarray]
    max_abs_before: dict[str, float]
    max_abs_after: dict[str, float]
    state: dict[str, torch.Tensor]
    dead_units: list[tuple[int, int]] = field(default_factory=list)
    iterations: int = 0


def _unknowns(structure: SymmetryStructure) -> dict[int, np.ndarray]:
    """Unknown indices of every optimised scale variable's units."""
    offsets, start = {}, 0
    for index in structure.scalable():
        variable = structure.scales[index]
        if variable.through_batchnorm:
            continue
        size = structure.spaces[variable.space].size
        offsets[index] = np.arange(start, start + size)
        start += size
    return offsets


def _terms(state: Mapping[str, torch.Tensor], structure: SymmetryStructure,
           unknowns: dict[int, np.ndarray]) -> list[_Term]:
    row_of: dict[str, np.ndarray] = {}
    col_of: dict[str, tuple[np.ndarray, object]] = {}
    for index, variable in enumerate(structure.scales):
        ids = unknowns.get(index)
        for axis in variable.writers:
            if ids is not None and axis.power == 1:
                row_of[axis.key] = ids
        for axis in variable.readers:
            if ids is not None and axis.power == -1:
                col_of[axis.key] = (ids, axis)
    terms = []
    for key, tensor in state.items():
        if not tensor.is_floating_point() or tensor.dim() == 0:
            continue
        if tensor.dim() == 1 and not (key.endswith(".weight") and key in row_of):
            continue  # biases and statistics are not mass; BatchNorm weights are
        squares = tensor.detach().double().numpy() ** 2
        if squares.ndim == 1:
            mass = squares[:, None]
        else:
            mass = squares.reshape(squares.shape[0], squares.shape[1], -1).sum(axis=2)
        rows = row_of.get(key, np.full(mass.shape[0], -1))
        if key in col_of:
            ids, axis = col_of[key]
            if axis.groups > 1:
                # column j of row i is input unit group(i) * local + j: spread into full width
                local = mass.shape[1]
                per_group = mass.shape[0] // axis.groups
                full = np.zeros((mass.shape[0], local * axis.groups))
                for row in range(mass.shape[0]):
                    group = row // per_group
                    full[row, group * local:(group + 1) * local] = mass[row]
                mass, cols = full, ids
            else:
                mass = mass.reshape(mass.shape[0], -1, axis.block).sum(axis=2)
                cols = ids
        else:
            cols = np.full(mass.shape[1], -1)
        terms.append(_Term(key, mass, rows, cols))
    return terms


def _value(terms: list[_Term], u: np.ndarray) -> float:
    full = np.append(u, 0.0)
    return float(sum((t.mass * np.exp(2 * full[t.rows][:, None] - 2 * full[t.cols][None, :]))
                     .sum() for t in terms))


def _newton(terms: list[_Term], size: int, tolerance: float = 1e-11,
            max_iterations: int = 200) -> tuple[np.ndarray, int]:
    u = np.zeros(size)
    for iteration in range(1, max_iterations + 1):
        full = np.append(u, 0.0)
        gradient = np.zeros(size + 1)
        hessian = np.zeros((size + 1, size + 1))
        for term in terms:
            value = term.mass * np.exp(2 * full[term.rows][:, None] - 2 * full[term.cols][None, :])
            by_row, by_col = value.sum(axis=1), value.sum(axis=0)
            np.add.at(gradient, term.rows, 2 * by_row)
            np.add.at(gradient, term.cols, -2 * by_col)
            np.add.at(hessian, (term.rows, term.rows), 4 * by_row)
            np.add.at(hessian, (term.cols, term.cols), 4 * by_col)
            row_index, col_index = np.meshgrid(term.rows, term.cols, indexing="ij")
            np.add.at(hessian, (row_index, col_index), -4 * value)
            np.add.at(hessian, (col_index, row_index), -4 * value)
        gradient, hessian = gradient[:size], hessian[:size, :size]
        current = _value(terms, u)
        if np.linalg.norm(gradient) <= tolerance * current:
            return u, iteration
        step = np.linalg.solve(hessian, -gradient)
        length, decrease = 1.0, gradient @ step
        while _value(terms, u + length * step) > current + 1e-4 * length * decrease:
            length /= 2
            if length < 1e-12:
                return u, iteration
        u = u + length * step
        if current - _value(terms, u) <= 1e-15 * current:  # no further progress possible
            return u, iteration
    return u, max_iterations


def _cvxpy(terms: list[_Term], size: int) -> np.ndarray:
    import cvxpy as cp

    u = cp.Variable(size)
    full = cp.hstack([u, np.zeros(1)])
    objective = 0
    for term in terms:
        rows, cols = full[term.rows], full[term.cols]
        exponent = 2 * (cp.reshape(rows, (len(term.rows), 1), order="C")
                        @ np.ones((1, len(term.cols)))
                        - np.ones((len(term.rows), 1))
                        @ cp.reshape(cols, (1, len(term.cols)), order="C"))
        objective = objective + cp.sum(cp.multiply(term.mass, cp.exp(exponent)))
    problem = cp.Problem(cp.Minimize(objective))
    problem.solve(solver=cp.CLARABEL)
    if problem.status not in ("optimal", "optimal_inaccurate"):
        raise InvalidOptionError(f"cvxpy could not solve the min-mass problem: {problem.status}")
    return np.asarray(u.value, dtype=np.float64)


def _dead(terms: list[_Term], size: int) -> np.ndarray:
    incoming, outgoing = np.zeros(size + 1), np.zeros(size + 1)
    for term in terms:
        np.add.at(incoming, term.rows, term.mass.sum(axis=1))
        np.add.at(outgoing, term.cols, term.mass.sum(axis=0))
    return np.flatnonzero((incoming[:size] <= 0) | (outgoing[:size] <= 0))


def solve_min_mass(state: Mapping[str, torch.Tensor], structure: SymmetryStructure,
                   solver: str = "fast") -> MinMassResult:
    """Scale ``state`` to its minimum mass; see the module docstring."""
    if solver not in SOLVERS:
        raise InvalidOptionError(f"solver must be one of {SOLVERS}, not {solver!r}")
    unknowns = _unknowns(structure)
    size = sum(len(ids) for ids in unknowns.values())
    terms = _terms(state, structure, unknowns)
    dead = _dead(terms, size)
    if dead.size:
        # Drop dead units from the problem: they keep u = 0 (scale 1).
        keep = np.setdiff1d(np.arange(size), dead)
        renumber = np.full(size + 1, -1)
        renumber[keep] = np.arange(keep.size)
        terms = [_Term(t.key, t.mass, renumber[t.rows], renumber[t.cols]) for t in terms]
    active = size - dead.size
    solution, iterations = (_newton(terms, active) if solver == "fast"
                            else (_cvxpy(terms, active), 0))
    u = np.zeros(size)
    u[np.setdiff1d(np.arange(size), dead)] = solution
    scales = {index: np.exp(u[ids]) for index, ids in unknowns.items()}
    scaled = apply_symmetry(state, structure, scales=scales)
    weights = [t.key for t in terms]
    unit_of = {int(i): (index, int(unit)) for index, ids in unknowns.items()
               for unit, i in enumerate(ids)}
    return MinMassResult(
        mass_before=sum(float((state[k].double() ** 2).sum()) for k in weights),
        mass_after=sum(float((scaled[k].double() ** 2).sum()) for k in weights),
        scales=scales,
        max_abs_before={k: float(state[k].abs().max()) for k in weights},
        max_abs_after={k: float(scaled[k].abs().max()) for k in weights},
        state=scaled, dead_units=[unit_of[int(i)] for i in dead], iterations=iterations)
