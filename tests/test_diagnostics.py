"""The diagnostics core (posteriorzoo.diagnostics) against processes with known answers."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

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
    assert stats.ess.median == pytest.approx(float(np.median(ess)), rel=1e-9)
    assert stats.ess.worst_tenth == pytest.approx(float(np.quantile(ess, 0.1)), rel=1e-9)
    assert stats.r_hat.median == pytest.approx(float(np.median(r_hat)), rel=1e-9)
    assert stats.r_hat.worst_tenth == pytest.approx(float(np.quantile(r_hat, 0.9)), rel=1e-9)
    for lag in (1, 7):
        expected = np.mean(autocorrelation[:, lag], axis=0)
        assert stats.autocorrelation[lag].median == pytest.approx(
            float(np.median(expected)), rel=1e-9)


def test_independent_draws_mix():
    stats = chain_statistics(_ar1(0.0, 4, 200, 40, 0))
    assert stats.ess.median == pytest.approx(800, rel=0.15)
    assert abs(stats.r_hat.median - 1) < 0.01
    assert abs(stats.autocorrelation[1].median) < 0.05
    assert stats.flags() == []


@pytest.mark.parametrize("rho", [0.5, 0.9])
def test_ar1_autocorrelation_and_ess_match_the_closed_form(rho):
    # Lag-k autocorrelation rho^k; ESS = n (1 - rho) / (1 + rho) for an AR(1) chain.
    stats = chain_statistics(_ar1(rho, 4, 2000, 20, 1), lags=(1, 5))
    assert stats.autocorrelation[1].median == pytest.approx(rho, abs=0.03)
    assert stats.autocorrelation[5].median == pytest.approx(rho**5, abs=0.05)
    expected = 8000 * (1 - rho) / (1 + rho)
    assert stats.ess.median == pytest.approx(expected, rel=0.2)


def test_chains_in_different_places_disagree():
    draws = _ar1(0.0, 4, 100, 10, 2)
    draws[1] += 1.0  # one chain stuck elsewhere
    stats = chain_statistics(draws)
    assert stats.r_hat.median > 1.05
    assert "chains disagree (R-hat > 1.05)" in stats.flags()


def test_a_random_walk_is_flagged():
    rng = np.random.default_rng(3)
    walk = np.cumsum(rng.normal(size=(1, 100, 30)), axis=1)
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
    assert scale_movement(np.full(5, 1e-3), np.full(5, 1e-2)) == pytest.approx(10)
    assert scale_movement(np.full(5, 1e-2), np.full(5, 1e-3)) == pytest.approx(10)
    with pytest.raises(InvalidOptionError):
        scale_movement(np.zeros(3), np.ones(3))


def test_every_flag_has_a_rule():
    assert all(rule for rule in FLAGS.values()) and len(FLAGS) == 4
