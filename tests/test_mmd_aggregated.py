"""The MMDAgg test: resampled statistics by brute force, level, power, determinism.

Tolerances (issue 30 section 1): the resampled statistics against brute force in
float64 are bounded as in test_mmd_statistics (both sides' kernel values and sums, for
the values at hand; here both sides share the bandwidths), and the engine's two ways to
one statistic (group sums of kernel matrices, or a matrix product, against
kernel_sums) differ only in their sums' orders (:func:`engine_rounding`). The draws
(numpy's Generator: integer permutations, Rademacher signs from integers, float64
normal samples) are the same bits on every CPU, so the level, power and draw checks
are deterministic at their fixed seeds; each states its measured margin. Their
statistics may differ in the last bits between CPUs (test_mmd_statistics), which can
change a decision only where a statistic lies within about 1e-12 of its quantile.
"""

# ruff: noqa: N803, N806 -- the statistics' names: samples X, Y, Z, kernel matrices K

from __future__ import annotations

import numpy as np
import pytest
from rounding_bounds import U64, gamma
from test_mmd_statistics import (
    EXP_NUMPY,
    EXP_OURS,
    assert_within,
    distance_error,
    kernel_arguments,
    kernel_error,
    statistic_weights,
    summed_scale,
)

from posteriorzoo.errors import InvalidOptionError, SampleSizeError
from posteriorzoo.mmd import kernel_mmds, mmdagg, pooled_distances
from posteriorzoo.mmd.aggregated import (
    _corrected_level,
    draw_groups,
    draw_signs,
    permuted_statistics,
    wild_bootstrap_statistics,
)

FAST = {"B1": 200, "B2": 200, "B3": 20}
# With 20 kernels the smallest p-value, 1 / (B1 + 1), must be able to fall below about
# alpha / 20: B1 = 200 is too coarse for power (it can never reject if u < 20 / 201).
POWER = {"B1": 600, "B2": 600, "B3": 30}


def engine_rounding(K: np.ndarray, m: int, n: int) -> np.ndarray:
    """``(20,)``: one side's rounding of a statistic from the pooled kernel values ``K``
    ``(20, N, N)`` (any of the engine's ways, or brute force's), beyond its kernel
    values: sums of at most ``N**2`` terms and four more operations, ``gamma(N**2 + 4)``,
    of at most 12 times the largest weight ``c`` times the sum ``T`` of all kernel
    values. (The permutations' large group is the total less twice the small group's
    row sums plus its own pairs: ``T + 2 T + 2 T`` over ``m (m - 1)``, the small
    group's ``T``, the cross sums' ``3 T`` twice.)"""
    c = max(1 / (m * (m - 1)), 1 / (n * (n - 1)), 1 / (m * n))
    return gamma((m + n) ** 2 + 4, U64) * 12 * c * K.sum((1, 2))


def brute_bound(K: np.ndarray, A: np.ndarray, weights: np.ndarray, d: int, m: int, n: int
                ) -> np.ndarray:
    """The engine's statistic against brute force's on the same bandwidths: both sides'
    kernel arguments (distance_error and at most five roundings), exps, and sums."""
    eps_arg = 2 * (distance_error(d) + 5 * U64)
    return (kernel_error(K, A, weights, eps_arg, EXP_OURS + EXP_NUMPY)
            + 2 * engine_rounding(K, m, n))


def brute_complete(K, x_rows, y_rows):
    m, n = len(x_rows), len(y_rows)
    kxx, kyy = K[np.ix_(x_rows, x_rows)], K[np.ix_(y_rows, y_rows)]
    kxy = K[np.ix_(x_rows, y_rows)]
    return ((kxx.sum() - np.trace(kxx)) / (m * (m - 1))
            + (kyy.sum() - np.trace(kyy)) / (n * (n - 1)) - 2 * kxy.sum() / (m * n))


@pytest.mark.parametrize(("m", "n"), [(14, 9), (8, 13)])
def test_permuted_statistics_equal_brute_force(m, n):
    rng = np.random.default_rng(m + 10 * n)
    X, Y = rng.normal(size=(m, 3)), rng.normal(size=(n, 3)) + 0.3
    distances = pooled_distances(X, Y)
    bandwidths = kernel_mmds(X, Y).bandwidths
    groups = draw_groups(m, n, 25, np.random.default_rng(0))
    got = permuted_statistics(*distances.pooled(), 1 / bandwidths[:10],
                              1 / bandwidths[10:] ** 2, m, n, groups)
    K, A = kernel_arguments(np.vstack([X, Y]), bandwidths)
    weights, _ = statistic_weights(m, n)
    for b, group in enumerate(groups):
        rest = np.setdiff1d(np.arange(m + n), group)
        x_rows, y_rows = (rest, group) if n <= m else (group, rest)
        expected = [brute_complete(kernel, x_rows, y_rows) for kernel in K]
        # brute_bound with this arrangement's weights: 4.5e-13 to 1e-11 here;
        # measured at most 1/4000 of it (host and AVX2). A row in the wrong group moves
        # a statistic by 1e-3 or more.
        order = np.concatenate([x_rows, y_rows])
        arranged = np.empty_like(weights)
        arranged[np.ix_(order, order)] = weights
        assert_within(got[b], expected, brute_bound(K, A, arranged, 3, m, n), f"arrangement {b}")
    # The observed arrangement against kernel_sums: the same products and exps (EXP_OURS
    # each, should a vector lane round differently), other sums. Measured 1/3000.
    result = kernel_mmds(X, Y)
    bound = (2 * EXP_OURS * np.abs(weights * K).sum((1, 2)) + engine_rounding(K, m, n)
             + gamma((m + n) ** 2, U64) * summed_scale(result))
    assert_within(got[0], result.values, bound, "observed")


