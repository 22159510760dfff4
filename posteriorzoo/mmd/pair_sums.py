"""Kernel sums over one fixed set of pairs, for any bandwidth, without an exp per pair.

Every kernel of MMDAgg's collection is ``exp(-rate * t)`` of one number per pair: the L1
distance with ``rate = 1 / b`` (Laplace), the squared L2 distance with ``rate = 1 / b^2``
(Gaussian). So the kernel sum over a fixed set of P pairs is a function of the rate alone,
``F(rate) = sum_p exp(-rate * t_p)``, and the same pairs are summed again and again with
new bandwidths: the target's own pairs by every method compared with it (each method's
cross distances set its bandwidths), all of the target's pairs by every split of the noise
floor.

:class:`PairSums` reads the pairs once. It sorts them into bins of width ``w`` with
``w * rate_max <= 1`` and keeps, per bin of centre ``c_b``, the moments
``N_bk = sum_p s_p^k / k!`` of ``s_p = (t_p - c_b) / (w / 2)`` in [-1, 1]. Then

    F(rate) = sum_b exp(-rate * c_b) * sum_k (-rate * w / 2)^k N_bk,

where ``|rate * w / 2| <= 1/2``, so :data:`TERMS` = 15 terms leave a relative error below
``e^(1/2) (1/2)^15 / 15! < 4e-17`` in every bin (all terms of F are positive, so the total
keeps that relative error, plus the rounding of the sums, which are compensated: within
1e-15 of ``math.fsum``, tested). A rate costs one exp and :data:`TERMS` multiply-adds per
bin, and the bins past which the rest cannot reach 1e-17 of the total are skipped. Where
there would be fewer than :data:`DIRECT_PAIRS_PER_BIN` pairs per bin (a rate far above
the spread of the distances) the pairs are summed directly.
"""

from __future__ import annotations

import math

import numba
import numpy as np

from posteriorzoo._numba import announce_compilation
from posteriorzoo.errors import InvalidOptionError
from posteriorzoo.mmd.kernels import exp_sums

announce_compilation()

#: Taylor terms per bin.
TERMS = 15
#: Bins skipped once all the pairs left could add less than this share of the total.
NEGLIGIBLE = 1e-17
#: A bin (one scalar exp and a Horner chain of TERMS) costs about as much as this many
#: pairs summed directly (vectorised exp, 2 threads): with fewer pairs per bin the table
#: is not worth making. The shipped target's layers need 3 to 3,102 bins for 499,500 pairs.
DIRECT_PAIRS_PER_BIN = 32


@numba.njit(cache=True, nogil=True)
def _moments(t, low, width, bins, terms):  # pragma: no cover - compiled
    """(bins, terms) scaled moments N_bk and (bins,) pairs in bin b and after it."""
    table = np.zeros((bins, terms))
    half = width / 2
    for p in range(t.shape[0]):
        b = min(int((t[p] - low) / width), bins - 1)
        s = (t[p] - (low + (b + 0.5) * width)) / half
        power = 1.0
        for k in range(terms):
            table[b, k] += power
            power *= s
    factorial = 1.0
    for k in range(1, terms):
        factorial *= k
        for b in range(bins):
            table[b, k] /= factorial
    after = np.zeros(bins)
    total = 0.0
    for b in range(bins - 1, -1, -1):
        total += table[b, 0]
        after[b] = total
    return table, after


@numba.njit(cache=True, nogil=True)
def _transform(table, after, low, width, rates, out):  # pragma: no cover - compiled
    """out[r] = sum_b exp(-rate c_b) * Taylor series of bin b, for each rate."""
    bins, terms = table.shape
    half = width / 2
    for r in range(rates.shape[0]):
        rate = rates[r]
        x = -rate * half
        total = 0.0
        carry = 0.0     # Neumaier's compensation: the bins are many, their sum long
        for b in range(bins):
            if table[b, 0] == 0.0:
                continue
            centre = low + (b + 0.5) * width
            if total > 0.0 and after[b] * math.exp(-rate * (centre - half)) < \
                    NEGLIGIBLE * total:
                break
            poly = table[b, terms - 1]
            for k in range(terms - 2, -1, -1):
                poly = poly * x + table[b, k]
            term = math.exp(-rate * centre) * poly
            added = total + term
            carry += (total - added) + term if total >= term else (term - added) + total
            total = added
        out[r] = total + carry


