"""The MMD engine against an independent, obviously-correct numpy implementation.

The reference below is written from the definitions (PAPER_NOTES section 4), with plain
loops and scipy's cdist: the bandwidth rule, the 20 kernels and the U-statistics.
"""

# ruff: noqa: N803, N806 -- the statistics' names: samples X, Y, Z, kernel matrices K

from __future__ import annotations

import numba
import numpy as np
import pytest
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
    np.testing.assert_allclose(result.bandwidths, bandwidths, rtol=1e-12)
    np.testing.assert_allclose(result.values, expected, rtol=1e-6, atol=0)
    np.testing.assert_allclose(result.values, expected, rtol=1e-10)   # in fact much closer
    assert result.kernels == ("laplace",) * 10 + ("gaussian",) * 10
    assert np.all(np.diff(result.bandwidths[:10]) > 0)
    assert np.all(np.diff(result.bandwidths[10:]) > 0)


def test_paired_statistic_for_equal_sizes():
    rng = np.random.default_rng(5)
    X, Y = sample(rng, 25, 5), sample(rng, 25, 5, shift=0.2)
    expected, _ = naive_mmds(X, Y, paired=True)
    np.testing.assert_allclose(kernel_mmds(X, Y, statistic="paired").values, expected,
                               rtol=1e-10)
    # the complete statistic differs from the paired one only by the k(x_i, y_i) terms
    complete, _ = naive_mmds(X, Y)
    np.testing.assert_allclose(kernel_mmds(X, Y).values, complete, rtol=1e-10)


def test_only_the_first_500_rows_set_the_bandwidths():
    rng = np.random.default_rng(2)
    X, Y = sample(rng, 520, 3), sample(rng, 30, 3, shift=0.5)
    result = kernel_mmds(X, Y)
    np.testing.assert_allclose(result.bandwidths[:10], naive_bandwidths(X, Y, "l1"), rtol=1e-12)
    np.testing.assert_allclose(result.bandwidths[10:], naive_bandwidths(X, Y, "l2"), rtol=1e-12)
    X[510] += 1000.0                       # a far row past 500 changes no bandwidth
    np.testing.assert_array_equal(kernel_mmds(X, Y).bandwidths, result.bandwidths)
    expected, _ = naive_mmds(X, Y)
    np.testing.assert_allclose(kernel_mmds(X, Y).values, expected, rtol=1e-10)


def test_bandwidth_rule_both_branches():
    # minimum >= 0.1: b_min is half the minimum, b_max twice the maximum
    far = np.array([0.5, 1.0, 2.0, 8.0])
    bandwidths = bandwidth_collection(far, 10)
    assert bandwidths[0] == pytest.approx(0.25) and bandwidths[-1] == pytest.approx(16.0)
    np.testing.assert_allclose(bandwidths[1:] / bandwidths[:-1], (16 / 0.25) ** (1 / 9))
    # minimum < 0.1: the 5% quantile (sorted element floor(0.05 * count)), at least 0.1
    close = np.concatenate([np.zeros(5), np.linspace(0.2, 3.0, 95)])   # 100 distances
    assert bandwidth_collection(close, 10)[0] == pytest.approx(np.sort(close)[5] / 2)
    tiny = np.concatenate([np.zeros(50), np.full(50, 0.05)])
    bandwidths = bandwidth_collection(tiny, 10)
    assert bandwidths[0] == pytest.approx(0.05) and bandwidths[-1] == pytest.approx(0.6)


def test_vectorised_exp_is_accurate():
    t = np.concatenate([-np.geomspace(1e-12, 707.9, 20001), [0.0, -1e-300, -708.0]])
    np.testing.assert_allclose(exp_nonpositive(t), np.exp(t), rtol=2e-15, atol=0)
    assert np.all(exp_nonpositive(np.array([-709.0, -1e4, -np.inf])) == 0.0)


# ---------------------------------------------------------------- distances and blocks
def test_distances_match_cdist_and_blocking_is_exact():
    rng = np.random.default_rng(3)
    X, Y = sample(rng, 31, 57), sample(rng, 9, 57, shift=1.0)
    reference = pooled_distances(X, Y)
    l1, l2sq = reference.pooled()
    Z = np.vstack([X, Y])
    np.testing.assert_allclose(l1, cdist(Z, Z, "cityblock"), rtol=1e-13)
    np.testing.assert_allclose(l2sq, cdist(Z, Z, "sqeuclidean"), rtol=1e-12)
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
    assert np.array_equal(as32.values, as64.values)
    np.testing.assert_allclose(pooled_distances(X, Y).xy[0],
                               cdist(X.astype(np.float64), Y.astype(np.float64), "cityblock"),
                               rtol=1e-13)


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
    assert np.array_equal(single.values, again.values)
    assert np.array_equal(kernel_mmds(X, Y).values, again.values)


# ---------------------------------------------------------------- known answers
def test_same_distribution_is_near_zero_and_shift_increases_it():
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
    MMD^2 = 2 (b^2 / (b^2 + 4))^(d/2) (1 - exp(-delta^2 / (b^2 + 4)))."""
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
    np.testing.assert_allclose(kernel_mmds(X, Y).values, kernel_mmds(Y, X).values, rtol=1e-12)


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
