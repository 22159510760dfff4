"""MMDAgg: the aggregated two-sample test over the collection of 20 kernels.

The test (Schrab et al. 2023) as the paper uses it, with uniform weights:

1. For every kernel, the MMD^2 statistic of the observed samples and of B1 + B2
   resampled ones: random permutations of the pooled sample when m != n (the complete
   U-statistic), a wild bootstrap (random signs on the paired statistic) when m == n.
   All kernels are evaluated from the two distance matrices computed once; a resample
   changes only which rows are summed (permutations: the sums over the smaller group
   are gathered from the kernel matrices; wild bootstrap: one matrix product per kernel).
2. Quantiles come from the B1 resampled statistics plus the observed one; the B2 others
   calibrate the level: a bisection (B3 steps) finds the largest u such that the
   probability, under the resampling, that some kernel exceeds its (1 - u w)-quantile is
   at most alpha (w = 1 / 20 for every kernel).
3. The test rejects if some kernel's statistic exceeds its quantile at that u; equivalently
   if some p-value (the share of the B1 + 1 statistics at least as large as the observed
   one) is at most u w.

The same inputs and seed give the same numbers (``numpy.random.default_rng(seed)``).
"""

# ruff: noqa: N803, N806, N815 -- the paper's and MMDAgg's names: X, Y, K, B1, B2, B3

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from posteriorzoo._api import public
from posteriorzoo.errors import InvalidOptionError, SampleSizeError
from posteriorzoo.mmd.distances import (
    DEFAULT_BLOCK_FEATURES,
    DEFAULT_PRECISION,
    Distances,
    pooled_distances,
    zeros,
)
from posteriorzoo.mmd.kernels import default_tasks, group_sums, kernel_matrices
from posteriorzoo.mmd.statistics import (
    bandwidths_from_distances,
    check_number_bandwidths,
    kernel_names,
)
from posteriorzoo.options import check_integer, check_number

#: Upper bound on the bytes of kernel matrices held at once (they are built in groups).
KERNEL_MATRIX_BYTES = 1 << 28


@dataclass
class MMDAggResult:
    """Outcome of :func:`mmdagg`.

    Attributes
    ----------
    reject : bool
        Whether the aggregated test rejects "X and Y come from the same distribution".
    kernels : tuple of str
        ``"laplace"`` / ``"gaussian"`` for each of the 2 x number_bandwidths kernels.
    bandwidths : ndarray (K,)
        Each kernel's bandwidth.
    statistics : ndarray (K,)
        Observed MMD^2 per kernel: the complete U-statistic (permutations) or the paired
        one (wild bootstrap), both normalised (see :mod:`posteriorzoo.mmd.statistics`).
    quantiles : ndarray (K,)
        Each kernel's (1 - u w)-quantile of the resampled statistics at the corrected u.
    p_values : ndarray (K,)
        Share of the B1 resampled statistics and the observed one that are >= observed.
    thresholds : ndarray (K,)
        u w: kernel k rejects iff its p-value is at most this.
    rejects : ndarray of bool (K,)
        Each single test's decision (statistic > quantile).
    u : float
        The level-correcting factor found by bisection.
    approximation : str
        ``"permutations"`` or ``"wild bootstrap"``.
    alpha, B1, B2, B3, seed, m, n :
        The inputs.
    """

    reject: bool
    kernels: tuple[str, ...]
    bandwidths: np.ndarray
    statistics: np.ndarray
    quantiles: np.ndarray
    p_values: np.ndarray
    thresholds: np.ndarray
    rejects: np.ndarray
    u: float
    approximation: str
    alpha: float
    B1: int
    B2: int
    B3: int
    seed: int
    m: int
    n: int

    def to_dict(self) -> dict[str, Any]:
        """A JSON-serialisable summary with one entry per kernel."""
        return {
            "reject": bool(self.reject), "u": float(self.u),
            "approximation": self.approximation, "alpha": self.alpha, "B1": self.B1,
            "B2": self.B2, "B3": self.B3, "seed": self.seed, "m": self.m, "n": self.n,
            "kernels": [
                {"kernel": name, "bandwidth": float(self.bandwidths[k]),
                 "mmd2": float(self.statistics[k]), "quantile": float(self.quantiles[k]),
                 "p_value": float(self.p_values[k]), "threshold": float(self.thresholds[k]),
                 "reject": bool(self.rejects[k])}
                for k, name in enumerate(self.kernels)],
        }


def check_test_options(alpha: float, B1: int, B2: int, B3: int, seed: int
                       ) -> None:
    """Raise :class:`InvalidOptionError` unless the test's options are valid."""
    check_number("alpha", alpha, 0, strict=True)
    if alpha >= 1:
        raise InvalidOptionError(f"alpha must be in (0, 1), not {alpha!r}")
    for name, value in (("B1", B1), ("B2", B2), ("B3", B3)):
        check_integer(name, value, 1)
    check_integer("seed", seed, 0)


