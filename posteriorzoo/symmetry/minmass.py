"""Minimum scaled network mass: the scaling that minimises the weights' squared L2 norm.

With u = log(lambda) per scalable unit (0 for fixed units), a weight tensor W whose rows
belong to units r and columns to units c contributes
``sum_ij M[i, j] * exp(2 u_r[i] - 2 u_c[j])``, with M the squares of W summed over the
kernel (and over a flattened input's spatial block). Entries that share a pair of units
are summed first, so the objective is ``sum_p m_p exp(2 u[row_p] - 2 u[col_p])`` over
unit pairs p; a full ResNet-18 has a few thousand pairs. The function is strictly convex
in u when every unit has weight mass both in and out, so the optimum is unique.

- ``solver="fast"``: Newton's method with exact gradient and Hessian and a backtracking
  line search, run on a whole batch of checkpoints at once (batched dense Cholesky
  solves, or sparse solves above :data:`DENSE_LIMIT` unknowns), to a
  gradient norm of 1e-11 relative to the mass, or until a step no longer lowers it.
- ``solver="cvxpy"``: the same objective written for cvxpy as a sum of exponentials of
  an affine function of u (exponential cones, solved by Clarabel), one checkpoint at a
  time: the reference.

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

from posteriorzoo._api import public
from posteriorzoo.errors import InvalidOptionError
from posteriorzoo.options import check_choice
from posteriorzoo.symmetry.structure import SymmetryStructure
from posteriorzoo.symmetry.transform import State, apply_symmetry_batch
from posteriorzoo.vocabulary import MINMASS_SOLVERS


@dataclass
class MinMassResult:
    """One checkpoint's minimum mass: mass before and after, the optimal scales per scale
    variable, each weight tensor's largest |w| before and after, the rescaled state."""

    mass_before: float
    mass_after: float
    scales: dict[int, np.ndarray]
    max_abs_before: dict[str, float]
    max_abs_after: dict[str, float]
    state: dict[str, torch.Tensor]
    dead_units: list[tuple[int, int]] = field(default_factory=list)
    iterations: int = 0


@dataclass
class MinMassBatch:
    """Minimum mass of a batch of B checkpoints (arrays over the checkpoint axis).

    ``mass_before``/``mass_after``: (B,); ``scales``: variable -> (B, size);
    ``max_abs_before``/``max_abs_after``: weight key -> (B,); ``states``: key ->
    (B, *shape); ``dead_units``: ``(checkpoint, variable, unit)``; ``iterations``: (B,).
    """

    mass_before: np.ndarray
    mass_after: np.ndarray
    scales: dict[int, np.ndarray]
    max_abs_before: dict[str, np.ndarray]
    max_abs_after: dict[str, np.ndarray]
    states: State
    dead_units: list[tuple[int, int, int]]
    iterations: np.ndarray

    def __getitem__(self, b: int) -> MinMassResult:
        return MinMassResult(
            float(self.mass_before[b]), float(self.mass_after[b]),
            {index: values[b] for index, values in self.scales.items()},
            {key: float(v[b]) for key, v in self.max_abs_before.items()},
            {key: float(v[b]) for key, v in self.max_abs_after.items()},
            {key: value[b] for key, value in self.states.items()},
            [unit[1:] for unit in self.dead_units if unit[0] == b], int(self.iterations[b]))


@dataclass
class _Term:
    """How one weight tensor's squares reduce to unit pairs."""

    key: str
    block: int          # reader block: columns summed in groups of this many
    entries: np.ndarray  # (rows * reduced columns,) index of each entry's pair


