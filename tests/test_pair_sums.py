"""Kernel sums over fixed pairs from a binned Taylor table (posteriorzoo.mmd.pair_sums),
against exact sums (math.fsum of numpy's exp) and against the direct kernel sums."""

# ruff: noqa: N806 -- X and Y, the samples as the paper names them

from __future__ import annotations

import math

import numpy as np
import pytest

from posteriorzoo.errors import InvalidOptionError, ShapeMismatchError
from posteriorzoo.mmd import kernel_mmds_from_distances, pooled_distances
from posteriorzoo.mmd.pair_sums import KernelPairSums, PairSums
from posteriorzoo.mmd.statistics import bandwidths_from_distances


def _exact(t: np.ndarray, rates: np.ndarray) -> np.ndarray:
    return np.array([math.fsum(np.exp(-rate * t)) for rate in rates])


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
    assert sums.sums(rates) == pytest.approx(_exact(t, rates), rel=1e-15, abs=1e-300)
    assert sums.bins < t.size


def test_rates_far_above_the_spread_sum_the_pairs_directly():
    t = np.random.default_rng(4).uniform(0, 1000, 500)
    sums = PairSums(t, 10.0)            # 10,000 bins for 500 pairs: summed directly
    assert sums.bins == 0
    rates = np.array([1e-3, 0.1, 10.0])
    assert sums.sums(rates) == pytest.approx(_exact(t, rates), rel=1e-13, abs=1e-300)


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
        for key in ("xx", "xy", "yy"):
            assert tabled.sums[key] == pytest.approx(direct.sums[key], rel=1e-13)
        assert tabled.values == pytest.approx(direct.values, rel=1e-10, abs=1e-15)


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
    assert tabled.sums["xx"] == pytest.approx(direct.sums["xx"], rel=1e-12)
    assert tabled.values == pytest.approx(direct.values, rel=1e-9, abs=1e-14)
    with pytest.raises(InvalidOptionError, match="not both"):
        kernel_mmds_from_distances(distances, x_pairs=table, z_pairs=table)
    with pytest.raises(ShapeMismatchError, match="2415 pairs, not the 1225 of X"):
        kernel_mmds_from_distances(distances, x_pairs=table)
