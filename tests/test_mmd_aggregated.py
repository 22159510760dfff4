"""The MMDAgg test: resampled statistics by brute force, level, power, determinism."""

# ruff: noqa: N803, N806 -- the statistics' names: samples X, Y, Z, kernel matrices K

from __future__ import annotations

import numpy as np
import pytest
from scipy.spatial.distance import cdist

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


def kernels_of(Z, bandwidths):
    """The 20 kernel matrices of the pooled sample, straight from cdist."""
    l1, l2 = cdist(Z, Z, "cityblock"), cdist(Z, Z, "euclidean")
    return ([np.exp(-l1 / b) for b in bandwidths[:10]]
            + [np.exp(-(l2 / b) ** 2) for b in bandwidths[10:]])


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
    Z = np.vstack([X, Y])
    kernels = kernels_of(Z, bandwidths)
    for b, group in enumerate(groups):
        rest = np.setdiff1d(np.arange(m + n), group)
        x_rows, y_rows = (rest, group) if n <= m else (group, rest)
        expected = [brute_complete(K, x_rows, y_rows) for K in kernels]
        np.testing.assert_allclose(got[b], expected, rtol=1e-10, atol=1e-14)
    np.testing.assert_allclose(got[0], kernel_mmds(X, Y).values, rtol=1e-11)


def test_wild_bootstrap_statistics_equal_brute_force():
    rng = np.random.default_rng(1)
    n = 11
    X, Y = rng.normal(size=(n, 4)), rng.normal(size=(n, 4))
    bandwidths = kernel_mmds(X, Y).bandwidths
    signs = draw_signs(n, 15, np.random.default_rng(3))
    got = wild_bootstrap_statistics(*pooled_distances(X, Y).pooled(), 1 / bandwidths[:10],
                                    1 / bandwidths[10:] ** 2, signs)
    kernels = kernels_of(np.vstack([X, Y]), bandwidths)
    for b in range(signs.shape[1]):
        e = signs[:, b]
        for k, K in enumerate(kernels):
            total = sum(e[i] * e[j] * (K[i, j] + K[n + i, n + j] - K[i, n + j] - K[j, n + i])
                        for i in range(n) for j in range(n) if i != j)
            assert got[b, k] == pytest.approx(total / (n * (n - 1)), rel=1e-10, abs=1e-14)
    np.testing.assert_allclose(got[0], kernel_mmds(X, Y, statistic="paired").values,
                               rtol=1e-11)


def test_draws_are_what_they_claim():
    groups = draw_groups(7, 4, 500, np.random.default_rng(0))
    assert groups.shape == (501, 4) and list(groups[0]) == [7, 8, 9, 10]
    assert all(len(set(row)) == 4 and row.min() >= 0 and row.max() < 11 for row in groups)
    counts = np.bincount(groups[1:].ravel(), minlength=11) / 500
    np.testing.assert_allclose(counts, 4 / 11, atol=0.08)     # every row equally likely
    signs = draw_signs(6, 1000, np.random.default_rng(0))
    assert np.all(signs[:, 0] == 1) and set(np.unique(signs)) == {-1.0, 1.0}
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
    assert exceed(u) <= 0.05 < exceed(u + 20 / 2**30)
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
    np.testing.assert_allclose(result.statistics, kernel_mmds(X, Y).values, rtol=1e-11)
    # the two ways to decide agree: statistic above quantile <=> p-value at most u w
    np.testing.assert_array_equal(result.rejects, result.p_values <= result.thresholds)
    assert result.reject == bool(result.rejects.any())
    summary = result.to_dict()
    assert len(summary["kernels"]) == 20 and summary["seed"] == 7
    paired = mmdagg(X[:25], Y, seed=1, **FAST)
    assert paired.approximation == "wild bootstrap"
    np.testing.assert_allclose(paired.statistics,
                               kernel_mmds(X[:25], Y, statistic="paired").values, rtol=1e-11)
    forced = mmdagg(X[:25], Y, seed=1, permutations_same_sample_size=True, **FAST)
    assert forced.approximation == "permutations"


@pytest.mark.parametrize(("m", "n"), [(30, 20), (24, 24)])
def test_level_is_kept(m, n):
    rng = np.random.default_rng(m * n)
    rejections = [mmdagg(rng.normal(size=(m, 2)), rng.normal(size=(n, 2)), seed=s, **FAST).reject
                  for s in range(80)]
    assert np.mean(rejections) <= 0.125          # alpha = 0.05; P(>= 10 of 80) < 0.01


@pytest.mark.parametrize(("m", "n"), [(30, 20), (24, 24)])
def test_power_against_a_clear_shift(m, n):
    rng = np.random.default_rng(m + n)
    rejections = [mmdagg(rng.normal(size=(m, 2)), rng.normal(size=(n, 2)) + 1.0, seed=s,
                         **POWER).reject for s in range(20)]
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
