"""ArviZ's bulk ESS and rank-normalised split R-hat, vectorised over coordinates.

arviz-stats computes both one coordinate at a time in a Python loop (``make_ufunc``),
about 0.2 ms per coordinate: 40 minutes for the 11.2 M weights of one ResNet-18 chain.
These are the same formulas (Vehtari et al. 2021, as arviz-stats 0.8 writes them: Blom's
rank transform, Geyer's initial positive and monotone sequences, the split chains) with
every step an array operation over the coordinates, so the weights of a network cost a
few array passes. ``tests/test_ess_rhat.py`` holds them to arviz-stats, the oracle,
within their rounding.

Arrays are ``(d, chains, draws)``: coordinate first, so that every per-coordinate sum runs
along contiguous memory.
"""

from __future__ import annotations

import math

import numba
import numpy as np
from numba import prange
from scipy import stats
from scipy.fft import next_fast_len

from posteriorzoo._numba import announce_compilation

announce_compilation()

#: Blom's offset of the rank transform (arviz-stats' ``_backtransform_ranks``).
BLOM = 3 / 8


def _split(values: np.ndarray) -> np.ndarray:
    """``(d, C, N)`` -> ``(d, 2C, N // 2)``: each chain's first and last halves."""
    half = values.shape[2] // 2
    return np.concatenate([values[:, :, :half], values[:, :, values.shape[2] - half:]],
                          axis=1)


@numba.njit(parallel=True, cache=True, nogil=True)
def _average_ties(rows: np.ndarray, order: np.ndarray) -> np.ndarray:
    """Twice the 1-based average rank of each value within its row, given each row's
    sorting ``order``: a run of equal values shares the mean of its ranks."""
    count, size = rows.shape
    twice = np.empty((count, size), dtype=np.int64)
    for i in prange(count):
        start = 0
        while start < size:
            stop = start   # the run of values equal to the one at ``start``
            while stop + 1 < size and rows[i, order[i, stop + 1]] == rows[i, order[i, start]]:
                stop += 1
            for k in range(start, stop + 1):
                twice[i, order[i, k]] = start + stop + 2
            start = stop + 1
    return twice


def _twice_average_ranks(rows: np.ndarray) -> np.ndarray:
    """Twice the 1-based average rank of each value within its row (an integer: ties
    share the mean of their ranks, scipy's ``rankdata(method="average")``). numpy sorts
    the rows (its batched argsort is several times numba's per-row one); numba walks the
    ties."""
    return _average_ties(rows, np.argsort(rows, axis=1))


def _z_scale(values: np.ndarray) -> np.ndarray:
    """Normal scores of the ranks of each coordinate's draws over all its chains.

    A rank is one of the ``2 * size - 1`` half-integers ``1 .. size``, so the scores
    are a table of ``norm.ppf`` on exactly arviz-stats' arguments, looked up."""
    d, chains, draws = values.shape
    size = chains * draws
    twice = _twice_average_ranks(values.reshape(d, size))
    scores = stats.norm.ppf((np.arange(2, 2 * size + 1) / 2 - BLOM) / (size - 2 * BLOM + 1))
    return scores[twice - 2].reshape(values.shape)


def _rhat(values: np.ndarray) -> np.ndarray:
    """Gelman-Rubin R-hat of each coordinate of ``(d, C, N)`` draws."""
    draws = values.shape[2]
    chain_mean = values.mean(axis=2)
    chain_var = values.var(axis=2, ddof=1)
    between = draws * chain_mean.var(axis=1, ddof=1)
    within = chain_var.mean(axis=1)
    return np.sqrt((between / within + draws - 1) / draws)


def rhat_rank(values: np.ndarray) -> np.ndarray:
    """Rank-normalised split R-hat (bulk and folded tail, the larger) of ``(d, C, N)``
    draws with ``C >= 2`` chains of ``N >= 4`` draws; arviz-stats' ``rhat`` ("rank")."""
    split = _split(values)
    bulk = _rhat(_z_scale(split))
    d = split.shape[0]
    median = np.median(split.reshape(d, -1), axis=1)
    tail = _rhat(_z_scale(np.abs(split - median[:, None, None])))
    return np.maximum(bulk, tail)