def test_wild_bootstrap_statistics_equal_brute_force():
    rng = np.random.default_rng(1)
    n = 11
    X, Y = rng.normal(size=(n, 4)), rng.normal(size=(n, 4))
    bandwidths = kernel_mmds(X, Y).bandwidths
    signs = draw_signs(n, 15, np.random.default_rng(3))
    got = wild_bootstrap_statistics(*pooled_distances(X, Y).pooled(), 1 / bandwidths[:10],
                                    1 / bandwidths[10:] ** 2, signs)
    kernels, A = kernel_arguments(np.vstack([X, Y]), bandwidths)
    weights, summed = statistic_weights(n, n, paired=True)
    # The signs change the weights' signs only: one bound for every b. Brute force
    # sums n (n - 1) terms of four kernel values each, the engine forms h (three
    # roundings per entry), h @ signs and the signs' product (n terms each): both
    # within gamma((2n)**2) of the weighted absolute sum. 6e-17 to 4.5e-13 here;
    # measured at most 1/120 of it (host and AVX2).
    eps_arg = 2 * (distance_error(4) + 5 * U64)
    bound = (kernel_error(kernels, A, weights, eps_arg, EXP_OURS + EXP_NUMPY)
             + 2 * gamma((2 * n) ** 2, U64) * (summed * kernels).sum((1, 2)))
    for b in range(signs.shape[1]):
        e = signs[:, b]
        expected = [sum(e[i] * e[j] * (K[i, j] + K[n + i, n + j] - K[i, n + j] - K[j, n + i])
                        for i in range(n) for j in range(n) if i != j) / (n * (n - 1))
                    for K in kernels]
        assert_within(got[b], expected, bound, f"signs {b}")
    # all signs +1 against kernel_sums: the same kernel values (EXP_OURS each), other
    # sums (kernel_sums adds the pairs (x_i, y_i) and takes them out). Measured 1/800.
    bound = (2 * EXP_OURS + 2 * gamma((2 * n) ** 2, U64)) * (summed * kernels).sum((1, 2))
    assert_within(got[0], kernel_mmds(X, Y, statistic="paired").values, bound, "observed")


def test_draws_are_what_they_claim():
    groups = draw_groups(7, 4, 500, np.random.default_rng(0))
    assert groups.shape == (501, 4) and list(groups[0]) == [7, 8, 9, 10]
    assert all(len(set(row)) == 4 and row.min() >= 0 and row.max() < 11 for row in groups)
    # Every row equally likely. Deterministic: integers from numpy's Generator at a fixed
    # seed (the same on every CPU). A row's count is Binomial(500, 4/11), and 0.08 is 3.7
    # standard deviations: a random seed would fail with probability up to 0.04
    # (Hoeffding, 11 rows), too likely for a statistical test. Measured 0.038; a sampler
    # that never picks a row is off by 0.36.
    counts = np.bincount(groups[1:].ravel(), minlength=11) / 500
    np.testing.assert_allclose(counts, 4 / 11, rtol=0, atol=0.08)
    signs = draw_signs(6, 1000, np.random.default_rng(0))
    assert np.all(signs[:, 0] == 1) and set(np.unique(signs)) == {-1.0, 1.0}
    # deterministic likewise: 0.05 is 3.9 standard deviations of the mean of 6000 signs
    # (a random seed: up to 1.1e-3 by Hoeffding); measured 0.0023. Signs that are all +1
    # (or all -1) give 1.
    assert abs(signs[:, 1:].mean()) < 0.05


def test_bisection_finds_the_largest_level_preserving_u():
    rng = np.random.default_rng(2)
    # kernels' statistics are strongly correlated, as in practice
    first = np.sort(rng.normal(size=201) + 0.3 * rng.normal(size=(20, 201)), axis=1)
    second = rng.normal(size=(300, 1)) + 0.3 * rng.normal(size=(300, 20))
    weights = np.full(20, 1 / 20)
    u, quantiles = _corrected_level(first, second, weights, 0.05, 200, 40)

    def exceed(v):
        index = np.clip(np.ceil(201 * (1 - v * weights)).astype(int) - 1, 0, 200)
        return np.mean(np.any(second > first[np.arange(20), index], axis=1))

    assert 0 < u < 20
    # exceed is the function's own formula, the same operations on the same values: at u
    # it is the same count over 300 that the bisection compared with alpha.
    # The step 20 / 2**30 is no rounding tolerance: 40 halvings of [0, 20] leave u within
    # 20 / 2**40 of the largest level-preserving u, and exceed does not decrease in v.
    assert exceed(u) <= 0.05 < exceed(u + 20 / 2**30)
    # u / 20 and u * (1 / 20) may differ by a rounding, but 201 (1 - u / 20) (u a multiple
    # of 20 / 2**40) lies 1 / 2**40 or more from an integer: the same indices
    np.testing.assert_array_equal(
        quantiles, first[np.arange(20), np.ceil(201 * (1 - u / 20)).astype(int) - 1])


