"""Kernel sums over fixed pairs from a binned Taylor table (posteriorzoo.mmd.pair_sums),
against exact sums (math.fsum of numpy's exp) and against the direct kernel sums.

Tolerances (issue 30 section 1): every sum here is float64 and is compared with
``F(rate) = sum_p exp(-rate t_p)`` in exact arithmetic on the float64 ``rate`` and
``t_p``; each side's relative error is bounded for any x86-64 CPU:

* :func:`exact_error`: math.fsum of numpy's exp (its argument's product, the exp, the
  correctly rounded sum);
* :func:`direct_error`: the engine's vectorised exp and a sum in any order
  (``exp_sums``, ``kernel_sums``);
* :func:`table_error`: the binned Taylor table, derived there for the values at hand.
  Its worst case is set by the moments' sums, ``gamma(pairs in the bin)``: up to
  1.1e-12 with 61,000 pairs in one bin, where the measured errors are 1.6e-16. In a
  bin whose offsets are exactly 0 or +-1 (the constant case) the moments are exact and
  the bound is 5.4e-15: the table with 13 Taylor terms instead of 15 fails it (by 2.2
  times).

The engine's exp is contracted to FMAs where the CPU has them, its sums vectorised to
the CPU's width, and the table's bins call libm's exp: results may differ in the last
bits between CPUs; the bounds hold on each.
"""

# ruff: noqa: N806 -- X and Y, the samples as the paper names them

from __future__ import annotations

import math

import numpy as np
import pytest
from rounding_bounds import U64, gamma
from test_mmd_statistics import EXP_NUMPY, EXP_OURS, FLUSHED, assert_within

from posteriorzoo.errors import InvalidOptionError, ShapeMismatchError
from posteriorzoo.mmd import kernel_mmds_from_distances, pooled_distances
from posteriorzoo.mmd.pair_sums import NEGLIGIBLE, TERMS, KernelPairSums, PairSums
from posteriorzoo.mmd.statistics import bandwidths_from_distances

#: libm's exp (math.exp in the table's bins): within 1 ulp, 2u of the value.
EXP_LIBM = 2 * U64


def _exact(t: np.ndarray, rates: np.ndarray) -> np.ndarray:
    return np.array([math.fsum(np.exp(-rate * t)) for rate in rates])


