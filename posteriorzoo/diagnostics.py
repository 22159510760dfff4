"""Sample diagnostics on arrays (a pure core: no files, no models).

What a posterior approximation's samples say about themselves, whatever the method
claims:

- :func:`chain_statistics`: for draws of Markov chains ``(chains, draws, d)``, the bulk
  effective sample size and the rank-normalised split R-hat of every coordinate
  (arviz-stats' formulas, vectorised over coordinates in :mod:`posteriorzoo._ess_rhat`
  and tested against arviz-stats), lag-k autocorrelations, and the drift of the
  mean between the first and the second half of each chain, each summarised as a median
  and a worst tenth;
- :func:`scale_movement`: how far a variational posterior's standard deviations moved
  from their initial values.

:data:`FLAGS` holds the plain-language verdicts with their thresholds; the collection
layer (:func:`posteriorzoo.collection.diagnose`) applies them.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from posteriorzoo._api import public
from posteriorzoo.errors import InvalidOptionError, SampleSizeError

#: R-hat above this: the chains have not converged to one distribution (Vehtari et al.
#: 2021 recommend 1.01 for final results; 1.05 is the usual warning level).
R_HAT_LIMIT = 1.05
#: Vehtari et al. (2021)'s threshold for final results: the share of coordinates above
#: it is reported beside the median (a median of 1.045 can hide 82% above 1.01).
R_HAT_STRICT = 1.01
#: ESS below this fraction of the draws: the draws are strongly autocorrelated.
ESS_FRACTION = 0.5
#: Kinetic temperature more than this fraction above the exact chain's: too hot.
TEMPERATURE_TOLERANCE = 0.10
#: A variational scale that moved by less than this factor (median over a layer) from its
#: initial value in every layer has not trained.
SCALE_MOVED_FACTOR = 1.25

#: Flag name -> the rule, as the help and the report print it.
FLAGS: dict[str, str] = {
    "ESS below half the samples":
        f"median bulk ESS < {ESS_FRACTION:g} x the draws of the chains it is computed on",
    "chains disagree (R-hat > 1.05)":
        f"median rank-normalised split R-hat > {R_HAT_LIMIT:g}",
    "chain too hot":
        f"kinetic temperature mean(v^2)/lr > (1 + {TEMPERATURE_TOLERANCE:g}) x the exact "
        "chain's 1/(1 - alpha/2)",
    "variance did not train":
        f"every layer's median sigma within a factor {SCALE_MOVED_FACTOR:g} of its initial "
        "value",
}
#: Autocorrelation lags reported by default.
DEFAULT_LAGS = (1, 5, 10)


@dataclass(frozen=True)
class Summary:
    """A per-coordinate statistic summarised over the ``count`` coordinates where it is
    defined (constant coordinates have none): its median, its worst tenth (the 10th
    percentile where low is bad, like ESS; the 90th where high is bad) and its worst value
    (the minimum, or the maximum)."""

    median: float
    worst_tenth: float
    count: int
    worst: float = float("nan")

    def to_dict(self) -> dict[str, float | int]:
        return {"median": self.median, "worst_tenth": self.worst_tenth, "worst": self.worst,
                "count": self.count}


def _summary(values: np.ndarray, low_is_bad: bool) -> Summary:
    finite = values[np.isfinite(values)]
    if finite.size == 0:
        return Summary(float("nan"), float("nan"), 0)
    tenth = np.percentile(finite, 10 if low_is_bad else 90)
    worst = finite.min() if low_is_bad else finite.max()
    return Summary(float(np.median(finite)), float(tenth), int(finite.size), float(worst))


@dataclass(frozen=True)
class ChainStatistics:
    """Mixing statistics of ``chains`` chains of ``draws`` draws of ``d`` coordinates.

    Attributes
    ----------
    chains, draws, coordinates : int
    ess : Summary
        Bulk effective sample size (ArviZ ``ess``, method "bulk"), over all chains.
    r_hat : Summary
        Rank-normalised split R-hat (ArviZ ``rhat``); with one chain, its two halves.
    autocorrelation : dict[int, Summary]
        Lag ``k`` -> the autocorrelation at lag ``k`` (ArviZ ``autocorr``, per chain,
        averaged over chains), summarised with high as bad.
    drift : Summary
        ``|mean(first half) - mean(second half)|`` of each chain in units of the chain's
        standard deviation, averaged over chains.
    constant : int
        Coordinates that never move (no statistic).
    r_hat_above_strict : float
        Share of the coordinates with an R-hat whose R-hat exceeds :data:`R_HAT_STRICT`
        (1.01, Vehtari et al. 2021's threshold for final results).
    """

    chains: int
    draws: int
    coordinates: int
    ess: Summary
    r_hat: Summary
    autocorrelation: dict[int, Summary]
    drift: Summary
    constant: int
    r_hat_above_strict: float = float("nan")

    def flags(self) -> list[str]:
        """The :data:`FLAGS` these statistics raise."""
        raised = []
        if self.ess.count and self.ess.median < ESS_FRACTION * self.chains * self.draws:
            raised.append("ESS below half the samples")
        if self.r_hat.count and self.r_hat.median > R_HAT_LIMIT:
            raised.append("chains disagree (R-hat > 1.05)")
        return raised

    def to_dict(self) -> dict[str, object]:
        return {"chains": self.chains, "draws": self.draws, "coordinates": self.coordinates,
                "ess": self.ess.to_dict(), "r_hat": self.r_hat.to_dict(),
                "autocorrelation": {str(lag): summary.to_dict()
                                    for lag, summary in self.autocorrelation.items()},
                "drift": self.drift.to_dict(), "constant": self.constant,
                "r_hat_above_1_01": self.r_hat_above_strict, "flags": self.flags()}


def _share_above(values: np.ndarray, limit: float) -> float:
    """The share of the finite ``values`` above ``limit`` (NaN when none is finite)."""
    finite = values[np.isfinite(values)]
    return float((finite > limit).mean()) if finite.size else float("nan")


@dataclass(frozen=True)
class ChainCoordinates:
    """The per-coordinate statistics of one block of coordinates of Markov-chain draws
    (:func:`chain_coordinates`), before they are summarised: blocks of one set of chains
    concatenate (:meth:`join`) so that statistics of millions of weights stream through a
    few blocks at a time.

    Attributes
    ----------
    chains, draws : int
    ess, r_hat, drift : ndarray of shape (moving,)
    autocorrelation : dict[int, ndarray of shape (moving,)]
    coordinates, constant : int
        Coordinates in the block, and those of them that never move (no statistic).
    """

    chains: int
    draws: int
    ess: np.ndarray
    r_hat: np.ndarray
    autocorrelation: dict[int, np.ndarray]
    drift: np.ndarray
    coordinates: int
    constant: int

    @staticmethod
    def join(blocks: list[ChainCoordinates]) -> ChainCoordinates:
        """The blocks (of the same chains and lags) as one, in the order given."""
        if not blocks:
            raise SampleSizeError("ChainCoordinates.join(): no blocks")
        first = blocks[0]
        return ChainCoordinates(
            chains=first.chains, draws=first.draws,
            ess=np.concatenate([b.ess for b in blocks]),
            r_hat=np.concatenate([b.r_hat for b in blocks]),
            autocorrelation={lag: np.concatenate([b.autocorrelation[lag] for b in blocks])
                             for lag in first.autocorrelation},
            drift=np.concatenate([b.drift for b in blocks]),
            coordinates=sum(b.coordinates for b in blocks),
            constant=sum(b.constant for b in blocks))

    def summary(self) -> ChainStatistics:
        """Median and worst tenth of each statistic over the moving coordinates."""
        return ChainStatistics(
            chains=self.chains, draws=self.draws, coordinates=self.coordinates,
            ess=_summary(self.ess, low_is_bad=True),
            r_hat=_summary(self.r_hat, low_is_bad=False),
            autocorrelation={lag: _summary(values, low_is_bad=False)
                             for lag, values in self.autocorrelation.items()},
            drift=_summary(self.drift, low_is_bad=False), constant=self.constant,
            r_hat_above_strict=_share_above(self.r_hat, R_HAT_STRICT))


def chain_coordinates(draws: np.ndarray, lags: tuple[int, ...] = DEFAULT_LAGS
                      ) -> ChainCoordinates:
    """Every coordinate's ESS, R-hat, autocorrelations and drift (:func:`chain_statistics`
    before its summary); the parameters are :func:`chain_statistics`'."""
    function = "chain_statistics()"
    if draws.ndim != 3:
        raise InvalidOptionError(f"{function}: draws must have shape (chains, draws, d), "
                                 f"not {draws.shape}")
    if draws.dtype.kind not in "iuf":
        raise InvalidOptionError(f"{function}: draws must hold real numbers, not "
                                 f"{draws.dtype}")
    chains, count, coordinates = draws.shape
    if chains < 1 or count < 4 or coordinates < 1:
        raise SampleSizeError(f"{function}: needs at least 1 chain of 4 draws of 1 "
                              f"coordinate, not the shape {draws.shape}")
    if not np.isfinite(draws).all():
        raise InvalidOptionError(f"{function}: draws hold NaN or infinite values")
    for lag in lags:
        if not isinstance(lag, int) or isinstance(lag, bool) or not 1 <= lag < count:
            raise InvalidOptionError(f"{function}: each lag must be an integer in "
                                     f"1 .. {count - 1}, not {lag!r}")
    values = draws.astype(np.float64)
    moving = values.std(axis=1).max(axis=0) > 0
    values = values[:, :, moving]
    split = values
    if chains == 1:  # ArviZ wants two chains for R-hat: a lone chain's two halves
        half = count // 2
        split = split[0, :2 * half].reshape(2, half, -1)
    # ArviZ's formulas (arviz-stats), vectorised over the coordinates: arviz-stats loops
    # over them in Python, 40 minutes for one ResNet-18 chain (posteriorzoo._ess_rhat)
    from arviz_stats.base import array_stats

    from posteriorzoo._ess_rhat import ess_bulk, rhat_rank

    ess = ess_bulk(np.ascontiguousarray(values.transpose(2, 0, 1)))
    r_hat = rhat_rank(np.ascontiguousarray(split.transpose(2, 0, 1)))
    autocorrelation = array_stats.autocorr(values, axis=1)
    half = count // 2
    spread = values.std(axis=1)
    drift = np.abs(values[:, :half].mean(axis=1) - values[:, count - half:].mean(axis=1))
    with np.errstate(divide="ignore", invalid="ignore"):
        drift = np.where(spread > 0, drift / spread, np.nan)
    return ChainCoordinates(
        chains=chains, draws=count, ess=ess, r_hat=r_hat,
        autocorrelation={lag: np.nanmean(autocorrelation[:, lag], axis=0) for lag in lags},
        drift=np.nanmean(drift, axis=0), coordinates=coordinates,
        constant=int((~moving).sum()))