def test_result_is_consistent_and_deterministic():
    rng = np.random.default_rng(3)
    X, Y = rng.normal(size=(40, 3)), rng.normal(size=(25, 3)) + 0.5
    result = mmdagg(X, Y, seed=7, **FAST)
    again = mmdagg(X, Y, seed=7, **FAST)
    for name in ("statistics", "quantiles", "p_values", "thresholds"):
        assert np.array_equal(getattr(result, name), getattr(again, name))
    assert result.u == again.u and result.approximation == "permutations"
    other = mmdagg(X, Y, seed=8, **FAST)
    assert not np.array_equal(other.quantiles, result.quantiles)
    # the statistics against kernel_sums' (as in test_permuted_statistics_equal_brute_
    # force: the same kernel values, other sums). Measured 1/12,000 of the bound.
    K, _ = kernel_arguments(np.vstack([X, Y]), result.bandwidths)
    weights, summed = statistic_weights(40, 25)
    direct = kernel_mmds(X, Y)
    bound = (2 * EXP_OURS * np.abs(weights * K).sum((1, 2)) + engine_rounding(K, 40, 25)
             + gamma(65 ** 2, U64) * summed_scale(direct))
    assert_within(result.statistics, direct.values, bound, "complete")
    # the two ways to decide agree: statistic above quantile <=> p-value at most u w
    np.testing.assert_array_equal(result.rejects, result.p_values <= result.thresholds)
    assert result.reject == bool(result.rejects.any())
    summary = result.to_dict()
    assert len(summary["kernels"]) == 20 and summary["seed"] == 7
    paired = mmdagg(X[:25], Y, seed=1, **FAST)
    assert paired.approximation == "wild bootstrap"
    # as in test_wild_bootstrap_statistics_equal_brute_force (measured 1/2600)
    K, _ = kernel_arguments(np.vstack([X[:25], Y]), paired.bandwidths)
    _, summed = statistic_weights(25, 25, paired=True)
    bound = (2 * EXP_OURS + 2 * gamma(50 ** 2, U64)) * (summed * K).sum((1, 2))
    assert_within(paired.statistics, kernel_mmds(X[:25], Y, statistic="paired").values,
                  bound, "paired")
    forced = mmdagg(X[:25], Y, seed=1, permutations_same_sample_size=True, **FAST)
    assert forced.approximation == "permutations"


@pytest.mark.parametrize(("m", "n"), [(30, 20), (24, 24)])
def test_level_is_kept(m, n):
    """At most 10 of 80 tests of one distribution against itself reject (alpha = 0.05).

    Deterministic: the samples and resamples are fixed draws of numpy's Generator, the
    same bits on every CPU; only a decision whose statistic lies within rounding of its
    quantile could go the other way. Measured: 0 of 80 (m != n, permutations) and 1 of
    80 (wild bootstrap), host and AVX2. (As a statistical test of a random seed: for a
    level-0.05 test, 10 or more of 80 has probability 0.0065, not below 1e-6, hence the
    fixed seeds.)
    """
    rng = np.random.default_rng(m * n)
    rejections = [mmdagg(rng.normal(size=(m, 2)), rng.normal(size=(n, 2)), seed=s, **FAST).reject
                  for s in range(80)]
    assert np.mean(rejections) <= 0.125


@pytest.mark.parametrize(("m", "n"), [(30, 20), (24, 24)])
def test_power_against_a_clear_shift(m, n):
    rng = np.random.default_rng(m + n)
    rejections = [mmdagg(rng.normal(size=(m, 2)), rng.normal(size=(n, 2)) + 1.0, seed=s,
                         **POWER).reject for s in range(20)]
    # Deterministic as test_level_is_kept's: measured 20 of 20 (host and AVX2), each
    # with a kernel's p-value two ranks (2 / 601) or more below its threshold
    assert np.mean(rejections) >= 0.9


def test_bad_options():
    rng = np.random.default_rng(4)
    X, Y = rng.normal(size=(10, 2)), rng.normal(size=(9, 2))
    for options in ({"alpha": 0.0}, {"alpha": 1.0}, {"B1": 0}, {"B3": 2.5}, {"seed": 1.5},
                    {"number_bandwidths": 1}):
        with pytest.raises(InvalidOptionError):
            mmdagg(X, Y, **options)
    with pytest.raises(SampleSizeError):
        mmdagg(X[:1], Y)