class PairSums:
    """``sum_p exp(-rate * t_p)`` over fixed pairs, for any rate up to ``rate_max``.

    Parameters
    ----------
    t : array of shape (P,)
        One number per pair, >= 0: L1 distances (Laplace) or squared L2 distances
        (Gaussian). Read once; not kept unless summed directly.
    rate_max : float
        The largest rate :meth:`sums` will be asked for (> 0): ``1 / b`` of the smallest
        Laplace bandwidth, ``1 / b^2`` of the smallest Gaussian one.

    Attributes
    ----------
    count : int
        P.
    bins : int
        Bins of the table (0 when the pairs are summed directly).
    """

    def __init__(self, t: np.ndarray, rate_max: float) -> None:
        t = np.ascontiguousarray(t, dtype=np.float64).reshape(-1)
        if not (math.isfinite(rate_max) and rate_max > 0):
            raise InvalidOptionError(f"rate_max must be finite and > 0, not {rate_max!r}")
        self.count = int(t.size)
        self.rate_max = float(rate_max)
        self._direct: np.ndarray | None = None
        self.bins = 0
        if self.count == 0:
            return
        low, high = float(t.min()), float(t.max())
        self._low, self._width = low, 1.0 / self.rate_max
        spread = (high - low) * self.rate_max
        if spread * DIRECT_PAIRS_PER_BIN >= self.count:   # the pairs themselves are cheaper
            self._direct = t
            return
        self.bins = int(spread) + 1
        self._table, self._after = _moments(t, low, self._width, self.bins, TERMS)

    def sums(self, rates: np.ndarray) -> np.ndarray:
        """``(len(rates),)`` float64: ``sum_p exp(-rate * t_p)`` for each rate in
        ``rates`` (each in (0, rate_max])."""
        rates = np.ascontiguousarray(rates, dtype=np.float64).reshape(-1)
        if rates.size and not (rates.min() > 0 and rates.max() <= self.rate_max * (1 + 1e-12)):
            raise InvalidOptionError(
                f"rates must lie in (0, {self.rate_max:g}], not [{rates.min():g}, "
                f"{rates.max():g}]")
        out = np.zeros(rates.size)
        if self.count == 0:
            return out
        if self._direct is not None:
            return exp_sums(self._direct, rates)
        _transform(self._table, self._after, self._low, self._width, rates, out)
        return out


class KernelPairSums:
    """The sums of both kernel families over one fixed set of pairs (:class:`PairSums` of
    the L1 and of the squared-L2 distances).

    Parameters
    ----------
    l1, l2sq : array of shape (P,)
        The pairs' L1 and squared-L2 distances (packed pairs, as ``Distances.xx``).
    bandwidths_l1, bandwidths_l2 : array-like
        Every bandwidth :meth:`sums` will be asked for, or at least the smallest of each
        family (L1 units; L2 units, not squared).
    """

    def __init__(self, l1: np.ndarray, l2sq: np.ndarray, bandwidths_l1: np.ndarray,
                 bandwidths_l2: np.ndarray) -> None:
        self.l1 = PairSums(l1, 1.0 / float(np.min(bandwidths_l1)))
        self.l2sq = PairSums(l2sq, 1.0 / float(np.min(bandwidths_l2)) ** 2)
        self.count = self.l1.count

    def sums(self, inv_l1: np.ndarray, inv_l2sq: np.ndarray) -> np.ndarray:
        """``(len(inv_l1) + len(inv_l2sq),)``: each Laplace kernel's sum over the pairs
        (rates ``1 / b``), then each Gaussian one's (rates ``1 / b^2``), as
        :func:`~posteriorzoo.mmd.kernels.kernel_sums` orders its kernels."""
        return np.concatenate([self.l1.sums(inv_l1), self.l2sq.sums(inv_l2sq)])