def _autocov(values: np.ndarray) -> np.ndarray:
    """Autocovariance of every lag along the last axis (by FFT, divided by N)."""
    draws = values.shape[-1]
    size = next_fast_len(2 * draws)
    centred = values - values.mean(axis=-1, keepdims=True)
    spectrum = np.fft.rfft(centred, n=size, axis=-1)
    spectrum *= np.conjugate(spectrum)
    return np.fft.irfft(spectrum, n=size, axis=-1)[..., :draws] / draws


def _ess(values: np.ndarray) -> np.ndarray:
    """Effective sample size of each coordinate of ``(d, C, N)`` draws (arviz-stats'
    ``_ess``): Geyer's initial positive sequence of paired autocorrelations, made
    monotone, each coordinate stopping where its own sequence turns negative."""
    d, chains, draws = values.shape
    total = chains * draws
    acov = _autocov(values)
    mean_acov = acov.mean(axis=1)                     # (d, N): lag t averaged over chains
    mean_var = mean_acov[:, 0] * draws / (draws - 1.0)
    var_plus = mean_var * (draws - 1.0) / draws
    if chains > 1:
        var_plus = var_plus + values.mean(axis=2).var(axis=1, ddof=1)
    with np.errstate(divide="ignore", invalid="ignore"):
        rho = 1.0 - (mean_var[:, None] - mean_acov) / var_plus[:, None]    # (d, N)
    kept = np.zeros((d, draws))
    kept[:, 0] = 1.0
    kept[:, 1] = rho[:, 1]
    even, odd = np.ones(d), rho[:, 1].copy()
    last = np.ones(d, dtype=np.int64)        # each coordinate's t when its loop ends
    running = np.ones(d, dtype=bool)
    t = 1
    while t < draws - 3:
        running &= (even + odd) > 0.0
        if not running.any():
            break
        even = np.where(running, rho[:, t + 1], even)
        odd = np.where(running, rho[:, t + 2], odd)
        keep = running & ((even + odd) >= 0)
        kept[keep, t + 1] = even[keep]
        kept[keep, t + 2] = odd[keep]
        last[running] = t + 2
        t += 2
    max_t = last - 2
    rows = np.arange(d)
    improve = even > 0
    kept[rows[improve], max_t[improve] + 1] = even[improve]
    t = 1
    while t <= int(max_t.max(initial=0)) - 2:
        active = t <= max_t - 2
        rise = active & (kept[:, t + 1] + kept[:, t + 2] > kept[:, t - 1] + kept[:, t])
        kept[rise, t + 1] = (kept[rise, t - 1] + kept[rise, t]) / 2.0
        kept[rise, t + 2] = kept[rise, t + 1]
        t += 2
    lags = np.arange(draws)
    head = np.where(lags[None, :] <= max_t[:, None], kept, 0.0).sum(axis=1)
    beyond = np.where(max_t + 1 < draws, kept[rows, np.minimum(max_t + 1, draws - 1)], 0.0)
    tau = np.maximum(-1.0 + 2.0 * head + beyond, 1 / math.log10(total))
    ess = total / tau
    ess[np.isnan(kept).any(axis=1)] = np.nan
    constant = (values.max(axis=(1, 2)) - values.min(axis=(1, 2))
                < np.finfo(np.float64).resolution)
    ess[constant] = total
    return ess


def ess_bulk(values: np.ndarray) -> np.ndarray:
    """Bulk effective sample size of ``(d, C, N)`` draws (``N >= 4``): the ESS of the
    normal scores of the split chains; arviz-stats' ``ess`` ("bulk")."""
    return _ess(_z_scale(_split(values)))