@dataclass
class MassProblem:
    """The min-mass objective of one structure, built once and reused for every checkpoint.

    ``size`` unknowns; unit index ``size`` stands for every fixed unit. Pair p couples
    ``rows[p]`` and ``cols[p]``; pairs whose exponent is identically zero (both units
    fixed, or the same unit) are merged into pair 0, which is (size, size).
    """

    size: int
    unknowns: dict[int, np.ndarray]
    rows: torch.Tensor
    cols: torch.Tensor
    terms: list[_Term]

    @property
    def keys(self) -> list[str]:
        """The weight tensors that count as mass."""
        return [term.key for term in self.terms]

    def pair_mass(self, states: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """(B, pairs) summed squares of every pair, in float64."""
        blocks = []
        for term in self.terms:
            squares = states[term.key].double() ** 2
            batch, rows = squares.shape[:2]
            if squares.dim() == 2:  # a BatchNorm weight: one column
                squares = squares[:, :, None]
            elif squares.dim() > 3:  # a convolution: sum over the kernel
                squares = squares.reshape(batch, rows, squares.shape[2], -1).sum(dim=3)
            blocks.append(squares.reshape(batch, rows, -1, term.block).sum(dim=3)
                          .reshape(batch, -1))
        entries = torch.as_tensor(np.concatenate([t.entries for t in self.terms]))
        mass = torch.zeros(blocks[0].shape[0], len(self.rows), dtype=torch.float64)
        return mass.index_add_(1, entries, torch.cat(blocks, dim=1))

    def values(self, mass: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        """(B, pairs) each pair's mass after scaling by exp(u), u of shape (B, size)."""
        full = torch.cat([u, torch.zeros(u.shape[0], 1, dtype=u.dtype)], dim=1)
        return mass * torch.exp(2 * (full[:, self.rows] - full[:, self.cols]))

    def objective(self, mass: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        """(B,) total mass after scaling by exp(u)."""
        return self.values(mass, u).sum(dim=1)


@public
def mass_problem(structure: SymmetryStructure, template: Mapping[str, torch.Tensor]
                 ) -> MassProblem:
    """The min-mass objective for ``structure``; ``template`` gives the tensors' shapes
    (one checkpoint, no batch axis)."""
    unknowns, start = {}, 0
    for index in structure.scalable():
        variable = structure.scales[index]
        if not variable.through_batchnorm:
            size = structure.spaces[variable.space].size
            unknowns[index] = np.arange(start, start + size)
            start += size
    fixed = start
    row_of: dict[str, np.ndarray] = {}
    per_channel: set[str] = set()   # (1, C, ...) parameters, units on axis 1 (FRN's)
    col_of: dict[str, tuple[np.ndarray, object]] = {}
    batchnorm_weights = set()
    for index, variable in enumerate(structure.scales):
        ids = unknowns.get(index)
        for axis in variable.writers:
            if len(template[axis.key].shape) == 1 and axis.key.endswith(".weight"):
                batchnorm_weights.add(axis.key)
            if ids is not None and axis.power == 1:
                row_of[axis.key] = ids
                if axis.axis == 1:
                    per_channel.add(axis.key)
        for axis in variable.readers:
            if ids is not None and axis.power == -1:
                col_of[axis.key] = (ids, axis)
    raw_terms: list[tuple[str, int, np.ndarray]] = []
    for key, tensor in template.items():
        if not tensor.is_floating_point() or tensor.dim() == 0:
            continue
        if tensor.dim() == 1 and key not in batchnorm_weights:
            continue  # biases and statistics are not mass; BatchNorm weights are
        rows = row_of.get(key, np.full(tensor.shape[0], fixed))
        columns = tensor.shape[1] if tensor.dim() > 1 else 1
        block = 1
        if key in col_of:
            ids, axis = col_of[key]
            if axis.groups > 1:
                # column j of row i is input unit group(i) * local + j
                group = np.arange(tensor.shape[0]) // (tensor.shape[0] // axis.groups)
                cols = ids[group[:, None] * columns + np.arange(columns)[None, :]]
            else:
                block = axis.block
                cols = np.broadcast_to(ids, (tensor.shape[0], columns // block))
        else:
            cols = np.full((tensor.shape[0], columns), fixed)
        if key in per_channel:   # one row whose columns are the units: (unit, fixed)
            rows, cols = rows[None, :], np.full((1, rows.size), fixed)
        else:
            rows = np.broadcast_to(rows[:, None], cols.shape)
        pair = rows * (fixed + 1) + cols
        pair[rows == cols] = fixed * (fixed + 1) + fixed  # constant pairs
        raw_terms.append((key, block, pair.reshape(-1)))
    everything = np.concatenate([np.array([fixed * (fixed + 1) + fixed])]
                                + [pair for _, _, pair in raw_terms])
    pairs, inverse = np.unique(everything, return_inverse=True)
    # np.unique sorts: put the constant pair first so that pair 0 is (fixed, fixed)
    order = np.concatenate([[np.flatnonzero(pairs == everything[0])[0]],
                            np.flatnonzero(pairs != everything[0])])
    position = np.empty_like(order)
    position[order] = np.arange(order.size)
    pairs, inverse = pairs[order], position[inverse]
    terms, offset = [], 1
    for key, block, pair in raw_terms:
        terms.append(_Term(key, block, inverse[offset:offset + pair.size]))
        offset += pair.size
    return MassProblem(fixed, unknowns, torch.as_tensor(pairs // (fixed + 1)),
                       torch.as_tensor(pairs % (fixed + 1)), terms)


#: Above this many unknowns the Newton system is solved as a sparse matrix, one
#: checkpoint at a time (a ResNet-18's Hessian is nearly diagonal); below, as a batch of
#: dense matrices.
DENSE_LIMIT = 512


def _gradient(problem: MassProblem, values: torch.Tensor) -> torch.Tensor:
    gradient = torch.zeros(values.shape[0], problem.size + 1, dtype=torch.float64)
    gradient.index_add_(1, problem.rows, 2 * values).index_add_(1, problem.cols, -2 * values)
    return gradient[:, :-1]


def _hessian_entries(problem: MassProblem) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Row, column and sign of each pair's four Hessian contributions (size = fixed)."""
    rows, cols = problem.rows, problem.cols
    return (torch.cat([rows, cols, rows, cols]), torch.cat([rows, cols, cols, rows]),
            torch.tensor([4.0, 4.0, -4.0, -4.0], dtype=torch.float64
                         ).repeat_interleave(len(rows)))


def _dense_steps(problem: MassProblem, values: torch.Tensor, gradient: torch.Tensor,
                 active: torch.Tensor) -> torch.Tensor:
    n = problem.size + 1
    rows, cols, signs = _hessian_entries(problem)
    hessian = torch.zeros(values.shape[0], n * n, dtype=torch.float64)
    hessian.index_add_(1, rows * n + cols, values.repeat(1, 4) * signs)
    hessian = hessian.reshape(-1, n, n)[:, :-1, :-1]
    hessian = (hessian * (active[:, :, None] & active[:, None, :])
               + torch.diag_embed((~active).double()))
    factor, info = torch.linalg.cholesky_ex(hessian)
    step = torch.cholesky_solve(-gradient[:, :, None], factor)[:, :, 0]
    if (info != 0).any():  # not numerically positive definite: least squares
        bad = info != 0
        step[bad] = torch.linalg.lstsq(hessian[bad], -gradient[bad][:, :, None]
                                       ).solution[:, :, 0]
    return step


def _sparse_step(problem: MassProblem, values: torch.Tensor, gradient: torch.Tensor,
                 active: torch.Tensor) -> torch.Tensor:
    """One checkpoint's Newton step; ``values`` (pairs,), ``gradient``/``active`` (size,)."""
    import scipy.sparse as sparse
    from scipy.sparse.linalg import spsolve

    rows, cols, signs = (x.numpy() for x in _hessian_entries(problem))
    data = values.numpy()[np.tile(np.arange(len(problem.rows)), 4)] * signs
    free = np.append(active.numpy(), False)
    keep = free[rows] & free[cols]
    inactive = np.flatnonzero(~free[:-1])
    hessian = sparse.csc_matrix(
        (np.concatenate([data[keep], np.ones(inactive.size)]),
         (np.concatenate([rows[keep], inactive]), np.concatenate([cols[keep], inactive]))),
        shape=(problem.size, problem.size))
    return torch.as_tensor(spsolve(hessian, -gradient.numpy()))


def _newton(problem: MassProblem, mass: torch.Tensor, active: torch.Tensor,
            tolerance: float = 1e-11, max_iterations: int = 200
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """Minimise every checkpoint's objective; inactive unknowns stay at 0."""
    batch, size = mass.shape[0], problem.size
    u = torch.zeros(batch, size, dtype=torch.float64)
    iterations = torch.zeros(batch, dtype=torch.long)
    running = torch.ones(batch, dtype=torch.bool)
    for _ in range(max_iterations):
        values = problem.values(mass, u)
        current = values.sum(dim=1)
        gradient = _gradient(problem, values) * active
        running &= torch.linalg.vector_norm(gradient, dim=1) > tolerance * current
        if not running.any():
            break
        iterations += running
        if size <= DENSE_LIMIT:
            step = _dense_steps(problem, values, gradient, active)
        else:
            step = torch.zeros_like(u)
            for b in running.nonzero()[:, 0].tolist():
                step[b] = _sparse_step(problem, values[b], gradient[b], active[b])
        step = step * running[:, None]
        decrease = (gradient * step).sum(dim=1)
        length = torch.ones(batch, dtype=torch.float64)
        while True:
            trial = problem.objective(mass, u + length[:, None] * step)
            failed = running & (trial > current + 1e-4 * length * decrease)
            if not failed.any():
                break
            length = torch.where(failed, length / 2, length)
            stuck = failed & (length < 1e-12)
            running &= ~stuck
            length = torch.where(stuck, 0.0, length)
        u = u + length[:, None] * step
        progress = current - problem.objective(mass, u)
        running &= progress > 1e-15 * current  # no further progress possible
    return u, iterations


def _cvxpy(problem: MassProblem, mass: np.ndarray, active: np.ndarray) -> np.ndarray:
    """One checkpoint's optimum by cvxpy; ``mass`` (pairs,), ``active`` (size,)."""
    import cvxpy as cp
    import scipy.sparse as sparse

    rows, cols = problem.rows.numpy(), problem.cols.numpy()
    use = np.flatnonzero((mass > 0) & ((rows < problem.size) | (cols < problem.size)))
    entries, signs, positions = [], [], []
    for units, sign in ((rows[use], 2.0), (cols[use], -2.0)):
        known = units < problem.size
        entries.append(np.flatnonzero(known))
        positions.append(units[known])
        signs.append(np.full(known.sum(), sign))
    exponent = sparse.csr_matrix((np.concatenate(signs), (np.concatenate(entries),
                                                          np.concatenate(positions))),
                                 shape=(use.size, problem.size))
    u = cp.Variable(problem.size)
    objective = cp.sum(cp.exp(exponent @ u + np.log(mass[use])))
    constraints = [u[np.flatnonzero(~active)] == 0] if not active.all() else []
    task = cp.Problem(cp.Minimize(objective), constraints)
    task.solve(solver=cp.CLARABEL)
    if task.status not in ("optimal", "optimal_inaccurate"):
        raise InvalidOptionError(f"cvxpy could not solve the min-mass problem: {task.status}")
    return np.asarray(u.value, dtype=np.float64)


def _active(problem: MassProblem, mass: torch.Tensor) -> torch.Tensor:
    """(B, size) units with weight mass both in and out; the others are dead."""
    n = problem.size + 1
    incoming = torch.zeros(mass.shape[0], n, dtype=torch.float64).index_add_(1, problem.rows,
                                                                            mass)
    outgoing = torch.zeros(mass.shape[0], n, dtype=torch.float64).index_add_(1, problem.cols,
                                                                            mass)
    return ((incoming > 0) & (outgoing > 0))[:, :-1]


@public
def solve_min_mass_batch(states: Mapping[str, torch.Tensor], structure: SymmetryStructure,
                         solver: str = "fast", problem: MassProblem | None = None
                         ) -> MinMassBatch:
    """Scale a batch ``{key: (B, *shape)}`` to its minimum mass; see the module docstring.

    ``problem`` (from :func:`mass_problem`) may be passed to reuse it across batches.
    """
    check_choice("solver", solver, MINMASS_SOLVERS)
    if problem is None:
        problem = mass_problem(structure, {key: value[0] for key, value in states.items()})
    mass = problem.pair_mass(states)
    active = _active(problem, mass)
    batch = mass.shape[0]
    if solver == "fast":
        u, iterations = _newton(problem, mass, active)
    else:
        u = torch.as_tensor(np.stack([_cvxpy(problem, mass[b].numpy(), active[b].numpy())
                                      for b in range(batch)])).reshape(batch, problem.size)
        u = u * active
        iterations = torch.zeros(batch, dtype=torch.long)
    scales = {index: torch.exp(u[:, ids]) for index, ids in problem.unknowns.items()}
    scaled = apply_symmetry_batch(states, structure, scales=scales)
    unit_of = {int(i): (index, int(unit)) for index, ids in problem.unknowns.items()
               for unit, i in enumerate(ids)}
    dead = [(b, *unit_of[i]) for b, i in (~active).nonzero().tolist()]

    def total(state: Mapping[str, torch.Tensor]) -> np.ndarray:
        return sum((state[key].double() ** 2).reshape(batch, -1).sum(dim=1)
                   for key in problem.keys).numpy()

    def largest(state: Mapping[str, torch.Tensor]) -> dict[str, np.ndarray]:
        return {key: state[key].abs().reshape(batch, -1).amax(dim=1).double().numpy()
                for key in problem.keys}

    return MinMassBatch(total(states), total(scaled),
                        {index: value.numpy() for index, value in scales.items()},
                        largest(states), largest(scaled), scaled, dead, iterations.numpy())


@public
def solve_min_mass(state: Mapping[str, torch.Tensor], structure: SymmetryStructure,
                   solver: str = "fast") -> MinMassResult:
    """Scale one checkpoint to its minimum mass; see the module docstring."""
    return solve_min_mass_batch({key: value[None] for key, value in state.items()},
                                structure, solver)[0]
