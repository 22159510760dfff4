"""The diagnostics core (posteriorzoo.diagnostics) against processes with known answers.

Tolerances (issue 30 section 1). The draws come from numpy Generators at fixed seeds:
the same bits on every CPU, so each statistical check is deterministic. The statistics
of those draws differ between CPUs (and from ArviZ's) only by float64 rounding, bounded
below (:func:`_autocovariance_error`: 7e-13 to 4e-9 of them), far inside the statistical
margins, which are stated where they are asserted with the value measured at that seed
and the spread of the same statistic over other seeds.
"""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
from rounding_bounds import U64, gamma

from posteriorzoo.diagnostics import FLAGS, chain_statistics, scale_movement
from posteriorzoo.errors import InvalidOptionError, SampleSizeError


def _ar1(rho: float, chains: int, draws: int, d: int, seed: int) -> np.ndarray:
    """Stationary AR(1) chains x_t = rho x_{t-1} + sqrt(1 - rho^2) e_t, unit variance."""
    rng = np.random.default_rng(seed)
    x = np.empty((chains, draws, d))
    x[:, 0] = rng.normal(size=(chains, d))
    for t in range(1, draws):
        x[:, t] = rho * x[:, t - 1] + np.sqrt(1 - rho**2) * rng.normal(size=(chains, d))
    return x


def _autocovariance_error(draws: int) -> float:
    """How far a float64 FFT autocovariance of a chain of ``draws`` may be from the exact
    one at any lag, relative to its lag-0 value (first order): Higham (Theorem 24.2) puts
    an FFT of length L within ``log2(L) eta`` of its result in the 2-norm, ``eta = mu +
    gamma(4) (sqrt 2 + mu)`` <= 8 u with the twiddle factors within ``mu = 2 u``. The
    forward transform (``|y| = sqrt(L) |x|``), the squared moduli (their own ``3 u`` and
    twice the transform's error) and the inverse transform give ``(3 log2(L) eta + 3 u)
    sqrt(L)`` of ``|x|^2`` at every lag; L is the padded length, at most the power of 2
    at or above ``2 draws``."""
    length = 2 ** math.ceil(math.log2(2 * draws))
    eta = 8 * U64
    return (3 * math.log2(length) * eta + 3 * U64) * math.sqrt(length)


