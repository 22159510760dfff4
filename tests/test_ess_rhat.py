"""The vectorised bulk ESS and rank-normalised split R-hat against arviz-stats, the oracle
(``posteriorzoo._ess_rhat``: the same formulas, every coordinate at once).

Tolerances, from the computation (u = 2^-53):

- The normal scores are ``norm.ppf`` of the same float64 arguments (Blom's transform of
  the same average ranks), so they are equal bit for bit.
- R-hat: the same operations on the same scores; only the order of the sum over the
  chains' means may differ (numpy's pairwise sum of one row against a reduction over
  an axis), so within gamma(N + M) of the result, M chains of N draws.
- ESS: the autocovariances come from the same FFT of rows batched differently
  (pocketfft's error is about log2(m) u of the lag-0 term, m the FFT length), the
  mean over the M chains may be summed in another order (gamma(M)), and tau sums up to N
  paired autocorrelations of size <= 1 (gamma(N)). Each autocorrelation is a difference
  over ``var_plus``, so its absolute error is at most 2 (gamma(M) + 4 log2(m) u); tau's is
  2 N times that plus gamma(N), and ESS = MN / tau has relative error |dtau| / tau.
  Geyer's truncation is a decision (a paired sum > 0); data from a seed are
  continuous, so none lies within 1e-12 of switching: such a coordinate would show as a
  difference far above the bound.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from arviz_stats.base import array_stats
from rounding_bounds import U64, gamma

from posteriorzoo._ess_rhat import _z_scale, ess_bulk, rhat_rank

SHAPES = [(4, 25), (1, 40), (2, 7), (8, 100), (3, 4), (4, 5), (2, 301)]


def _draws(chains: int, draws: int, seed: int, d: int = 300) -> np.ndarray:
    """AR(1) chains with correlations from -0.5 to 0.97, a sixth of the coordinates with
    chains at different places, a tenth with ties (rounded), one constant: (C, N, d)."""
    rng = np.random.default_rng(seed)
    rho = rng.uniform(-0.5, 0.97, d)
    x = np.empty((chains, draws, d))
    x[:, 0] = rng.standard_normal((chains, d))
    for t in range(1, draws):
        x[:, t] = rho * x[:, t - 1] + rng.standard_normal((chains, d))
    x[:, :, : d // 6] += rng.standard_normal((chains, 1, d // 6)) * 3
    x[:, :, d // 6: d // 6 + d // 10] = np.round(x[:, :, d // 6: d // 6 + d // 10])
    x[:, :, -1] = 1.5
    return x


def _by_coordinate(x: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(x.transpose(2, 0, 1))


@pytest.mark.parametrize(("chains", "draws"), SHAPES)
def test_ess_and_rhat_are_arviz_stats(chains, draws):
    x = _draws(chains, draws, seed=chains * 1000 + draws)
    # one chain: R-hat of its two halves, as chain_statistics asks for it
    split = x if chains > 1 else x[0, :2 * (draws // 2)].reshape(2, draws // 2, -1)
    with np.errstate(divide="ignore", invalid="ignore"):
        oracle_ess = np.asarray(array_stats.ess(x, chain_axis=0, draw_axis=1, method="bulk"))
        oracle_rhat = np.asarray(array_stats.rhat(split, chain_axis=0, draw_axis=1))
        ess = ess_bulk(_by_coordinate(x))
        rhat = rhat_rank(_by_coordinate(split))
    assert np.array_equal(np.isnan(ess), np.isnan(oracle_ess))
    assert np.array_equal(np.isnan(rhat), np.isnan(oracle_rhat))
    assert ess[-1] == oracle_ess[-1] == chains * 2 * (draws // 2)   # the constant one
    finite = np.isfinite(oracle_ess)
    m = chains * 2
    n = draws // 2
    fft = math.log2(2 * n) + 1
    tau = (m * n) / oracle_ess[finite]
    bound = (2 * n * 2 * (gamma(m, U64) + 4 * fft * U64) + gamma(n, U64)) / tau
    error = np.abs(ess[finite] - oracle_ess[finite]) / oracle_ess[finite]
    assert (error <= bound).all(), f"ESS off by {error.max():.2e} > bound {bound.min():.2e}"
    assert bound.max() < 1e-9   # tight enough that a wrong formula shows
    moving = np.isfinite(oracle_rhat)
    assert np.allclose(rhat[moving], oracle_rhat[moving], rtol=gamma(n + m, U64), atol=0)


def test_scores_are_arviz_stats_bit_for_bit():
    """Ranks with ties and the Blom transform looked up in a table are arviz-stats'
    ``_z_scale`` of each coordinate, exactly (the same ppf of the same arguments)."""
    x = _draws(4, 25, seed=7)
    scores = _z_scale(_by_coordinate(x))
    for j in range(x.shape[2]):
        assert np.array_equal(scores[j], array_stats._z_scale(x[:, :, j]))
