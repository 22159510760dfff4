"""The MMD engine against an independent, obviously-correct numpy implementation.

The reference below is written from the definitions (PAPER_NOTES section 4), with plain
loops and scipy's cdist: the bandwidth rule, the 20 kernels and the U-statistics.

Tolerances (issue 30 section 1): everything is float64 (``u`` = :data:`U64`), and two
implementations of one statistic differ only by rounding, bounded here for any x86-64
CPU (:func:`bandwidth_error`, :func:`kernel_error`):

* a distance is a sum over the ``d`` features of terms every implementation rounds
  alike (``|x_k - y_k|``, one IEEE subtraction), in any order: ``gamma(d)`` relative,
  ``gamma(d) / 2 + u`` after a square root (:func:`distance_error`);
* a bandwidth ``lower * C**i`` carries its distances' error three times at most (the
  lower end, and the ratio ``C`` through ``upper / lower``) plus ``i + 1`` powers
  (:data:`POW`) and three roundings;
* a kernel ``exp(-a)`` is off by ``a`` times its argument's relative error plus the
  exponential's own (:data:`EXP_OURS` for the engine's vectorised exp, derived below;
  :data:`EXP_NUMPY` for numpy's);
* each side sums at most ``(m + n)**2`` kernel values in some order, with a few more
  operations: ``gamma((m + n)**2)`` of the sum of the absolute terms.

The bounds are worst cases; the measured differences are 10-10,000 times smaller (each
test says by how much). The engine's own results may differ in the last bits between
CPUs (its exp is contracted to FMAs where the CPU has them, its sums are vectorised to
the CPU's width), so engine-against-engine checks that are not the same computation in
one process use the same bounds. The known-answer tests draw their samples from numpy's
Generator (float64 normals: the same bits on every CPU) at fixed seeds, so they are
deterministic checks, with margins far above any rounding.
"""

# ruff: noqa: N803, N806 -- the statistics' names: samples X, Y, Z, kernel matrices K

from __future__ import annotations

import math

import numba
import numpy as np
import pytest
from rounding_bounds import U64, gamma
from scipy.spatial.distance import cdist

from posteriorzoo.errors import (
    InvalidOptionError,
    NonFiniteWeightsError,
    SampleSizeError,
    ShapeMismatchError,
)
from posteriorzoo.mmd import (
    bandwidth_collection,
    kernel_mmds,
    pooled_distances,
    stream_pooled_distances,
)
from posteriorzoo.mmd.distances import unpack
from posteriorzoo.mmd.kernels import exp_nonpositive

# ---------------------------------------------------------------- rounding bounds
#: numpy's float64 exp and pow: within 4 ulp (SVML's "la" routines, which numpy uses
#: with AVX-512; libm's, elsewhere, within 1), and an ulp is at most 2u of the value.
EXP_NUMPY = 8 * U64
POW = 8 * U64
#: The engine's exp (``posteriorzoo.mmd.kernels._scaled_exp``): ``p(r) 2**k`` with
#: ``|r| <= ln(2) / 2``. Its 13 Horner steps round twice each without FMA (once with):
#: ``gamma(26)`` of ``sum |c_j r^j| <= e^|r|``, that is ``2 gamma(26)`` of ``e^r``;
#: the rounded coefficients ``1/j!`` add ``u e^|r|`` (2u of ``e^r``), the reduction
#: ``r = (x - k ln2_hi) - k ln2_lo`` two roundings of ``|r|`` (0.7u), the truncated
#: series ``|r|^14 / 14!`` (0.1u) and the product with ``2**k`` one more u.
EXP_OURS = 2 * gamma(26, U64) + 4 * U64
#: An argument below -708 gives 0 in the engine's exp: at most this much per kernel.
FLUSHED = math.exp(-708)


def distance_error(d: int) -> float:
    """One implementation's relative error of an L1, squared-L2 or L2 distance over
    ``d`` features: a ``d``-term sum of non-negative terms (``gamma(d)``), and
    ``gamma(d) / 2 + u`` for its square root."""
    return gamma(d, U64) + U64


