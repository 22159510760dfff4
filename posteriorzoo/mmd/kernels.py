"""Kernel evaluations on distance matrices (numba): sums for MMD^2, matrices for tests.

The 20 kernels of MMDAgg's ``laplace_gaussian`` collection are functions of the two
distance matrices: Laplace ``exp(-l1 / b)`` and Gaussian ``exp(-l2sq / b^2)``. Each is
evaluated from the matrices computed once by :mod:`posteriorzoo.mmd.distances`; nothing
here touches the data again.

``exp`` is evaluated by :func:`_scaled_exp`, a branch-free version (range reduction
by ln 2 in two parts, a degree-13 Taylor polynomial in fused multiply-adds, the power of
two built from its bits), scaled by the rate in the same pass, that the compiler
vectorises; its relative error is within a few units in the last place of float64
(checked against numpy in the tests). Arguments below -708 give 0.
"""

# ruff: noqa: N803, N806, N815 -- the paper's and MMDAgg's names: X, Y, K, B1, B2, B3

from __future__ import annotations

import numba
import numpy as np
from llvmlite import ir
from numba import prange, types, uint64
from numba.extending import intrinsic

from posteriorzoo._numba import announce_compilation

announce_compilation()

_LOG2E = 1.4426950408889634
# ln 2 split in two: _LN2_HI has trailing zero bits, so k * _LN2_HI is exact for |k| < 2^11.
_LN2_HI = 6.93147180369123816490e-01
_LN2_LO = 1.90821492927058770002e-10
_SMALLEST = -708.0
#: Fused multiply-adds only (no reassociation): the exp's polynomial in half the
#: instructions, as accurate.
_FMA = {"contract"}


@numba.njit(inline="always")
def packed_offset(i, rows):  # pragma: no cover - compiled
    """Start of row i's pairs in packed upper-triangle storage (as in ``distances``; kept
    here too because numba's cache of this module does not see changes to that one)."""
    return i * (2 * rows - i - 1) // 2


@intrinsic
def _float64_from_bits(typingctx, bits):  # pragma: no cover - compiled
    """The float64 whose IEEE-754 bit pattern is the int64 ``bits``."""
    signature = types.float64(types.int64)

    def codegen(context, builder, sig, args):
        return builder.bitcast(args[0], ir.DoubleType())

    return signature, codegen


@numba.njit(inline="always")
def _scaled_exp(source, start, count, factor, out, offset):  # pragma: no cover - compiled
    """out[offset + j] = exp(source[start + j] * factor) for j < count, for products <= 0,
    in one pass the compiler vectorises (callers compile it with fused multiply-adds)."""
    values = source[start:]
    target = out[offset:]
    for j in range(uint64(count)):
        x = values[j] * factor
        xc = max(x, _SMALLEST)
        k = np.floor(xc * _LOG2E + 0.5)
        r = (xc - k * _LN2_HI) - k * _LN2_LO
        p = 1.0 / 6227020800.0
        p = p * r + 1.0 / 479001600.0
        p = p * r + 1.0 / 39916800.0
        p = p * r + 1.0 / 3628800.0
        p = p * r + 1.0 / 362880.0
        p = p * r + 1.0 / 40320.0
        p = p * r + 1.0 / 5040.0
        p = p * r + 1.0 / 720.0
        p = p * r + 1.0 / 120.0
        p = p * r + 1.0 / 24.0
        p = p * r + 1.0 / 6.0
        p = p * r + 0.5
        p = p * r + 1.0
        p = p * r + 1.0
        power = _float64_from_bits((np.int64(k) + 1023) << 52)
        target[j] = p * power if x >= _SMALLEST else 0.0


@numba.njit(cache=True, fastmath=_FMA)
def exp_nonpositive(t):  # pragma: no cover - compiled
    """exp of a 1-D float64 array of values <= 0 with the vectorised routine (for tests)."""
    count = t.shape[0]
    out = np.empty(count)
    _scaled_exp(np.ascontiguousarray(t), 0, count, 1.0, out, 0)
    return out