def _terms(t: np.ndarray, rates: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``exp(-rate t_p)`` ``(rates, P)`` and ``F`` ``(rates,)``."""
    terms = np.exp(-np.outer(rates, t))
    return terms, terms.sum(1)


def exact_error(t: np.ndarray, rates: np.ndarray) -> np.ndarray:
    """:func:`_exact`'s relative error ``(rates,)``: each ``-rate * t_p`` rounded (``u a_p``
    of the argument ``a_p``, so ``u a_p`` of the term), numpy's exp (EXP_NUMPY), the
    correctly rounded fsum (u)."""
    terms, total = _terms(t, rates)
    arguments = np.outer(rates, t)
    return U64 * (terms * arguments).sum(1) / total + EXP_NUMPY + U64


def direct_error(t: np.ndarray, rates: np.ndarray) -> np.ndarray:
    """The engine's direct sum's relative error (``exp_sums``, or ``kernel_sums`` over
    the same pairs): the argument's product (as in :func:`exact_error`), its exp
    (EXP_OURS; arguments below -708 flushed to 0, FLUSHED each), any order of a
    ``P``-term sum of positive terms (``gamma(P)``)."""
    terms, total = _terms(t, rates)
    arguments = np.outer(rates, t)
    return (U64 * (terms * arguments).sum(1) / total + EXP_OURS + gamma(t.size, U64)
            + t.size * FLUSHED / total)


def table_error(sums: PairSums, t: np.ndarray, rates: np.ndarray) -> np.ndarray:
    """:meth:`PairSums.sums`' relative error ``(rates,)`` on the pairs ``t``, for the
    values at hand (:func:`direct_error` where it sums the pairs directly).

    Pair ``p`` in bin ``b`` (centre ``c``, the same float in both of the table's
    kernels) has ``s_p = (t_p - c) / (w / 2)``, one rounding (``/ (w / 2)`` is exact),
    and ``exp(-rate t_p) = exp(-rate c) exp(x s_p)`` with ``x = -rate w / 2``; let
    ``y = |x s_p| <= 1/2``. Term ``k >= 1`` of the series, ``(x s_p)^k / k!``, is
    off by ``3k u`` (``s_p``'s rounding ``k`` times, its ``k - 1`` products, the
    division by ``k!``, ``x``'s rounding ``k`` times): ``3 u y e^y`` per pair; the
    bin's moments (``n_b``-term sums) ``gamma(n_b) (e^y - 1)``; Horner's 14 steps of a
    product and a sum, ``gamma(28) e^y``; the terms from :data:`TERMS` on,
    ``y^15 / 15! e^y``; all times ``exp(-rate c)``. Where every ``s_p`` of a bin is
    exactly 0 or +-1 its moments are exact (integers over ``k!``, one rounding):
    ``u (y e^y + e^y - 1)`` instead of the first two. Each bin's ``exp(-rate c)``
    (its argument ``u rate c``, libm's exp, the product) multiplies its sum; the sum
    over bins is compensated (3u), and the bins skipped hold under NEGLIGIBLE of it.
    """
    if sums.bins == 0:
        return direct_error(t, rates)
    low, width, bins = sums._low, sums._width, sums.bins
    half = width / 2
    index = np.minimum(((t - low) / width).astype(np.int64), bins - 1)
    centre = low + (index + 0.5) * width
    offset = t - centre
    back = offset - t                               # TwoSum: t - c rounded iff error != 0
    rounded = ((t - (offset - back)) + (-centre - back)) != 0
    s = offset / half
    exact = np.ones(bins, dtype=bool)
    np.logical_and.at(exact, index, ~rounded & np.isin(np.abs(s), (0.0, 1.0)))
    count = np.bincount(index, minlength=bins)
    moments = np.where(exact[index], 0.0, np.array([gamma(int(k), U64) for k in count])[index])
    terms, total = _terms(t, rates)
    error = np.empty(rates.size)
    for r, rate in enumerate(rates):
        y = rate * np.abs(offset)
        ey = np.exp(y)
        series = np.where(exact[index], U64 * (y * ey + ey - 1), 3 * U64 * y * ey)
        per_pair = (moments * (ey - 1) + series + gamma(2 * (TERMS - 1), U64) * ey
                    + y ** TERMS / math.factorial(TERMS) * ey)
        binned = (np.exp(-rate * centre) * per_pair).sum()
        factor = (terms[r] * (U64 * rate * centre + EXP_LIBM + U64)).sum()
        error[r] = (binned + factor) / total[r] + 3 * U64 + 2 * NEGLIGIBLE
    return error


@pytest.mark.parametrize("t", [
    np.abs(1.0 + 0.3 * np.random.default_rng(0).standard_normal(200_000)),   # one bulk
    np.random.default_rng(1).exponential(5.0, 100_000),                      # long tail
    np.concatenate([np.zeros(50), np.random.default_rng(2).uniform(3, 4, 5000)]),
    np.full(1000, 2.5),                                                      # one value
], ids=["bulk", "tail", "zeros-and-far", "constant"])
def test_the_table_gives_every_rate_to_rounding(t):
    rate_max = 2.0 / max(np.quantile(t, 0.05), 0.1)
    sums = PairSums(t, rate_max)
    rates = np.concatenate([np.geomspace(rate_max * 1e-4, rate_max, 25), [rate_max]])
    # table_error plus exact_error, of F (fsum's value within exact_error of it): 4.8e-15
    # to 5.4e-15 (constant), up to 8.6e-14 (tail), 1e-13 (zeros and far), 1.1e-12 (bulk,
    # 61,000 pairs in a bin). Measured at most 2.5e-16: 1/23 of the bound (constant),
    # 1/27 (zeros and far), 1/72 (bulk), 1/450 (tail); host and AVX2.
    expected = _exact(t, rates)
    exact = exact_error(t, rates)
    bound = (table_error(sums, t, rates) + exact) / (1 - exact) * expected
    assert_within(sums.sums(rates), expected, bound, "table")
    assert sums.bins < t.size


def test_rates_far_above_the_spread_sum_the_pairs_directly():
    t = np.random.default_rng(4).uniform(0, 1000, 500)
    sums = PairSums(t, 10.0)            # 10,000 bins for 500 pairs: summed directly
    assert sums.bins == 0
    rates = np.array([1e-3, 0.1, 10.0])
    # direct_error plus exact_error (6.3e-14 to 6.8e-14, gamma(500) most of it);
    # measured 1.9e-16, 1/340 of it (host and AVX2)
    expected = _exact(t, rates)
    exact = exact_error(t, rates)
    bound = (direct_error(t, rates) + exact) / (1 - exact) * expected
    assert_within(sums.sums(rates), expected, bound, "direct")


def test_sums_that_underflow_are_zero_and_no_pairs_sum_to_zero():
    far = PairSums(np.full(10, 1e4), 1.0)
    assert far.sums(np.array([1.0])).tolist() == [0.0]          # exp(-10,000) in float64
    assert PairSums(np.empty(0), 1.0).sums(np.array([0.5])).tolist() == [0.0]


def test_rates_outside_the_table_and_bad_maxima_are_refused():
    sums = PairSums(np.linspace(0, 1, 100), 4.0)
    for rates in ([4.1], [0.0], [-1.0]):
        with pytest.raises(InvalidOptionError, match="rates must lie in"):
            sums.sums(np.array(rates))
    for rate_max in (0.0, -1.0, math.inf, math.nan):
        with pytest.raises(InvalidOptionError, match="rate_max"):
            PairSums(np.ones(3), rate_max)


def _samples(seed: int, m: int, n: int, shift: float = 0.3):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(m, 12)), rng.normal(size=(n, 12)) + shift


def test_the_statistics_with_x_pairs_are_the_direct_ones():
    """A target's pairs tabled once for several samples' bandwidths: each sample's MMD^2
    is the direct computation's to rounding."""
    X = _samples(5, 80, 2)[0]
    samples = [_samples(seed, 2, 30, shift)[1] for seed, shift in ((6, 0.0), (7, 0.5),
                                                                     (8, 2.0))]
    pooled = [pooled_distances(X, Y) for Y in samples]
    smallest = [min(bandwidths_from_distances(d)[family][0] for d in pooled)
                for family in range(2)]
    table = KernelPairSums(*pooled[0].xx, *smallest)
    for distances in pooled:
        direct = kernel_mmds_from_distances(distances)
        tabled = kernel_mmds_from_distances(distances, x_pairs=table)
        # X's pairs 3.6e-13 to 3.8e-13 of their sum apart at most, measured 1/400 of it;
        # X-Y's and Y-Y's: the same bits; the statistics 1/600 of the bound (host, AVX2).
        # A pair left out of the table would move a statistic by 1e-4 or more.
        bounds, bound = x_pairs_bound(table, distances, direct)
        for key, sums_bound in bounds.items():
            assert_within(tabled.sums[key], direct.sums[key], sums_bound, key)
        assert_within(tabled.values, direct.values, bound, "MMD^2")


def x_pairs_bound(table: KernelPairSums, distances, direct
                  ) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """How far ``kernel_mmds_from_distances(distances, x_pairs=table)`` may lie from the
    direct ``direct`` (its sums ``xx, xy, yy`` and its statistics): X's pairs by
    :func:`pair_sums_bound` (``sums["xx"]`` counts each pair twice); X-Y's and Y-Y's
    from ``kernel_sums`` both times, in any order of their ``m n`` and ``n (n - 1) / 2``
    terms (and their exps' vector lanes); the statistic: those with its weights, plus
    both sides' last four operations (u of the terms each)."""
    m, n = distances.m, distances.n
    bounds = {"xx": 2 * pair_sums_bound(table, distances.xx, distances, direct.sums["xx"] / 2)}
    for key, count in (("xy", m * n), ("yy", n * (n - 1) // 2)):
        bounds[key] = 2 * (gamma(count, U64) + EXP_OURS) * direct.sums[key]
    return bounds, statistic(bounds, m, n) + 8 * U64 * statistic(direct.sums, m, n)


def statistic(sums: dict[str, np.ndarray], m: int, n: int) -> np.ndarray:
    """The complete statistic's combination of (non-negative) sums ``xx, xy, yy``, each
    with its weight's absolute value: the sum of the terms' absolute values, or of
    their bounds."""
    return sums["xx"] / (m * (m - 1)) + sums["yy"] / (n * (n - 1)) + 2 * sums["xy"] / (m * n)


def pair_sums_bound(table: KernelPairSums, pairs: tuple[np.ndarray, np.ndarray], distances,
                    sums: np.ndarray) -> np.ndarray:
    """How far a table's kernel sums over ``pairs`` (L1, squared L2) lie from
    ``kernel_sums``' direct ones ``sums`` ``(20,)``, at the bandwidths of ``distances``:
    :func:`table_error` plus :func:`direct_error`, of the sums."""
    bw_l1, bw_l2 = bandwidths_from_distances(distances)
    rates = (1 / bw_l1, 1 / bw_l2 ** 2)
    relative = np.concatenate([table_error(part, t, rate) + direct_error(t, rate)
                               for part, t, rate in zip((table.l1, table.l2sq), pairs, rates,
                                                        strict=True)])
    return relative * sums / (1 - relative)    # sums within direct_error of exact


def test_the_statistics_with_z_pairs_are_the_direct_ones():
    """A split of one sample: X's sum is all pairs' less X-Y and Y-Y."""
    X, Y = _samples(9, 50, 20, shift=0.0)
    distances = pooled_distances(X, Y)
    l1, l2sq = distances.pooled()
    upper = np.triu_indices(70, 1)
    widths = bandwidths_from_distances(distances)
    table = KernelPairSums(l1[upper], l2sq[upper], widths[0], widths[1])
    direct = kernel_mmds_from_distances(distances)
    tabled = kernel_mmds_from_distances(distances, z_pairs=table)
    # X's sum is Z's (the table) less X-Y's and Y-Y's (kernel_sums): the table's error
    # of Z's sum, the two subtractions (u of it each), and the X-Y and Y-Y sums' and
    # the direct X-X sum's errors, which direct_error over Z's pairs covers together
    # (each a part of Z's sum, of at most its pairs): (table + direct + 2u) of Z's sum,
    # 5.5e-13 to 7.1e-13 of X's. Measured 1/900 of it (host and AVX2).
    m, n = 50, 20
    z_sum = (direct.sums["xx"] + direct.sums["yy"]) / 2 + direct.sums["xy"]
    pairs = (l1[upper], l2sq[upper])
    z_error = pair_sums_bound(table, pairs, distances, z_sum) + 2 * U64 * z_sum
    assert_within(tabled.sums["xx"], direct.sums["xx"], 2 * z_error, "xx")
    # The statistic: X's sums apart by z_error (twice, as above); X-Y's and Y-Y's
    # direct errors (within direct_error of Z's sum, z_direct) enter each side's X
    # term and their own: at most three times z_direct at the largest of the weights;
    # plus both sides' last four operations. Measured 1/14,000 of it (host and AVX2).
    z_direct = np.concatenate([direct_error(t, rate) for t, rate in
                               zip(pairs, (1 / widths[0], 1 / widths[1] ** 2), strict=True)])
    weight = max(1 / (m * (m - 1)), 1 / (n * (n - 1)), 2 / (m * n))
    bound = (2 * z_error / (m * (m - 1)) + 3 * weight * 2 * z_direct * z_sum
             + 8 * U64 * statistic(direct.sums, m, n))
    assert_within(tabled.values, direct.values, bound, "MMD^2")
    with pytest.raises(InvalidOptionError, match="not both"):
        kernel_mmds_from_distances(distances, x_pairs=table, z_pairs=table)
    with pytest.raises(ShapeMismatchError, match="2415 pairs, not the 1225 of X"):
        kernel_mmds_from_distances(distances, x_pairs=table)