@pytest.mark.parametrize("chains", [1, 4])
def test_ess_r_hat_and_autocorrelation_are_arviz_023s(chains):
    # The oracle: ArviZ 0.23's xarray functions (the diagnostics call arviz-stats' array
    # interface, which must give the same numbers), on chains that mix and on a walk.
    az = pytest.importorskip("arviz")
    rng = np.random.default_rng(7)
    draws = _ar1(0.6, chains, 120, 30, 5)
    draws[..., :10] += np.cumsum(rng.normal(size=(chains, 120, 10)), axis=1)
    draws[..., 29] = 1.5  # one constant coordinate: left out of the summaries
    stats = chain_statistics(draws, lags=(1, 7))
    moving = draws[..., :29]
    split = moving if chains > 1 else moving[0].reshape(2, 60, -1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ess = az.ess(az.convert_to_dataset(moving), method="bulk")["x"].values
        r_hat = az.rhat(az.convert_to_dataset(split))["x"].values
        autocorrelation = az.autocorr(moving, axis=1)
    assert stats.constant == 1 and stats.ess.count == 29
    # Both run Vehtari et al.'s (2021) algorithm in float64 on the same draws (the ranks
    # and normal scores are exact and the same): only sums' orders differ. The medians
    # and interpolated quantiles move by at most the largest per-coordinate difference.
    # ESS = M N / tau over M split chains of N draws, tau = -1 + 2 sum_t rho_t over at
    # most N lags, each rho_t within M eps (eps: _autocovariance_error; the chains'
    # lag-0 values averaged, at most M times a chain's): tau within 2 N M eps, ESS within
    # ESS^2 / (M N) 2 N M eps = 2 eps ESS^2, on each side (Geyer's truncation, a sign
    # decision, taken alike). R-hat: means and variances of the M N normal scores, sums
    # of at most 2 M N roundings relative to the pooled variance, R-hat^2 times the
    # within-chain one: gamma(4 M N) R-hat^2 relative, on each side. Autocorrelation:
    # eps per chain, gamma(chains + 1) more for the mean, on each side. The bounds are
    # 2e-12 (R-hat) to 4e-9 (an ESS quantile) of the values, 7e-13 for the
    # autocorrelations. Measured: equal but for one ESS median 2 ulp apart (4e-6 of its
    # bound), AVX-512 and AVX2 alike.
    split_chains, split_draws = 2 * chains, 60
    eps = _autocovariance_error(split_draws)
    ess_bound = 2 * 2 * eps * float(np.max(ess)) ** 2
    r_hat_bound = 2 * gamma(4 * split_chains * split_draws, U64) * float(np.max(r_hat)) ** 3
    correlation_bound = 2 * (_autocovariance_error(120) + gamma(chains + 1, U64))
    assert abs(stats.ess.median - float(np.median(ess))) <= ess_bound
    assert abs(stats.ess.worst_tenth - float(np.quantile(ess, 0.1))) <= ess_bound
    assert abs(stats.r_hat.median - float(np.median(r_hat))) <= r_hat_bound
    assert abs(stats.r_hat.worst_tenth - float(np.quantile(r_hat, 0.9))) <= r_hat_bound
    for lag in (1, 7):
        expected = np.mean(autocorrelation[:, lag], axis=0)
        assert abs(stats.autocorrelation[lag].median
                   - float(np.median(expected))) <= correlation_bound


def test_independent_draws_mix():
    # Deterministic (seed 0; module docstring). Measured: median ESS 798.8 of 800 draws,
    # R-hat 1.0011, lag-1 autocorrelation -0.0062; over 200 other seeds their spread
    # (sd) is 1.6% of 800, 0.0005 and 0.0062: the margins (15%, 0.01, 0.05) are 8 to 18
    # of it, and a statistic off by a factor (ESS of one chain, 200) fails.
    stats = chain_statistics(_ar1(0.0, 4, 200, 40, 0))
    assert stats.ess.median == pytest.approx(800, rel=0.15)
    assert abs(stats.r_hat.median - 1) < 0.01
    assert abs(stats.autocorrelation[1].median) < 0.05
    assert stats.flags() == []


@pytest.mark.parametrize("rho", [0.5, 0.9])
def test_ar1_autocorrelation_and_ess_match_the_closed_form(rho):
    # Lag-k autocorrelation rho^k; ESS = n (1 - rho) / (1 + rho) for an AR(1) chain.
    # Deterministic (seed 1; module docstring). Measured (rho 0.5, 0.9): lag 1 off by
    # 2e-4 and 9e-5, lag 5 by -0.001 and -0.005, ESS by -1.7% and -0.08%; over 40 other
    # seeds their spread (sd) is at most 0.0026, 0.0049 and 4.3%: margins of 4.6 sd (the
    # ESS at rho 0.9) to 11 sd. The closed form's ESS for rho 0.9 is 5% of the draws'.
    stats = chain_statistics(_ar1(rho, 4, 2000, 20, 1), lags=(1, 5))
    assert stats.autocorrelation[1].median == pytest.approx(rho, abs=0.03)
    assert stats.autocorrelation[5].median == pytest.approx(rho**5, abs=0.05)
    expected = 8000 * (1 - rho) / (1 + rho)
    assert stats.ess.median == pytest.approx(expected, rel=0.2)


def test_chains_in_different_places_disagree():
    draws = _ar1(0.0, 4, 100, 10, 2)
    draws[1] += 1.0  # one chain stuck elsewhere
    stats = chain_statistics(draws)   # deterministic (seed 2): R-hat 1.095 measured
    assert stats.r_hat.median > 1.05
    assert "chains disagree (R-hat > 1.05)" in stats.flags()


def test_a_random_walk_is_flagged():
    rng = np.random.default_rng(3)
    walk = np.cumsum(rng.normal(size=(1, 100, 30)), axis=1)
    # deterministic (seed 3): ESS 2.4 of 100, R-hat 1.76, drift 1.21, lag 1 0.94 measured
    stats = chain_statistics(walk)
    assert stats.flags() == ["ESS below half the samples", "chains disagree (R-hat > 1.05)"]
    assert stats.drift.median > 1.0  # a trend: the halves differ by more than a std
    assert stats.autocorrelation[1].median > 0.8


def test_constant_coordinates_are_counted_not_summarised():
    draws = _ar1(0.0, 2, 50, 5, 4)
    draws[:, :, 0] = 3.0
    stats = chain_statistics(draws)
    assert stats.constant == 1 and stats.ess.count == 4


@pytest.mark.parametrize(("draws", "error"), [
    (np.zeros((2, 3, 1)), SampleSizeError),
    (np.zeros((2, 10)), InvalidOptionError),
    (np.full((1, 10, 2), np.nan), InvalidOptionError),
])
def test_bad_draws(draws, error):
    with pytest.raises(error):
        chain_statistics(draws)


def test_bad_lag():
    with pytest.raises(InvalidOptionError, match="lag"):
        chain_statistics(np.zeros((1, 10, 2)) + np.arange(10)[None, :, None], lags=(10,))


def test_scale_movement():
    assert scale_movement(np.full(5, 1e-3), np.full(5, 1e-3)) == 1.0
    # 1e-2 / 1e-3: the decimals' rounding (u each) and the division's: 3 u; the reciprocal
    # of the reciprocal one more (measured: exactly 10 both ways)
    assert scale_movement(np.full(5, 1e-3), np.full(5, 1e-2)) == pytest.approx(
        10, rel=gamma(4, U64), abs=0)
    assert scale_movement(np.full(5, 1e-2), np.full(5, 1e-3)) == pytest.approx(
        10, rel=gamma(4, U64), abs=0)
    with pytest.raises(InvalidOptionError):
        scale_movement(np.zeros(3), np.ones(3))


def test_every_flag_has_a_rule():
    assert all(rule for rule in FLAGS.values()) and len(FLAGS) == 6