@numba.njit(parallel=True, cache=True, nogil=True, fastmath=_FMA)
def exp_sums(t, rates):  # pragma: no cover - compiled
    """``out[r] = sum_p exp(-rates[r] * t[p])`` for t >= 0, rates > 0, with the vectorised
    exp; float64 ``(len(rates),)``."""
    count = t.shape[0]
    out = np.zeros(rates.shape[0])
    for r in prange(rates.shape[0]):
        values = np.empty(count)
        _scaled_exp(t, 0, count, -rates[r], values, 0)
        out[r] = _segment_sum(values, 0, count)
    return out


@numba.njit(cache=True, fastmath={"reassoc", "nsz"})
def _segment_sum(values, start, stop):  # pragma: no cover - compiled
    """Sum of values[start:stop]; reassociation lets it vectorise (the order is fixed by
    the code, so the result is still the same on every run)."""
    total = 0.0
    for j in range(uint64(start), uint64(stop)):
        total += values[j]
    return total


@numba.njit(parallel=True, cache=True, nogil=True, fastmath=_FMA)
def kernel_sums(xx1, xx2, xy1, xy2, yy1, yy2, inv_l1, inv_l2sq, tasks,
                with_xx=True):  # pragma: no cover
    """Sums of every kernel over the blocks of the pooled sample Z = [X; Y].

    Parameters
    ----------
    xx1, xx2 : float64 arrays (m (m - 1) / 2,)
        L1 and squared-L2 distances within X, pairs i < j packed row by row.
    xy1, xy2 : float64 arrays (m, n)
        Distances between X's row i and Y's row j.
    yy1, yy2 : float64 arrays (n (n - 1) / 2,)
        Distances within Y, packed likewise.
    inv_l1 : float64 array (L1,)
        1 / b for the Laplace kernels.
    inv_l2sq : float64 array (L2,)
        1 / b^2 for the Gaussian kernels.
    tasks : int
        Parallel tasks (the result does not depend on it: each row's sums are stored and
        added up in row order at the end).
    with_xx : bool
        False: skip the X-X pairs (their sum is 0; ``xx1``, ``xx2`` are not read), for X's
        pairs summed by :class:`~posteriorzoo.mmd.pair_sums.PairSums`.

    Returns
    -------
    float64 array (4, L1 + L2)
        Per kernel: 0 the X-X sum over pairs i < j, 1 the X-Y sum over all (i, j), 2 the
        Y-Y sum over pairs i < j, 3 the paired terms sum_{i < min(m, n)} k(x_i, y_i).
    """
    m, n = xy1.shape
    count1 = inv_l1.shape[0]
    count = count1 + inv_l2sq.shape[0]
    per_x = np.empty((m, 3, count))
    per_y = np.empty((n, count))
    per_x[:] = 0.0      # touched here, not inside the parallel loop (see distances.zeros)
    per_y[:] = 0.0
    half_x = (m + 1) // 2
    half_y = (n + 1) // 2
    for task in prange(tasks):
        values = np.empty(m + n)
        # Row i of X (paired with row m - 1 - i, for equal work): X-X after i, then X-Y.
        for p in range(task, half_x, tasks):
            for side in range(2):
                i = p if side == 0 else m - 1 - p
                if side == 1 and i == p:
                    continue
                after = m - i - 1 if with_xx else 0
                first = packed_offset(i, m)
                for kernel in range(count):
                    if kernel < count1:
                        factor = -inv_l1[kernel]
                        _scaled_exp(xx1, first, after, factor, values, 0)
                        _scaled_exp(xy1[i], 0, n, factor, values, after)
                    else:
                        factor = -inv_l2sq[kernel - count1]
                        _scaled_exp(xx2, first, after, factor, values, 0)
                        _scaled_exp(xy2[i], 0, n, factor, values, after)
                    per_x[i, 0, kernel] = _segment_sum(values, 0, after)
                    per_x[i, 1, kernel] = _segment_sum(values, after, after + n)
                    per_x[i, 2, kernel] = values[after + i] if i < n else 0.0
        for p in range(task, half_y, tasks):
            for side in range(2):
                i = p if side == 0 else n - 1 - p
                if side == 1 and i == p:
                    continue
                after = n - i - 1
                first = packed_offset(i, n)
                for kernel in range(count):
                    if kernel < count1:
                        _scaled_exp(yy1, first, after, -inv_l1[kernel], values, 0)
                    else:
                        _scaled_exp(yy2, first, after, -inv_l2sq[kernel - count1], values, 0)
                    per_y[i, kernel] = _segment_sum(values, 0, after)
    totals = np.zeros((4, count))
    for i in range(m):
        for kernel in range(count):
            totals[0, kernel] += per_x[i, 0, kernel]
            totals[1, kernel] += per_x[i, 1, kernel]
            totals[3, kernel] += per_x[i, 2, kernel]
    for i in range(n):
        for kernel in range(count):
            totals[2, kernel] += per_y[i, kernel]
    return totals


