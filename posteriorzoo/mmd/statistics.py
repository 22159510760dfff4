"""The 20 MMD^2 U-statistics of MMDAgg's Laplace + Gaussian collection, with its bandwidths.

Kernels, in MMDAgg's order (Schrab et al. 2023, collection ``laplace_gaussian``):
``number_bandwidths`` Laplace kernels ``k(x, y) = exp(-||x - y||_1 / b)`` with the L1
bandwidths in increasing order, then as many Gaussian kernels
``k(x, y) = exp(-||x - y||_2^2 / b^2)`` with the L2 bandwidths in increasing order.

Bandwidths (MMDAgg's rule, separately for L1 and L2): take the distances between the
first 500 rows of X and the first 500 rows of Y (cross pairs only). If their minimum is
below 0.1, ``b_min`` = max(the 5% quantile, 0.1), where the quantile is the sorted
distances' element at index floor(0.05 * count); else ``b_min`` = the minimum. Then
``b_min /= 2``, ``b_max = 2 * max(largest distance, 0.3)``, and the bandwidths are
``b_min * C**i`` for i = 0 .. number_bandwidths - 1 with ``C = (b_max / b_min) ** (1 /
(number_bandwidths - 1))``.

Statistic (the paper's, PAPER_NOTES section 4), for X of m rows and Y of n rows::

    MMD^2 = sum_{i != j} k(x_i, x_j) / (m (m - 1)) + sum_{i != j} k(y_i, y_j) / (n (n - 1))
            - 2 sum_{i, j} k(x_i, y_j) / (m n)

(``statistic="complete"``, the default). This is what MMDAgg reports when m != n. When
m == n MMDAgg's test uses a wild bootstrap on the paired statistic, which leaves out the
k(x_i, y_i) terms::

    sum_{i != j} [k(x_i, x_j) + k(y_i, y_j) - k(x_i, y_j) - k(x_j, y_i)] / (n (n - 1))

(``statistic="paired"``, needs m == n); MMDAgg's dictionary reports n (n - 1) times it.
"""

# ruff: noqa: N803, N806, N815 -- the paper's and MMDAgg's names: X, Y, K, B1, B2, B3

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import numpy as np

from posteriorzoo._api import public
from posteriorzoo.errors import InvalidOptionError, SampleSizeError, ShapeMismatchError
from posteriorzoo.mmd.distances import (
    DEFAULT_BLOCK_FEATURES,
    DEFAULT_PRECISION,
    Distances,
    pooled_distances,
)
from posteriorzoo.mmd.kernels import default_tasks, kernel_sums
from posteriorzoo.mmd.pair_sums import KernelPairSums

#: Rows of X and of Y whose cross distances set the bandwidths (MMDAgg's ``max_samples``).
BANDWIDTH_ROWS = 500

Statistic = Literal["complete", "paired"]


@public
def kernel_names(number_bandwidths: int = 10) -> tuple[str, ...]:
    """``("laplace", ...) * number_bandwidths + ("gaussian", ...) * number_bandwidths``."""
    return ("laplace",) * number_bandwidths + ("gaussian",) * number_bandwidths


@public
def bandwidth_collection(distances: np.ndarray, number_bandwidths: int = 10) -> np.ndarray:
    """MMDAgg's geometric bandwidths from a set of distances.

    Parameters
    ----------
    distances : array-like, any shape
        Distances (L1, or L2 -- not squared) between the first rows of X and of Y.
    number_bandwidths : int
        How many bandwidths (at least 2).

    Returns
    -------
    ndarray of shape (number_bandwidths,)
        Increasing bandwidths, in the distances' units.
    """
    values = np.asarray(distances, dtype=np.float64).reshape(-1)
    if values.size == 0:
        raise SampleSizeError("no distances to choose bandwidths from")
    smallest = values.min()
    if smallest < 0.1:
        position = int(np.floor(values.size * 0.05))
        quantile = np.partition(values, position)[position]
        lower = max(quantile, 0.1)
    else:
        lower = smallest
    lower = lower / 2
    upper = max(values.max(), 0.3) * 2
    ratio = (upper / lower) ** (1 / (number_bandwidths - 1))
    return np.array([ratio ** i * lower for i in range(number_bandwidths)])