def bandwidth_error(bandwidths: np.ndarray, delta: float = 0.0) -> np.ndarray:
    """One side's relative error of each of MMDAgg's bandwidths ``lower * C**i`` (one
    family, increasing), from distances within ``delta`` of exact.

    ``lower`` (a smallest distance or a quantile, halved; ``max(., 0.1)`` is
    1-Lipschitz) and ``upper`` are within ``delta``; ``C = (upper / lower) ** e``
    (``e = 1 / (count - 1)`` rounded: ``u ln(upper / lower)`` of ``e ln(...)``) within
    ``e (2 delta + u + u ln(upper / lower)) + POW``; ``C**i`` within ``i`` times that
    plus ``POW``; the product one more u.
    """
    count = len(bandwidths)
    log_ratio = math.log(bandwidths[-1] / bandwidths[0])
    per_power = (2 * delta + U64 + U64 * log_ratio) / (count - 1) + POW
    return delta + U64 + POW + np.arange(count) * per_power


def cross_distance_error(X: np.ndarray, Y: np.ndarray, count: int = 10) -> np.ndarray:
    """:func:`bandwidth_error` of both families of ``kernel_mmds(X, Y)``'s bandwidths, per
    side, ``(2 * count,)``; checks the branch of the rule (``min < 0.1``) is the same for
    every distance within ``delta`` of exact."""
    delta = distance_error(X.shape[1])
    errors = []
    for metric in ("cityblock", "euclidean"):
        cross = cdist(X[:500], Y[:500], metric)
        assert abs(cross.min() - 0.1) > 2 * delta * cross.min(), "branch within rounding"
        errors.append(bandwidth_error(naive_bandwidths(X, Y, "l1" if metric == "cityblock"
                                                       else "l2", count), delta))
    return np.concatenate(errors)


def kernel_error(K: np.ndarray, A: np.ndarray, weights: np.ndarray, eps_arg, eps_exp
                 ) -> np.ndarray:
    """``sum_ij |w_ij| K_ij (eps_arg a_ij + eps_exp)`` per kernel ``(k,)``: how far a
    weighted sum of the kernel values ``K = exp(-A)`` ``(k, N, N)`` moves when each
    argument is off by ``eps_arg`` ``(k,)`` of itself and each exponential by
    ``eps_exp`` of its value (first order: ``a eps_arg`` < 1e-9 here), plus
    :data:`FLUSHED` for each."""
    eps_arg = np.asarray(eps_arg, dtype=np.float64).reshape(-1, 1, 1)
    w = np.abs(weights)
    return ((w * K * (eps_arg * A + eps_exp)).sum((1, 2)) + FLUSHED * w.sum())


def assert_within(actual, expected, bound, what: str = "") -> None:
    """``|actual - expected| <= bound`` elementwise, the ratio in the message."""
    difference = np.abs(np.asarray(actual, dtype=np.float64) - expected)
    ratio = float(np.max(difference / bound))
    assert np.all(difference <= bound), f"{what}: difference/bound {ratio:.3g}"