@numba.njit(parallel=True, cache=True, nogil=True, fastmath=_FMA)
def kernel_matrices(l1, l2sq, inv_l1, inv_l2sq, first, out, tasks):  # pragma: no cover
    """Fill ``out[i, j, c]`` with kernel first + c on the pooled distances, zero diagonal.

    ``l1``, ``l2sq``: full (N, N) matrices. Kernels are numbered as in
    :func:`kernel_sums` (Laplace first). ``out`` is a float64 array (N, N, count): the
    kernel axis is contiguous, as the permutation sums read it.
    """
    rows = l1.shape[0]
    count1 = inv_l1.shape[0]
    count = out.shape[2]
    for task in prange(tasks):
        values = np.empty(rows)
        for i in range(task, rows, tasks):
            for c in range(count):
                kernel = first + c
                if kernel < count1:
                    source = l1[i]
                    factor = -inv_l1[kernel]
                else:
                    source = l2sq[i]
                    factor = -inv_l2sq[kernel - count1]
                _scaled_exp(source, 0, rows, factor, values, 0)
                values[i] = 0.0
                for j in range(rows):
                    out[i, j, c] = values[j]


@numba.njit(parallel=True, cache=True, nogil=True)
def group_sums(K, groups, row_sums):  # pragma: no cover - compiled
    """For each arrangement b: the within-group kernel sum and the group's row sums.

    Parameters
    ----------
    K : float64 array (N, N, C)
        Kernel matrices, zero diagonal.
    groups : int64 array (B, s)
        Row indices of one group of each arrangement (sorted per row for locality).
    row_sums : float64 array (N, C)
        ``sum_j K[i, j, c]``.

    Returns
    -------
    within : float64 array (B, C)
        ``sum_{a < b} K[g_a, g_b, c]`` (each unordered pair once).
    touching : float64 array (B, C)
        ``sum_a row_sums[g_a, c]``.
    """
    arrangements, size = groups.shape
    count = K.shape[2]
    within = np.zeros((arrangements, count))
    touching = np.zeros((arrangements, count))
    for b in prange(arrangements):
        acc = np.zeros(count)
        rows = np.zeros(count)
        for a in range(size):
            ga = groups[b, a]
            row = K[ga]
            for c in range(count):
                rows[c] += row_sums[ga, c]
            for a2 in range(a + 1, size):
                values = row[groups[b, a2]]
                for c in range(count):
                    acc[c] += values[c]
        within[b] = acc
        touching[b] = rows
    return within, touching


def default_tasks(rows: int) -> int:
    """Number of parallel tasks for a loop over ``rows`` rows (results never depend on it)."""
    return int(max(1, min(numba.get_num_threads() * 4, rows)))