@public
def bandwidths_from_distances(distances: Distances, number_bandwidths: int = 10
                              ) -> tuple[np.ndarray, np.ndarray]:
    """The L1 and L2 bandwidths of MMDAgg's rule from pooled distance matrices.

    Returns
    -------
    (ndarray (number_bandwidths,), ndarray (number_bandwidths,))
        Laplace (L1) and Gaussian (L2) bandwidths, increasing.
    """
    rows_x = min(distances.m, BANDWIDTH_ROWS)
    rows_y = min(distances.n, BANDWIDTH_ROWS)
    cross_l1 = distances.xy[0][:rows_x, :rows_y]
    cross_l2 = np.sqrt(distances.xy[1][:rows_x, :rows_y])
    return (bandwidth_collection(cross_l1, number_bandwidths),
            bandwidth_collection(cross_l2, number_bandwidths))


@dataclass
class KernelMMDs:
    """The MMD^2 estimates of one comparison under every kernel of the collection.

    Attributes
    ----------
    values : ndarray of shape (2 * number_bandwidths,)
        MMD^2 U-statistics (unitless; may be negative), Laplace kernels first.
    bandwidths : ndarray of shape (2 * number_bandwidths,)
        Each kernel's bandwidth (L1 units for Laplace, L2 units for Gaussian).
    kernels : tuple of str
        ``"laplace"`` or ``"gaussian"`` for each entry.
    m, n : int
        Sample sizes of X and Y.
    statistic : str
        ``"complete"`` or ``"paired"`` (see the module notes).
    """

    values: np.ndarray
    bandwidths: np.ndarray
    kernels: tuple[str, ...]
    m: int
    n: int
    statistic: str = "complete"
    sums: dict[str, np.ndarray] = field(default_factory=dict, repr=False)

    @property
    def median(self) -> float:
        return float(np.median(self.values))

    @property
    def mean(self) -> float:
        return float(np.mean(self.values))

    @property
    def max(self) -> float:
        return float(np.max(self.values))


def _check_statistic(statistic: str, m: int, n: int) -> None:
    if statistic not in ("complete", "paired"):
        raise InvalidOptionError(
            f"statistic must be 'complete' or 'paired', not {statistic!r}")
    if statistic == "paired" and m != n:
        raise InvalidOptionError(
            f"the paired statistic needs equal sample sizes; got m={m}, n={n}")


def check_number_bandwidths(number_bandwidths: int) -> None:
    """Raise :class:`InvalidOptionError` unless ``number_bandwidths`` is an integer >= 2."""
    if int(number_bandwidths) != number_bandwidths or number_bandwidths < 2:
        raise InvalidOptionError(
            f"number_bandwidths must be an integer >= 2, not {number_bandwidths!r}")


