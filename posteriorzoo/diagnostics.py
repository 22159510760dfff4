"""Sample diagnostics on arrays (a pure core: no files, no models).

What a posterior approximation's samples say about themselves, whatever the method
claims:

- :func:`chain_statistics`: for draws of Markov chains ``(chains, draws, d)``, the bulk
  effective sample size and the rank-normalised split R-hat of every coordinate
  (arviz-stats' formulas, vectorised over coordinates in :mod:`posteriorzoo._ess_rhat`
  and tested against arviz-stats), lag-k autocorrelations, and the drift of the
  mean between the first and the second half of each chain, each summarised as a median
  and a worst tenth;
- :func:`series_statistics`: the same ESS, R-hat and autocorrelations of one number per
  draw (each sample's test log-likelihood: the chains' mixing in function space);
- :func:`sampler_flags`: what an HMC chain's recorded acceptance and E-BFMI say;
- :func:`chain_spread`: how far apart chains sit, in units of their own spread, and how
  many separate modes that makes;
- :func:`scale_movement`: how far a variational posterior's standard deviations moved
  from their initial values.

:data:`FLAGS` holds the plain-language verdicts with their thresholds; the collection
layer (:func:`posteriorzoo.collection.diagnose`) applies them.
"""

from __future__ import annotations

import math
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

#: E-BFMI below this: resampling the momentum moves the chain too little between the
#: energy's level sets, so the chain explores the energy (and heavy tails) slowly.
#: Betancourt (2016, "Diagnosing suboptimal cotangent disintegrations in Hamiltonian Monte
#: Carlo", arXiv:1604.00695) and Betancourt (2018, "A conceptual introduction to
#: Hamiltonian Monte Carlo", section 6.1); ArviZ's ``bfmi`` gives the same advice.
E_BFMI_LIMIT = 0.3
#: A chain's mean acceptance probability after burn-in outside this band is far from what
#: its step-size adaptation aimed at (the record's ``target_accept``, 0.8 by default, and
#: the usual targets 0.6 to 0.95 all lie inside it). Below 0.5 the frozen step is too
#: large for where the chain went after burn-in: more than half of the trajectories, L
#: gradients each, are thrown away, and HMC's optimal acceptance in high dimension is
#: 0.651 (Beskos et al. 2013, "Optimal tuning of the hybrid Monte Carlo algorithm").
#: Above 0.99 the step is far smaller than it needs to be: the fixed trajectory takes
#: many more leapfrog steps than it must, or, at the ``max_leapfrog_steps`` cap, is
#: shorter than asked, and the chain moves like a random walk.
ACCEPTANCE_BAND = (0.5, 0.99)
#: Two chains whose means are farther apart than this many within-chain standard
#: deviations sit in separate modes (:func:`chain_spread`): in many dimensions a chain's
#: draws lie at about its standard deviation ``s`` (the root of the trace of its
#: covariance) from its mean, so two chains of spread ``s`` whose means are more than
#: ``2 s`` apart share no neighbourhood.
SEPARATE_MODES = 2.0

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
    "E-BFMI below 0.3":
        f"a chain's recorded E-BFMI < {E_BFMI_LIMIT:g} (Betancourt 2016)",
    "acceptance far from its target (outside 0.5 .. 0.99)":
        f"a chain's recorded mean acceptance probability after burn-in outside "
        f"{ACCEPTANCE_BAND[0]:g} .. {ACCEPTANCE_BAND[1]:g} (its adaptation aimed at the "
        "recorded target_accept)",
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


@public
def sampler_flags(acceptance_rate: float | None, e_bfmi: float | None) -> list[str]:
    """The :data:`FLAGS` an HMC chain's record raises: ``"E-BFMI below 0.3"`` below
    :data:`E_BFMI_LIMIT`, and ``"acceptance far from its target ..."`` outside
    :data:`ACCEPTANCE_BAND` (the reasons are theirs).

    Parameters
    ----------
    acceptance_rate : float or None
        The chain's mean acceptance probability after burn-in, in [0, 1] (None: not
        recorded, no flag).
    e_bfmi : float or None
        Its E-BFMI over the iterations after burn-in (None: not recorded or undefined, no
        flag).
    """
    for name, value in (("acceptance_rate", acceptance_rate), ("e_bfmi", e_bfmi)):
        if value is not None and not (math.isfinite(value) and value >= 0):
            raise InvalidOptionError(f"sampler_flags(): {name} must be a finite number "
                                     f">= 0 or None, not {value!r}")
    raised = []
    if e_bfmi is not None and e_bfmi < E_BFMI_LIMIT:
        raised.append("E-BFMI below 0.3")
    low, high = ACCEPTANCE_BAND
    if acceptance_rate is not None and not low <= acceptance_rate <= high:
        raised.append("acceptance far from its target (outside 0.5 .. 0.99)")
    return raised