def _kernel_groups(rows: int, count: int) -> list[tuple[int, int]]:
    per_group = max(1, min(count, KERNEL_MATRIX_BYTES // (8 * rows * rows)))
    return [(first, min(per_group, count - first)) for first in range(0, count, per_group)]


def draw_groups(m: int, n: int, resamples: int, rng: np.random.Generator) -> np.ndarray:
    """Row indices of the smaller sample's group: the observed one, then random ones.

    Returns an int64 array (resamples + 1, min(m, n)): row 0 is Y's rows m..m+n-1 (or X's
    0..m-1 if m < n); each further row is a uniformly random subset of the pooled rows
    (the first min(m, n) entries of a random permutation), sorted.
    """
    rows = m + n
    small = min(m, n)
    order = rng.permuted(np.tile(np.arange(rows, dtype=np.int64), (resamples, 1)), axis=1)
    observed = np.arange(m, rows) if n <= m else np.arange(m)
    return np.vstack([observed[None, :], np.sort(order[:, :small], axis=1)])


def draw_signs(n: int, resamples: int, rng: np.random.Generator) -> np.ndarray:
    """Rademacher signs (n, resamples + 1); column 0 is all +1 (the observed statistic)."""
    signs = np.ones((n, resamples + 1))
    signs[:, 1:] = rng.choice(np.array([-1.0, 1.0]), size=(n, resamples))
    return signs


def permuted_statistics(l1: np.ndarray, l2sq: np.ndarray, inv_l1: np.ndarray,
                        inv_l2sq: np.ndarray, m: int, n: int, groups: np.ndarray
                        ) -> np.ndarray:
    """Complete MMD^2 statistics of rearranged pooled samples.

    Parameters
    ----------
    l1, l2sq : ndarray (m + n, m + n)
        Pooled distance matrices.
    inv_l1, inv_l2sq : ndarray
        1 / b (Laplace) and 1 / b^2 (Gaussian).
    m, n : int
        Group sizes: X gets m rows, Y gets n rows.
    groups : int array (B, min(m, n))
        For each arrangement, the rows forming the smaller group (Y if n <= m, else X).

    Returns
    -------
    ndarray (B, K)
        Per arrangement and kernel. Only sums over the smaller group are gathered from the
        kernel matrices; the rest follows from the row sums and the total.
    """
    rows = m + n
    small_is_y = n <= m
    groups = np.ascontiguousarray(groups, dtype=np.int64)
    count = inv_l1.size + inv_l2sq.size
    out = np.empty((groups.shape[0], count))
    for first, size in _kernel_groups(rows, count):
        K = zeros(rows, rows, size)
        kernel_matrices(l1, l2sq, inv_l1, inv_l2sq, first, K, default_tasks(rows))
        row_sums = K.sum(axis=1)
        total = row_sums.sum(axis=0)
        within, touching = group_sums(K, groups, row_sums)
        del K
        same = 2 * within                      # ordered pairs inside the small group
        cross = touching - same                # pairs between the groups
        other = total - 2 * touching + same    # ordered pairs inside the large group
        xx, yy = (other, same) if small_is_y else (same, other)
        out[:, first:first + size] = (xx / (m * (m - 1)) + yy / (n * (n - 1))
                                      - 2 * cross / (m * n))
    return out


def wild_bootstrap_statistics(l1: np.ndarray, l2sq: np.ndarray, inv_l1: np.ndarray,
                              inv_l2sq: np.ndarray, signs: np.ndarray) -> np.ndarray:
    """Paired MMD^2 statistics ``sum_{i != j} e_i e_j h(i, j) / (n (n - 1))`` per sign vector.

    Parameters
    ----------
    l1, l2sq : ndarray (2n, 2n)
        Pooled distance matrices (X's n rows first).
    signs : ndarray (n, B)
        One column of +-1 per resample.

    Returns
    -------
    ndarray (B, K)
    """
    n = signs.shape[0]
    rows = 2 * n
    count = inv_l1.size + inv_l2sq.size
    out = np.empty((signs.shape[1], count))
    diagonal = np.arange(n)
    for first, size in _kernel_groups(rows, count):
        K = zeros(rows, rows, size)
        kernel_matrices(l1, l2sq, inv_l1, inv_l2sq, first, K, default_tasks(rows))
        for c in range(size):
            kernel = K[:, :, c]
            h = kernel[:n, :n] + kernel[n:, n:] - kernel[:n, n:] - kernel[n:, :n]
            h[diagonal, diagonal] = 0.0
            out[:, first + c] = np.einsum("ib,ib->b", signs, h @ signs) / (n * (n - 1))
        del K
    return out


def _corrected_level(sorted_first: np.ndarray, second: np.ndarray, weights: np.ndarray,
                     alpha: float, B1: int, B3: int) -> tuple[float, np.ndarray]:
    """Bisection on u; returns u and the (1 - u w)-quantiles at it."""

    def quantiles(u: float) -> np.ndarray:
        index = np.ceil((B1 + 1) * (1 - u * weights)).astype(np.int64) - 1
        index = np.clip(index, 0, B1)
        return sorted_first[np.arange(weights.size), index]

    low, high = 0.0, float(np.min(1 / weights))
    for _ in range(B3):
        u = (low + high) / 2
        exceed = np.mean(np.any(second > quantiles(u)[None, :], axis=1))
        if exceed <= alpha:
            low = u
        else:
            high = u
    return low, quantiles(low)


@public
def mmdagg_from_distances(distances: Distances, alpha: float = 0.05, *,
                          number_bandwidths: int = 10, B1: int = 2000,
                          B2: int = 2000, B3: int = 50, seed: int = 0,
                          permutations_same_sample_size: bool = False) -> MMDAggResult:
    """:func:`mmdagg` on precomputed pooled distances (see :func:`pooled_distances`)."""
    check_test_options(alpha, B1, B2, B3, seed)
    check_number_bandwidths(number_bandwidths)
    m, n = distances.m, distances.n
    if m < 2 or n < 2:
        raise SampleSizeError(f"got {m} and {n} samples; MMDAgg needs at least 2 per sample")
    bw_l1, bw_l2 = bandwidths_from_distances(distances, number_bandwidths)
    inv_l1, inv_l2sq = 1.0 / bw_l1, 1.0 / bw_l2 ** 2
    l1, l2sq = distances.pooled()
    rng = np.random.default_rng(int(seed))
    if m == n and not permutations_same_sample_size:
        approximation = "wild bootstrap"
        simulated = wild_bootstrap_statistics(l1, l2sq, inv_l1, inv_l2sq,
                                              draw_signs(n, B1 + B2, rng))
    else:
        approximation = "permutations"
        simulated = permuted_statistics(l1, l2sq, inv_l1, inv_l2sq, m, n,
                                        draw_groups(m, n, B1 + B2, rng))
    observed = simulated[0]
    first = np.vstack([simulated[1:B1 + 1], observed[None, :]])     # (B1 + 1, K)
    second = simulated[B1 + 1:]                                      # (B2, K)
    count = observed.size
    weights = np.full(count, 1.0 / count)
    sorted_first = np.sort(first, axis=0).T                          # (K, B1 + 1)
    u, quantiles = _corrected_level(sorted_first, second, weights, alpha, B1, B3)
    p_values = np.mean(first >= observed[None, :], axis=0)
    rejects = observed > quantiles
    return MMDAggResult(
        reject=bool(rejects.any()), kernels=kernel_names(number_bandwidths),
        bandwidths=np.concatenate([bw_l1, bw_l2]), statistics=observed,
        quantiles=quantiles, p_values=p_values, thresholds=u * weights, rejects=rejects,
        u=float(u), approximation=approximation, alpha=float(alpha), B1=int(B1),
        B2=int(B2), B3=int(B3), seed=int(seed), m=m, n=n)


@public
def mmdagg(X: np.ndarray, Y: np.ndarray, alpha: float = 0.05, *,
           number_bandwidths: int = 10, B1: int = 2000, B2: int = 2000,
           B3: int = 50, seed: int = 0, permutations_same_sample_size: bool = False,
           block_features: int = DEFAULT_BLOCK_FEATURES,
           precision: str = DEFAULT_PRECISION, device: str = "cpu") -> MMDAggResult:
    """The MMDAgg two-sample test of X against Y with uniform weights.

    Parameters
    ----------
    X : array-like of shape (m, d) or (m, *shape)
        First sample (trailing axes are flattened).
    Y : array-like of shape (n, d) or (n, *shape)
        Second sample, same number of features.
    alpha : float
        Level of the test, in (0, 1).
    number_bandwidths : int
        Bandwidths per kernel family (2 x this many kernels).
    B1 : int
        Resampled statistics for the quantiles.
    B2 : int
        Resampled statistics for the level correction.
    B3 : int
        Bisection steps of the level correction.
    seed : int
        Seed of ``numpy.random.default_rng`` for the permutations or signs.
    permutations_same_sample_size : bool
        Use permutations even when m == n (default: wild bootstrap then).
    block_features : int
        Features per block of the distance pass (does not change the exact result).
    precision : {"exact", "fast"}
        How the distances are computed (see
        :class:`~posteriorzoo.mmd.distances.SharedTargetDistances`); default exact.
    device : str
        ``"cpu"``, or a torch device such as ``"cuda"`` (fast precision only).

    Returns
    -------
    MMDAggResult
        The decision, and per kernel the statistic, quantile, p-value and threshold.

    Notes
    -----
    Memory: the two (m + n)^2 distance matrices plus kernel matrices built in groups of at
    most :data:`KERNEL_MATRIX_BYTES`, and (B1 + B2) x min(m, n) resampling indices.
    """
    check_test_options(alpha, B1, B2, B3, seed)
    return mmdagg_from_distances(
        pooled_distances(X, Y, block_features=block_features,
                         precision=precision, device=device), alpha,
        number_bandwidths=number_bandwidths, B1=B1, B2=B2, B3=B3, seed=seed,
        permutations_same_sample_size=permutations_same_sample_size)