@public
def kernel_mmds_from_distances(distances: Distances, number_bandwidths: int = 10,
                               statistic: Statistic = "complete", *,
                               x_pairs: KernelPairSums | None = None,
                               z_pairs: KernelPairSums | None = None) -> KernelMMDs:
    """The collection's MMD^2 statistics from precomputed pooled distances.

    Parameters
    ----------
    distances : Distances
        Pooled L1 and squared-L2 matrices of Z = [X; Y] (see :func:`pooled_distances`).
    number_bandwidths : int
        Bandwidths per kernel family (MMDAgg's default 10: 20 kernels).
    statistic : {"complete", "paired"}
        See the module notes.
    x_pairs : KernelPairSums, optional
        The kernel sums over X's pairs for any bandwidth (a target compared with many
        samples): ``distances.xx`` is then not read.
    z_pairs : KernelPairSums, optional
        The kernel sums over all pairs of Z = [X; Y] (a split of one sample, as the
        noise floor's): X's sum is that less the X-Y and Y-Y sums, and ``distances.xx``
        is not read. Either gives the statistics of the direct sums to rounding (about
        1e-15 of the kernel sums; :mod:`posteriorzoo.mmd.pair_sums`).

    Returns
    -------
    KernelMMDs
    """
    check_number_bandwidths(number_bandwidths)
    m, n = distances.m, distances.n
    if m < 2 or n < 2:
        raise SampleSizeError(
            f"got {m} and {n} samples; the unbiased MMD needs at least 2 per sample")
    _check_statistic(statistic, m, n)
    if x_pairs is not None and z_pairs is not None:
        raise InvalidOptionError("give x_pairs or z_pairs, not both")
    pairs = x_pairs if x_pairs is not None else z_pairs
    expected = (m + n) * (m + n - 1) // 2 if z_pairs is not None else m * (m - 1) // 2
    if pairs is not None and pairs.count != expected:
        raise ShapeMismatchError(f"the precomputed pair sums cover {pairs.count} pairs, "
                                 f"not the {expected} of {'Z' if z_pairs is not None else 'X'}")
    bw_l1, bw_l2 = bandwidths_from_distances(distances, number_bandwidths)
    inv_l1, inv_l2sq = 1.0 / bw_l1, 1.0 / bw_l2 ** 2
    totals = kernel_sums(*distances.xx, *distances.xy, *distances.yy, inv_l1, inv_l2sq,
                         default_tasks(m + n), pairs is None)
    if x_pairs is not None:
        totals[0] = x_pairs.sums(inv_l1, inv_l2sq)
    elif z_pairs is not None:
        totals[0] = z_pairs.sums(inv_l1, inv_l2sq) - totals[1] - totals[2]
    xx, xy, yy, diagonal = 2 * totals[0], totals[1], 2 * totals[2], totals[3]
    if statistic == "complete":
        values = xx / (m * (m - 1)) + yy / (n * (n - 1)) - 2 * xy / (m * n)
    else:
        values = (xx + yy - 2 * (xy - diagonal)) / (n * (n - 1))
    return KernelMMDs(values=values, bandwidths=np.concatenate([bw_l1, bw_l2]),
                      kernels=kernel_names(number_bandwidths), m=m, n=n,
                      statistic=statistic,
                      sums={"xx": xx, "xy": xy, "yy": yy, "paired_xy": diagonal})


@public
def kernel_mmds(X: np.ndarray, Y: np.ndarray, number_bandwidths: int = 10, *,
                statistic: Statistic = "complete",
                block_features: int = DEFAULT_BLOCK_FEATURES,
                precision: str = DEFAULT_PRECISION, device: str = "cpu") -> KernelMMDs:
    """MMD^2 of X against Y under MMDAgg's 2 x ``number_bandwidths`` kernels.

    Parameters
    ----------
    X : array-like of shape (m, d) or (m, *shape)
        First sample, e.g. the target posterior's weights of one layer (trailing axes are
        flattened). Any float dtype; computation is in float64.
    Y : array-like of shape (n, d) or (n, *shape)
        Second sample, with the same number of features.
    number_bandwidths : int
        Bandwidths per kernel family (default 10: 20 kernels).
    statistic : {"complete", "paired"}
        The U-statistic (see the module notes); "paired" needs m == n.
    block_features : int
        Features per block of the distance pass (does not change the exact result).
    precision : {"exact", "fast"}
        How the distances are computed (see
        :class:`~posteriorzoo.mmd.distances.SharedTargetDistances`); default exact.
    device : str
        ``"cpu"``, or a torch device such as ``"cuda"`` (fast precision only).

    Returns
    -------
    KernelMMDs
        ``values`` (20,) in MMDAgg's order: Laplace bandwidths ascending, then Gaussian.

    Raises
    ------
    SampleSizeError
        Fewer than 2 rows in X or Y.
    ShapeMismatchError
        Different numbers of features, or none.
    NonFiniteWeightsError
        NaN or infinite values.
    """
    check_number_bandwidths(number_bandwidths)
    _check_statistic(statistic, int(np.shape(X)[0]) if np.ndim(X) else 0,
                     int(np.shape(Y)[0]) if np.ndim(Y) else 0)
    return kernel_mmds_from_distances(
        pooled_distances(X, Y, block_features=block_features,
                         precision=precision, device=device), number_bandwidths, statistic)