def kernel_arguments(Z: np.ndarray, bandwidths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The kernels' arguments ``A`` ``(20, N, N)`` on the pooled rows ``Z`` (``l1 / b``,
    then ``(l2 / b)**2``, from cdist) and the kernel values ``exp(-A)``."""
    l1, l2 = cdist(Z, Z, "cityblock"), cdist(Z, Z, "euclidean")
    half = len(bandwidths) // 2
    A = np.stack([l1 / b for b in bandwidths[:half]] + [(l2 / b) ** 2 for b in bandwidths[half:]])
    return np.exp(-A), A


def statistic_weights(m: int, n: int, paired: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """The U-statistic as ``sum_ij w_ij k(z_i, z_j)`` over the pooled rows (X's first):
    ``w`` ``(N, N)``, and the weights of the terms a side sums (the paired statistic
    sums the pairs (x_i, y_i) too, and takes them out again)."""
    N = m + n
    w = np.zeros((N, N))
    if paired:
        w[:m, :m] = w[m:, m:] = 1 / (n * (n - 1))
        w[:m, m:] = w[m:, :m] = -1 / (n * (n - 1))
    else:
        w[:m, :m], w[m:, m:] = 1 / (m * (m - 1)), 1 / (n * (n - 1))
        w[:m, m:] = w[m:, :m] = -1 / (m * n)
    summed = np.abs(w)
    np.fill_diagonal(w, 0.0)
    if paired:
        w[np.arange(m), m + np.arange(n)] = w[m + np.arange(n), np.arange(m)] = 0.0
    np.fill_diagonal(summed, 0.0)
    return w, summed


def naive_bound(X: np.ndarray, Y: np.ndarray, bandwidths: np.ndarray,
                bandwidth_errors: np.ndarray | float = 0.0, paired: bool = False,
                exp_errors: float = EXP_OURS + EXP_NUMPY) -> np.ndarray:
    """``(20,)``: how far the engine's statistics may lie from :func:`naive_mmds`'s (or any
    float64 implementation's from the same definition): both sides' kernel arguments
    (each within ``delta_d + 2 delta_b + 5u``: the distance, the bandwidth, squared for
    a Gaussian, and at most five roundings: ``1/b``, ``b**2`` and the product, or
    ``l2 / b``, its square and the square root), both sides' exps, and both sides' sums
    of at most ``(m + n)**2`` terms and four more operations, ``gamma((m + n)**2)``
    of the terms summed."""
    m, n = len(X), len(Y)
    K, A = kernel_arguments(np.vstack([X, Y]), bandwidths)
    w, summed = statistic_weights(m, n, paired)
    eps_arg = 2 * (distance_error(X.shape[1]) + 2 * np.asarray(bandwidth_errors) + 5 * U64)
    return (kernel_error(K, A, w, eps_arg, exp_errors)
            + 2 * gamma((m + n) ** 2, U64) * (summed * K).sum((1, 2)))


def summed_scale(result) -> np.ndarray:
    """The sum of the absolute terms of a complete statistic ``(20,)``, from its sums."""
    m, n, sums = result.m, result.n, result.sums
    return sums["xx"] / (m * (m - 1)) + sums["yy"] / (n * (n - 1)) + 2 * sums["xy"] / (m * n)


# ---------------------------------------------------------------- the naive reference
def naive_bandwidths(X, Y, metric, count=10):
    """The rule as stated: cross distances of the first 500 rows, min / 5% quantile."""
    distances = []
    for x in X[:500]:
        for y in Y[:500]:
            diff = x - y
            distances.append(np.abs(diff).sum() if metric == "l1" else np.sqrt((diff**2).sum()))
    distances = sorted(distances)
    if distances[0] < 0.1:
        low = max(distances[int(np.floor(0.05 * len(distances)))], 0.1)
    else:
        low = distances[0]
    low = low / 2
    high = 2 * max(distances[-1], 0.3)
    ratio = (high / low) ** (1 / (count - 1))
    return np.array([low * ratio**i for i in range(count)])


def naive_kernels(A, B, bw_l1, bw_l2):
    """List of 20 kernel matrices k(a_i, b_j): Laplace (L1) then Gaussian (L2)."""
    l1 = cdist(A, B, "cityblock")
    l2 = cdist(A, B, "euclidean")
    return ([np.exp(-l1 / b) for b in bw_l1] + [np.exp(-(l2 / b) ** 2) for b in bw_l2])


def naive_mmds(X, Y, paired=False):
    m, n = len(X), len(Y)
    bw_l1 = naive_bandwidths(X, Y, "l1")
    bw_l2 = naive_bandwidths(X, Y, "l2")
    values = []
    for kxx, kyy, kxy in zip(naive_kernels(X, X, bw_l1, bw_l2),
                             naive_kernels(Y, Y, bw_l1, bw_l2),
                             naive_kernels(X, Y, bw_l1, bw_l2), strict=True):
        if not paired:
            xx = sum(kxx[i, j] for i in range(m) for j in range(m) if i != j)
            yy = sum(kyy[i, j] for i in range(n) for j in range(n) if i != j)
            values.append(xx / (m * (m - 1)) + yy / (n * (n - 1)) - 2 * kxy.sum() / (m * n))
        else:
            total = sum(kxx[i, j] + kyy[i, j] - kxy[i, j] - kxy[j, i]
                        for i in range(n) for j in range(n) if i != j)
            values.append(total / (n * (n - 1)))
    return np.array(values), np.concatenate([bw_l1, bw_l2])


def sample(rng, rows, d, shift=0.0, scale=1.0):
    return rng.normal(size=(rows, d)) * scale + shift


# ---------------------------------------------------------------- agreement
@pytest.mark.parametrize(("m", "n", "d"), [(23, 17, 6), (30, 30, 4), (12, 40, 9)])
def test_kernel_mmds_match_the_naive_u_statistic(m, n, d):
    rng = np.random.default_rng(m * n + d)
    X, Y = sample(rng, m, d), sample(rng, n, d, shift=0.3, scale=1.2)
    expected, bandwidths = naive_mmds(X, Y)
    result = kernel_mmds(X, Y)
    # both sides' bandwidths within bandwidth_error: apart by 3e-15 to 2.6e-14 of them.
    # Measured: equal to the bit (host and AVX2). A wrong quantile or ratio moves them
    # by percents.
    errors = cross_distance_error(X, Y)
    assert_within(result.bandwidths, bandwidths, 2 * errors * bandwidths, "bandwidths")
    # naive_bound: up to 3e-12 here; measured at most 1/400 of it (host and AVX2). A
    # wrong normalisation or a missing pair moves a statistic by 1e-3 or more.
    assert_within(result.values, expected, naive_bound(X, Y, bandwidths, errors), "MMD^2")
    assert result.kernels == ("laplace",) * 10 + ("gaussian",) * 10
    assert np.all(np.diff(result.bandwidths[:10]) > 0)
    assert np.all(np.diff(result.bandwidths[10:]) > 0)


def test_paired_statistic_for_equal_sizes():
    rng = np.random.default_rng(5)
    X, Y = sample(rng, 25, 5), sample(rng, 25, 5, shift=0.2)
    expected, bandwidths = naive_mmds(X, Y, paired=True)
    errors = cross_distance_error(X, Y)
    # naive_bound (up to 2.2e-12; measured at most 1/600 of it, host and AVX2)
    assert_within(kernel_mmds(X, Y, statistic="paired").values, expected,
                  naive_bound(X, Y, bandwidths, errors, paired=True), "paired")
    # the complete statistic differs from the paired one only by the k(x_i, y_i) terms
    complete, _ = naive_mmds(X, Y)
    assert_within(kernel_mmds(X, Y).values, complete, naive_bound(X, Y, bandwidths, errors),
                  "complete")


def test_only_the_first_500_rows_set_the_bandwidths():
    rng = np.random.default_rng(2)
    X, Y = sample(rng, 520, 3), sample(rng, 30, 3, shift=0.5)
    result = kernel_mmds(X, Y)
    naive = np.concatenate([naive_bandwidths(X, Y, "l1"), naive_bandwidths(X, Y, "l2")])
    errors = cross_distance_error(X, Y)    # 2.2e-14 apart at most; measured: the same bits
    assert_within(result.bandwidths, naive, 2 * errors * naive, "bandwidths")
    X[510] += 1000.0                       # a far row past 500 changes no bandwidth
    # the same distances of the first 500 rows, the same rule: the same bits
    np.testing.assert_array_equal(kernel_mmds(X, Y).bandwidths, result.bandwidths)
    expected, bandwidths = naive_mmds(X, Y)
    # naive_bound: sums of up to 550**2 terms, up to 2.6e-10 here; measured at most
    # 1/1000 of it (host and AVX2)
    assert_within(kernel_mmds(X, Y).values, expected, naive_bound(X, Y, bandwidths, errors),
                  "MMD^2")


def test_bandwidth_rule_both_branches():
    # minimum >= 0.1: b_min is half the minimum, b_max twice the maximum. The ends are
    # exact halvings and doublings of the inputs (and C**0 = 1), so the first bandwidth
    # is exact; the last within bandwidth_error of exact distances (9.6e-15 relative).
    # Measured 6.7e-16, 1/14 of it; a wrong exponent or end is off by percents.
    far = np.array([0.5, 1.0, 2.0, 8.0])
    bandwidths = bandwidth_collection(far, 10)
    assert bandwidths[0] == 0.25
    assert bandwidths[-1] == pytest.approx(16.0, rel=bandwidth_error(bandwidths)[-1], abs=0)
    # consecutive ratios: both powers within POW, their products with 0.25 exact, the
    # division u, and this C (libm's pow) and the rule's (numpy's) each within POW of
    # 64 ** fl(1/9): 3.7e-15. Measured 1.4e-16.
    np.testing.assert_allclose(bandwidths[1:] / bandwidths[:-1], (16 / 0.25) ** (1 / 9),
                               rtol=4 * POW + U64, atol=0)
    # minimum < 0.1: the 5% quantile (sorted element floor(0.05 * count)), at least 0.1;
    # the first bandwidth is that element halved (exact)
    close = np.concatenate([np.zeros(5), np.linspace(0.2, 3.0, 95)])   # 100 distances
    assert bandwidth_collection(close, 10)[0] == np.sort(close)[5] / 2
    tiny = np.concatenate([np.zeros(50), np.full(50, 0.05)])
    bandwidths = bandwidth_collection(tiny, 10)
    assert bandwidths[0] == 0.05                 # 0.1 / 2: the double nearest 0.05
    # 0.3 * 2 is the double nearest 0.6; bandwidth_error 9.4e-15 (measured 5.6e-16)
    assert bandwidths[-1] == pytest.approx(0.6, rel=bandwidth_error(bandwidths)[-1], abs=0)


def test_vectorised_exp_is_accurate():
    t = np.concatenate([-np.geomspace(1e-12, 707.9, 20001), [0.0, -1e-300, -708.0]])
    # each within its bound of exp(t) (EXP_OURS 6.2e-15, EXP_NUMPY 8.9e-16): relative
    # to numpy's value, their sum over 1 - EXP_NUMPY (7.1e-15). Measured 2.2e-16, 1/32 (host
    # and AVX2; against a long-double exp, 1.2u and 1.1u). A Taylor term missing below
    # degree 12, or ln 2 in one part, is off by 2e-13 or more.
    np.testing.assert_allclose(exp_nonpositive(t), np.exp(t),
                               rtol=(EXP_OURS + EXP_NUMPY) / (1 - EXP_NUMPY), atol=0)
    assert np.all(exp_nonpositive(np.array([-709.0, -1e4, -np.inf])) == 0.0)


# ---------------------------------------------------------------- distances and blocks
def test_distances_match_cdist_and_blocking_is_exact():
    rng = np.random.default_rng(3)
    X, Y = sample(rng, 31, 57), sample(rng, 9, 57, shift=1.0)
    reference = pooled_distances(X, Y)
    l1, l2sq = reference.pooled()
    Z = np.vstack([X, Y])
    # both sum the same 57 rounded terms per pair, in their orders: each within
    # gamma(57) of the exact sum (relative, the terms being non-negative), so apart by
    # twice that of cdist's over 1 - gamma(57): 1.3e-14. Measured: equal to the bit.
    # A feature left out moves a distance by 1e-3 of it or more.
    rtol = 2 * gamma(57, U64) / (1 - gamma(57, U64))
    np.testing.assert_allclose(l1, cdist(Z, Z, "cityblock"), rtol=rtol, atol=0)
    np.testing.assert_allclose(l2sq, cdist(Z, Z, "sqeuclidean"), rtol=rtol, atol=0)
    assert np.all(np.diag(l1) == 0) and np.array_equal(l1, l1.T)
    assert np.array_equal(unpack(reference.xx[0], 31), l1[:31, :31])
    assert np.array_equal(unpack(reference.yy[1], 9), l2sq[31:, 31:])
    assert np.array_equal(reference.xy[0], l1[:31, 31:])
    for block in (1, 3, 8, 56, 1000):
        other = pooled_distances(X, Y, block_features=block)
        for a, b in zip(other.pooled(), reference.pooled(), strict=True):
            assert np.array_equal(a, b), block          # bit for bit
    # uneven blocks, streamed by hand
    edges = [0, 5, 6, 30, 57]
    streamed = stream_pooled_distances(
        ((X[:, a:b], Y[:, a:b]) for a, b in zip(edges[:-1], edges[1:], strict=True)), 31, 9)
    for a, b in zip(streamed.pooled(), reference.pooled(), strict=True):
        assert np.array_equal(a, b)


def test_float32_is_accumulated_in_float64():
    rng = np.random.default_rng(4)
    X = sample(rng, 20, 300).astype(np.float32) + np.float32(1000)
    Y = sample(rng, 15, 300, shift=0.1).astype(np.float32) + np.float32(1000)
    as32 = kernel_mmds(X, Y)
    as64 = kernel_mmds(X.astype(np.float64), Y.astype(np.float64))
    # float32 is widened to float64 exactly, then the same computation in one process
    assert np.array_equal(as32.values, as64.values)
    # the differences of float32 values near 1000 are exact in float64: both sides sum
    # the same 300 terms, gamma(300) each (as above: 6.7e-14). Measured: equal to the
    # bit. A feature left out moves a distance by 1e-3 of it or more.
    rtol = 2 * gamma(300, U64) / (1 - gamma(300, U64))
    np.testing.assert_allclose(pooled_distances(X, Y).xy[0],
                               cdist(X.astype(np.float64), Y.astype(np.float64), "cityblock"),
                               rtol=rtol, atol=0)


def test_results_do_not_depend_on_threads():
    rng = np.random.default_rng(6)
    X, Y = sample(rng, 70, 40), sample(rng, 33, 40, shift=0.2)
    threads = numba.get_num_threads()
    try:
        numba.set_num_threads(1)
        single = kernel_mmds(X, Y)
    finally:
        numba.set_num_threads(threads)
    again = kernel_mmds(X, Y)
    # one process, and each row's sums are stored and added in row order whatever the
    # threads: the same operations, the same bits
    assert np.array_equal(single.values, again.values)
    assert np.array_equal(kernel_mmds(X, Y).values, again.values)


# ---------------------------------------------------------------- known answers
def test_same_distribution_is_near_zero_and_shift_increases_it():
    """Deterministic: the samples are float64 normals of numpy's Generator at a fixed seed
    (the same bits on every CPU), and the statistics' rounding (twice gamma((m + n)**2)
    of their scale, 1.4e-10 here) is far below every margin. Measured (host and AVX2
    alike): medians 0.0025, 0.0037, 0.018, 0.056, 0.22 (the first 0.044 of the fourth,
    the closest gap 1.2e-3); the null statistics range over [-0.0021, 0.0089]."""
    rng = np.random.default_rng(7)
    X = sample(rng, 300, 4)
    medians = [kernel_mmds(X, sample(rng, 100, 4, shift=shift)).median
               for shift in (0.0, 0.25, 0.5, 1.0, 2.0)]
    assert abs(medians[0]) < 0.1 * medians[3]
    assert all(a < b for a, b in zip(medians, medians[1:], strict=False)), medians
    nulls = [kernel_mmds(X, sample(rng, 100, 4)).values for _ in range(8)]
    assert min(v.min() for v in nulls) < 0 < max(v.max() for v in nulls)   # either sign


def test_gaussian_kernel_matches_the_closed_form():
    """For N(0, I) against N(delta e_1, I) in d dims, with k = exp(-|x - y|^2 / b^2):
    MMD^2 = 2 (b^2 / (b^2 + 4))^(d/2) (1 - exp(-delta^2 / (b^2 + 4))).

    Deterministic: six fixed draws of numpy's Generator (the same bits on every CPU).
    The 0.15 is sampling error at these draws, not rounding (at most 4.4e-10, twice
    gamma((m + n)**2) of the statistics' scale): measured 0.011 to 0.031 (host and AVX2
    alike). The closest truth to the 0.01 cut is 1e-4 away."""
    rng = np.random.default_rng(8)
    d, delta = 2, 0.8
    estimates, closed = [], []
    for _ in range(6):
        X = sample(rng, 400, d)
        Y = sample(rng, 300, d)
        Y[:, 0] += delta
        result = kernel_mmds(X, Y)
        b = result.bandwidths[10:]
        closed.append(2 * (b**2 / (b**2 + 4)) ** (d / 2) * (1 - np.exp(-delta**2 / (b**2 + 4))))
        estimates.append(result.values[10:])
    estimate, truth = np.mean(estimates, axis=0), np.mean(closed, axis=0)
    useful = truth > 0.01                                   # bandwidths that see the shift
    assert useful.sum() >= 5
    np.testing.assert_allclose(estimate[useful], truth[useful], rtol=0.15)


def test_swapping_x_and_y_gives_the_same_values():
    rng = np.random.default_rng(9)
    X, Y = sample(rng, 40, 5), sample(rng, 27, 5, shift=0.4)
    forward, backward = kernel_mmds(X, Y), kernel_mmds(Y, X)
    # The same distances (|x - y| = |y - x|, summed feature by feature) and bandwidths
    # (the same cross distances, transposed): the same kernel values, summed in other
    # orders (X's rows' sums against Y's rows' sums). Each side within
    # gamma((m + n)**2) of the sum of the absolute terms, plus EXP_OURS of it should a
    # vector lane round one exp differently: 1e-12 of that scale, up to 3.9e-12.
    # Measured: 1/2300 of it (host and AVX2).
    # A swapped normalisation (m (m - 1) for n (n - 1)) is off by 1e-3.
    np.testing.assert_array_equal(forward.bandwidths, backward.bandwidths)
    bound = 2 * (gamma(67 ** 2, U64) + EXP_OURS) * summed_scale(forward)
    assert_within(forward.values, backward.values, bound, "swapped")


# ---------------------------------------------------------------- bad input
def test_bad_input_is_refused():
    rng = np.random.default_rng(10)
    X, Y = sample(rng, 10, 4), sample(rng, 8, 4)
    with pytest.raises(ShapeMismatchError, match="features"):
        kernel_mmds(X, sample(rng, 8, 5))
    with pytest.raises(SampleSizeError):
        kernel_mmds(X[:1], Y)
    with pytest.raises(SampleSizeError):
        kernel_mmds(X, Y[:1])
    for bad in (np.nan, np.inf, -np.inf):
        broken = Y.copy()
        broken[3, 2] = bad
        with pytest.raises(NonFiniteWeightsError, match="row 3"):
            kernel_mmds(X, broken)
    with pytest.raises(ShapeMismatchError):
        kernel_mmds(np.zeros((5, 0)), np.zeros((5, 0)))
    with pytest.raises(InvalidOptionError):
        kernel_mmds(X, Y, statistic="paired")
    with pytest.raises(InvalidOptionError):
        kernel_mmds(X, Y, number_bandwidths=1)