@public
def chain_statistics(draws: np.ndarray, lags: tuple[int, ...] = DEFAULT_LAGS
                     ) -> ChainStatistics:
    """ESS, R-hat, autocorrelation and drift of Markov-chain draws.

    Parameters
    ----------
    draws : ndarray of shape (chains, draws, d), float
        Draw ``j`` of chain ``c`` in order along the chain; ``d`` coordinates (e.g. every
        weight of a network). At least 4 draws per chain.
    lags : tuple of int, default (1, 5, 10)
        Autocorrelation lags, each in ``1 .. draws - 1``.

    Returns
    -------
    ChainStatistics

    Notes
    -----
    Every statistic is per coordinate, so the draws may come in blocks of coordinates:
    ``ChainCoordinates.join([chain_coordinates(b) for b in blocks]).summary()`` is the same.
    """
    return chain_coordinates(draws, lags).summary()


@public
def scale_movement(initial: np.ndarray, final: np.ndarray) -> float:
    """The factor by which a layer's typical scale moved: ``max(r, 1/r)`` with ``r`` the
    ratio of the medians of ``final`` and ``initial`` (>= 1; 1 means it did not move).

    Parameters
    ----------
    initial, final : ndarray, float
        Positive standard deviations of one layer (any shapes, e.g. sigma at the start of
        training and after it, or the initial sigma and the samples' standard deviation).
    """
    for name, value in (("initial", initial), ("final", final)):
        if value.size == 0 or not np.isfinite(value).all() or (value <= 0).any():
            raise InvalidOptionError(f"scale_movement(): {name} must hold positive finite "
                                     "numbers")
    ratio = float(np.median(final) / np.median(initial))
    return max(ratio, 1.0 / ratio)