@dataclass(frozen=True)
class SeriesStatistics:
    """Mixing statistics of one number per draw (:func:`series_statistics`), NaN where
    the number never moves.

    Attributes
    ----------
    chains, draws : int
    ess : float
        Bulk effective sample size over all chains.
    r_hat : float
        Rank-normalised split R-hat; with one chain, of its two halves.
    autocorrelation : dict[int, float]
        Lag -> autocorrelation, averaged over chains.
    """

    chains: int
    draws: int
    ess: float
    r_hat: float
    autocorrelation: dict[int, float]

    def to_dict(self) -> dict[str, object]:
        return {"chains": self.chains, "draws": self.draws, "ess": self.ess,
                "r_hat": self.r_hat,
                "autocorrelation": {str(lag): value
                                    for lag, value in self.autocorrelation.items()}}


@public
def series_statistics(series: np.ndarray, lags: tuple[int, ...] = DEFAULT_LAGS
                      ) -> SeriesStatistics:
    """ESS, split R-hat and autocorrelations of a scalar of each draw, e.g. each sample's
    test-set log-likelihood: whether the chains mix in what the network predicts, which
    its weights' statistics cannot say (a chain can wander along weights that do not
    change the function).

    Parameters
    ----------
    series : ndarray of shape (chains, draws), float
        The scalar of draw ``j`` of chain ``c``, in order along the chain; at least 4
        draws per chain.
    lags : tuple of int, default (1, 5, 10)
        Autocorrelation lags, each in ``1 .. draws - 1``.

    Returns
    -------
    SeriesStatistics
        :func:`chain_statistics`' formulas on the one coordinate.
    """
    if series.ndim != 2:
        raise InvalidOptionError(f"series_statistics(): series must have shape (chains, "
                                 f"draws), not {series.shape}")
    coordinates = chain_coordinates(series[:, :, None], lags)

    def only(values: np.ndarray) -> float:
        return float(values[0]) if values.size else float("nan")

    return SeriesStatistics(
        chains=coordinates.chains, draws=coordinates.draws, ess=only(coordinates.ess),
        r_hat=only(coordinates.r_hat),
        autocorrelation={lag: only(values)
                         for lag, values in coordinates.autocorrelation.items()})


@dataclass(frozen=True)
class ChainSpread:
    """How far apart ``k`` chains sit, in units of their own spread (:func:`chain_spread`).

    Attributes
    ----------
    distance : ndarray of shape (k, k)
        ``|mean_a - mean_b| / sqrt((s_a^2 + s_b^2) / 2)``: the distance between two
        chains' means in pooled within-chain standard deviations (0 on the diagonal;
        infinite between distinct chains that never move).
    within : ndarray of shape (k,)
        Each chain's standard deviation ``s_c``: the root of the trace of its sample
        covariance, the root-mean-square distance of its draws from its mean.
    modes : ndarray of shape (k,), int
        The mode each chain is in, numbered in order of first appearance: chains are in
        one mode when a path of pairs each at most ``separation`` apart joins them.
    separation : float
        The distance above which two chains are in separate modes.
    """

    distance: np.ndarray
    within: np.ndarray
    modes: np.ndarray
    separation: float

    @property
    def count(self) -> int:
        """Separate modes among the chains."""
        return int(self.modes.max()) + 1 if self.modes.size else 0

    def pair_distances(self) -> np.ndarray:
        """The distances of the ``k (k - 1) / 2`` pairs ``a < b``, in row order."""
        return self.distance[np.triu_indices(len(self.within), 1)]

    def sentence(self) -> str:
        """``"4 chains in 4 separate modes (between-chain distance 11.2 to 15.0 within-chain
        sd)"``."""
        chains, count = len(self.within), self.count
        text = (f"{chains} chain{'s' if chains != 1 else ''} in {count} "
                f"{'separate ' if count > 1 else ''}mode{'s' if count != 1 else ''}")
        pairs = self.pair_distances()
        if pairs.size == 0:
            return text
        low, high = float(pairs.min()), float(pairs.max())
        shown = f"{low:.1f}" if f"{low:.1f}" == f"{high:.1f}" else f"{low:.1f} to {high:.1f}"
        return f"{text} (between-chain distance {shown} within-chain sd)"

    def to_dict(self) -> dict[str, object]:
        pairs = self.pair_distances()
        return {"chains": len(self.within), "modes": self.count,
                "mode_of_chain": self.modes.tolist(), "separation": self.separation,
                "within_sd": self.within.tolist(),
                "distance": {"min": float(pairs.min()) if pairs.size else None,
                             "median": float(np.median(pairs)) if pairs.size else None,
                             "max": float(pairs.max()) if pairs.size else None},
                "sentence": self.sentence()}


