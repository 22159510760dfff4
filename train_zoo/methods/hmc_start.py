"""Where a full-batch HMC chain starts, and its mass matrix.

**The start.** A network trained on augmented minibatches and stopped early lies far
above the posterior's typical set: the reference recipe's base network sits at
``U = 42,837``, and its identity-mass chain from there still fell by about 100 per
iteration after 29 iterations (``U = 30,124``, about 20,000 full-data gradients). With
``start = "map"`` the chain starts instead at the posterior mode nearest the network:
full-batch L-BFGS on ``U`` (:func:`map_start`). From a mode the typical set is about
``d / 2`` higher (the Gaussian approximation's energy), so burn-in adapts the step size at
the posterior's own scale instead of descending. The search must converge: the reference
target's checkpoint 0 reached its mode (U = 30,211, scipy's relative-reduction test) after
6,500 evaluations; a chain started 2,000 iterations in (U = 31,562, largest gradient
component 228) still drifted down by about 1 per iteration after 270 iterations.

**The mass matrix.** Leapfrog with a diagonal mass matrix ``M = diag(m)`` on ``theta`` is
leapfrog with the identity on ``z = theta / s``, ``s = 1 / sqrt(m)``: the potential
``U_z(z) = U(s * z)`` has the gradient ``s * grad U(s * z)``, and the change of variables
is linear, so the Metropolis test and the stationary distribution are unchanged
(:func:`preconditioned`; the sampler itself keeps its identity mass). With
``mass = "laplace-diag"``, ``m`` is the diagonal Laplace precision at the start: the
diagonal GGN over the whole training set plus the prior precision
(:func:`~train_zoo.methods.laplace_curvature.diag_ggn`). On the reference recipe its
``s`` spans 0.0017 to 0.235 (the prior's sd is 0.289), a ratio of 140: with the identity
the step size is set by the stiffest directions and the loosest ones need hundreds of
steps to move one sd. Under this ``M`` every direction the prior alone constrains has
``m = lambda``, so the prior's own dynamics have period ``2 pi``: Izmailov et al.'s
trajectory, a quarter period of the prior's dynamics, is ``pi / 2``
(:func:`train_zoo.methods.hmc.default_trajectory_length`).

:func:`chain_start` saves both in the mode's progress folder, keyed by what they were
computed from, so a resumed chain starts from the same point with the same ``s``.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from train_zoo.methods.hmc_sampler import STATE_VERSION, Potential, save_arrays

__all__ = ["MAP_LINE_SEARCH", "chain_start", "map_start", "preconditioned"]

#: Potential evaluations of one L-BFGS line search at most (scipy's ``maxls``): the
#: search checks its budget between iterations, so it may end this many past it.
MAP_LINE_SEARCH = 20


def map_start(potential: Potential, theta: np.ndarray, iterations: int
              ) -> tuple[np.ndarray, dict[str, Any]]:
    """The posterior mode nearest ``theta``: full-batch L-BFGS (scipy's L-BFGS-B) on the
    potential from ``theta``, at most ``iterations`` iterations and as many potential
    evaluations (plus at most one line search, :data:`MAP_LINE_SEARCH`, and two more: the
    potential before and after); and what the search did (potentials before and after,
    iterations, evaluations, the largest gradient component left, scipy's message). Never
    a point above ``theta``'s potential."""
    from scipy.optimize import minimize

    before, _ = potential(theta)
    found = minimize(potential, theta, jac=True, method="L-BFGS-B",
                     options={"maxiter": iterations, "maxfun": iterations,
                              "maxls": MAP_LINE_SEARCH})
    after, grad = potential(found.x)
    better = after <= before
    search = {"potential_start": float(before), "potential_map": float(min(after, before)),
              "iterations": int(found.nit), "evaluations": int(found.nfev) + 2,
              "largest_gradient": float(np.abs(grad).max()) if better else None,
              "message": str(found.message)}
    return np.asarray(found.x if better else theta, dtype=np.float64), search


def preconditioned(potential: Potential, scales: np.ndarray) -> Potential:
    """``U_z(z) = U(scales * z)`` and its gradient ``scales * grad U``: identity-mass
    leapfrog on ``z`` is leapfrog with the mass ``diag(1 / scales^2)`` on ``theta``."""
    scales = np.asarray(scales, dtype=np.float64)

    def potential_z(z: np.ndarray) -> tuple[float, np.ndarray]:
        value, grad = potential(scales * z)
        return value, scales * grad

    return potential_z


def chain_start(potential: Potential, theta: np.ndarray, *, map_iterations: int | None,
                precision: Callable[[np.ndarray], np.ndarray] | None,
                path: str | Path | None = None, key: str = ""
                ) -> tuple[np.ndarray, np.ndarray | None, dict[str, Any]]:
    """The chain's start and the scales ``s`` of its mass matrix (None: the identity).

    Parameters
    ----------
    potential : Potential
        ``U`` on ``theta``.
    theta : float64 array
        The trained network.
    map_iterations : int or None
        Search the nearest mode with at most this many L-BFGS iterations
        (:func:`map_start`), or start at ``theta`` (None).
    precision : callable or None
        ``precision(start)``: the diagonal of the mass matrix at the start (positive and
        finite); ``s = 1 / sqrt(precision)``. None: the identity.
    path : path-like, optional
        Where the result is saved (atomically), and read back without computing when it
        holds ``key``.
    key : str
        What the result is computed from (problem, options, ``theta``'s digest).

    Returns
    -------
    start, scales, info
        ``info``: the search's summary (or None) and the scales' summary (or None).
    """
    if path is not None and Path(path).exists():
        try:
            with np.load(path, allow_pickle=False) as stored:
                meta = json.loads(str(stored["meta"]))
                if meta.get("key") == key and meta.get("version") == STATE_VERSION:
                    scales = stored["scales"].copy() if meta["info"]["mass"] else None
                    return stored["theta"].copy(), scales, meta["info"]
        except (ValueError, KeyError, OSError):
            pass
    start, search = (map_start(potential, theta, map_iterations) if map_iterations
                     else (np.asarray(theta, dtype=np.float64), None))
    scales, mass = None, None
    if precision is not None:
        diagonal = np.asarray(precision(start), dtype=np.float64)
        if diagonal.shape != start.shape or not (np.isfinite(diagonal).all()
                                                 and (diagonal > 0).all()):
            raise ValueError("the mass matrix's diagonal must be positive and finite, one "
                             "entry per weight")
        scales = 1.0 / np.sqrt(diagonal)
        mass = {"scales": {"min": float(scales.min()), "median": float(np.median(scales)),
                           "max": float(scales.max())},
                "condition": float(scales.max() / scales.min()) ** 2}
    info = {"map_search": search, "mass": mass}
    if path is not None:
        save_arrays(path, {"theta": start,
                           "scales": scales if scales is not None else np.empty(0)},
                    {"version": STATE_VERSION, "key": key, "info": info})
    return start, scales, info