@public
def chain_spread(chains: list[np.ndarray], separation: float = SEPARATE_MODES
                 ) -> ChainSpread:
    """The spread between chains, said as modes: for each pair, the distance between the
    chains' means relative to their within-chain standard deviation, and the groups of
    chains that distance does not separate.

    Chains started in different modes on purpose (full-batch HMC, one chain from each
    trained network) are not meant to mix, so R-hat across them says nothing; this says
    instead how far apart they stayed.

    Parameters
    ----------
    chains : list of ndarray of shape (draws_c, d), float
        Each chain's draws (at least 2; any order), the same ``d`` coordinates (weights,
        or one column such as the test log-likelihood).
    separation : float, default :data:`SEPARATE_MODES`
        Chains farther apart than this (in pooled within-chain standard deviations) are
        in separate modes; > 0.

    Returns
    -------
    ChainSpread

    Notes
    -----
    The means are estimates: chains of one mode whose draws are strongly autocorrelated
    (few effective samples) have means farther apart than their spread suggests, about
    ``sqrt(2 / ESS)`` standard deviations, so read the distances beside each chain's ESS.
    """
    function = "chain_spread()"
    if not chains:
        raise SampleSizeError(f"{function}: no chains")
    if not (math.isfinite(separation) and separation > 0):
        raise InvalidOptionError(f"{function}: separation must be a finite number > 0, "
                                 f"not {separation!r}")
    for index, draws in enumerate(chains):
        if draws.ndim != 2 or draws.shape[1] != chains[0].shape[1] or draws.shape[1] < 1:
            raise InvalidOptionError(f"{function}: every chain must have shape (draws, d) "
                                     f"with the first's d >= 1; chain {index} has "
                                     f"{draws.shape}")
        if draws.shape[0] < 2:
            raise SampleSizeError(f"{function}: chain {index} has {draws.shape[0]} draw(s); "
                                  "a spread needs 2")
        if draws.dtype.kind not in "iuf" or not np.isfinite(draws).all():
            raise InvalidOptionError(f"{function}: chain {index} must hold finite real "
                                     "numbers")
    means = np.stack([draws.mean(axis=0, dtype=np.float64) for draws in chains])
    within = np.sqrt(np.array([draws.astype(np.float64).var(axis=0, ddof=1).sum()
                               for draws in chains]))
    gaps = np.zeros((len(chains), len(chains)))
    for a in range(len(chains)):  # one pair at a time: k^2 rows of d would not fit
        for b in range(a + 1, len(chains)):
            gaps[a, b] = gaps[b, a] = float(np.linalg.norm(means[a] - means[b]))
    pooled = np.sqrt((within[:, None] ** 2 + within[None, :] ** 2) / 2)
    with np.errstate(divide="ignore", invalid="ignore"):
        distance = np.where(gaps == 0, 0.0, gaps / pooled)
    modes = np.full(len(chains), -1)
    count = 0
    for start in range(len(chains)):  # single linkage: flood each unvisited chain's group
        if modes[start] >= 0:
            continue
        modes[start], stack = count, [start]
        while stack:
            here = stack.pop()
            for other in np.flatnonzero((distance[here] <= separation) & (modes < 0)):
                modes[other] = count
                stack.append(int(other))
        count += 1
    return ChainSpread(distance, within, modes, float(separation))

