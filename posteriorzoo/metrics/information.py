"""Entropy and the mutual information of an ensemble's predictions (in nats).

The mutual information between the label and the member, ``H(mean_m p_m) - mean_m H(p_m)``
(Shannon entropies, natural logarithm), is the ensemble's epistemic uncertainty, or
diversity, on a sample: 0 when every member predicts the same distribution, at most
``log(min(m, K))``. The paper (seed 003, section 4.2 and Table 1) reports its mean over the
in-distribution test set (IDMI) and over the OOD set (OODMI): :func:`mean_mutual_information`.
Its section 5.1 ("functional collapse", Figures 3, 7 and 8) takes, for pairs of independently
trained networks, "the mean over the test set of their pairwise mutual information,
quantifying the divergence between the single models and their average":
:func:`pairwise_mutual_information`.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from posteriorzoo._api import public
from posteriorzoo.metrics import _checks
from posteriorzoo.options import check_integer


def _entropy(probabilities: np.ndarray) -> np.ndarray:
    """Shannon entropy in nats over the last axis, with 0 log 0 = 0 (``entr``), as float64."""
    from scipy.special import entr  # here: a seventh of a second to import, at startup

    return entr(np.asarray(probabilities, dtype=np.float64)).sum(axis=-1)


def _kernel_input(members: np.ndarray) -> np.ndarray:
    """``members`` as the kernels take it: C-contiguous native float32 or float64 (other
    real dtypes, e.g. integer 0/1 probabilities, as float64)."""
    if members.dtype in (np.float32, np.float64) and members.dtype.isnative:
        return np.ascontiguousarray(members)
    return np.ascontiguousarray(members, dtype=np.float64)


def _ensemble(members: np.ndarray, function: str | None = None
              ) -> tuple[np.ndarray, np.ndarray]:
    """``(predictive (n, K), mutual information (n,))`` of member probabilities
    ``(m, n, K)``, float64, in one pass over the members. With ``function``, that pass
    also checks them (``members`` must have passed :func:`_checks.probability_layout`):
    where its bounds fail, or come within rounding of the sum tolerance, the full check
    runs and raises its own error; else ``members`` must have been checked already."""
    from posteriorzoo.metrics._kernels import ensemble_entropies

    predictive, expected, (bad, low, high, error) = ensemble_entropies(_kernel_input(members))
    if function is not None and (bad or low < 0 or high > 1
                                 or error > _checks.SUM_TOLERANCE * (1 - 1e-9)):
        _checks.probabilities(function, "member_probabilities", members, ndim=3)
    # MI >= 0 by Jensen's inequality; rounding can leave -1e-16 where all members agree.
    return predictive, np.maximum(_entropy(predictive) - expected, 0.0)


def member_scores(members: np.ndarray, labels: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Each member's accuracy and mean negative log-likelihood ``(m,)``, float64, of
    checked member probabilities ``(m, n, K)`` against checked labels ``(n,)`` in
    0 .. K - 1, in one pass: :func:`~posteriorzoo.metrics.accuracy` and
    :func:`~posteriorzoo.metrics.negative_log_likelihood` along the member axis."""
    from posteriorzoo.metrics._kernels import member_hits

    accuracy, picked = member_hits(_kernel_input(members), np.asarray(labels, dtype=np.int64))
    return accuracy, -np.log(picked).mean(axis=1)


def ensemble_summary(function: str, member_probabilities: np.ndarray
                     ) -> tuple[np.ndarray, np.ndarray]:
    """The predictive ``(n, K)`` and the per-sample mutual information ``(n,)`` of
    ``(m, n, K)`` member probabilities, checked once (errors name ``function``): what
    :func:`~posteriorzoo.metrics.posterior_predictive` and :func:`mutual_information`
    return, for a caller that needs both."""
    _checks.probability_layout(function, "member_probabilities", member_probabilities, ndim=3)
    return _ensemble(member_probabilities, function)


@public
def entropy(probabilities: np.ndarray) -> np.ndarray:
    """Shannon entropy of each row of predicted probabilities.

    Parameters
    ----------
    probabilities : ndarray of shape (n, K), float
        Class probabilities; each row sums to 1.

    Returns
    -------
    ndarray of shape (n,), float64
        ``-sum_k p_k log p_k`` in nats (``0 log 0 = 0``), in [0, log K].
    """
    _checks.probabilities("entropy", "probabilities", probabilities, ndim=2)
    return _entropy(probabilities)


@public
def mutual_information(member_probabilities: np.ndarray) -> np.ndarray:
    """Per-sample mutual information between the label and the member of an ensemble.

    Parameters
    ----------
    member_probabilities : ndarray of shape (m, n, K), float
        Each of ``m`` members' softmax probabilities on ``n`` samples.

    Returns
    -------
    ndarray of shape (n,), float64
        ``H(mean_m p_m) - mean_m H(p_m)`` in nats (natural logarithm), in
        [0, log(min(m, K))]: 0 when all members agree, ``log 2`` for two members each
        certain of a different class. The entropy of the predictive minus the expected
        entropy of the members (the epistemic part of the predictive uncertainty).
    """
    return ensemble_summary("mutual_information", member_probabilities)[1]


@public
def mean_mutual_information(member_probabilities: np.ndarray) -> float:
    """The mean over samples of :func:`mutual_information`: the paper's IDMI or OODMI.

    Parameters
    ----------
    member_probabilities : ndarray of shape (m, n, K), float
        Each of ``m`` members' softmax probabilities on ``n`` samples: the in-distribution
        test set for IDMI, the OOD set for OODMI.

    Returns
    -------
    float
        The mean mutual information in nats, in [0, log(min(m, K))]. (The paper's Table 1
        states neither unit nor scale; its values, up to 267.2, exceed this bound, so they
        are scaled -- most likely x 100, as its other columns are percentages.)
    """
    return float(ensemble_summary("mean_mutual_information", member_probabilities)[1].mean())


def _pairs(function: str, pairs: np.ndarray | Sequence[Sequence[int]] | None,
           members: int) -> np.ndarray:
    """The (P, 2) int64 member index pairs: all i < j by default, else checked ``pairs``."""
    if pairs is None:
        if members < 2:
            _checks.fail(function, f"needs at least 2 members to form a pair, not {members}")
        return np.stack(np.triu_indices(members, k=1), axis=1).astype(np.int64)
    try:
        array = np.asarray(pairs)
    except ValueError:  # ragged nested sequences
        _checks.fail(function, "pairs must be a list of (i, j) member index pairs")
    if array.dtype.kind not in "iu" or array.ndim != 2 or array.shape[1] != 2:
        _checks.fail(function, "pairs must be (i, j) pairs of integer member indices, "
                               f"shape (P, 2); got {array.dtype} of shape {array.shape}")
    if array.shape[0] == 0:
        _checks.fail(function, "pairs must hold at least one pair")
    if array.min() < 0 or array.max() >= members:
        _checks.fail(function, f"pairs must index members 0..{members - 1}; they span "
                               f"{int(array.min())}..{int(array.max())}")
    same = np.flatnonzero(array[:, 0] == array[:, 1])
    if same.size:
        _checks.fail(function, f"a pair must join two different members, not "
                               f"{tuple(int(i) for i in array[same[0]])}")
    return array.astype(np.int64, copy=False)


@public
def draw_pairs(members: int, count: int, seed: int) -> np.ndarray:
    """Distinct member pairs ``i < j``, drawn uniformly without replacement.

    Parameters
    ----------
    members : int
        m >= 2, the number of members.
    count : int
        Pairs wanted (>= 1); all ``m (m - 1) / 2`` of them, in order, if there are fewer.
    seed : int
        Seed of :func:`numpy.random.default_rng`.

    Returns
    -------
    ndarray of shape (min(count, m (m - 1) / 2), 2), int64
        The pairs, sorted.
    """
    check_integer("members", members, 2)
    check_integer("count", count, 1)
    check_integer("seed", seed, 0)
    every = np.stack(np.triu_indices(members, k=1), axis=1).astype(np.int64)
    if count >= len(every):
        return every
    chosen = np.random.default_rng(seed).choice(len(every), size=count, replace=False)
    return every[np.sort(chosen)]


@public
def pairwise_mutual_information(member_probabilities: np.ndarray,
                                pairs: np.ndarray | Sequence[Sequence[int]] | None = None,
                                ) -> tuple[np.ndarray, np.ndarray]:
    """The mutual information of every two-member ensemble, averaged over samples.

    For a pair (i, j) of members this is the mutual information of the ensemble {i, j},
    ``mean_n [H((p_i + p_j) / 2) - (H(p_i) + H(p_j)) / 2]`` -- the mean Jensen-Shannon
    divergence between the two members' predictions, "the mean over the test set of their
    pairwise mutual information, quantifying the divergence between the single models and
    their average" (seed 003, section 5.1, Figures 3 and 7: functional collapse). It equals
    ``mean_mutual_information(member_probabilities[[i, j]])``.

    Parameters
    ----------
    member_probabilities : ndarray of shape (m, n, K), float
        Each of ``m`` members' softmax probabilities on ``n`` samples.
    pairs : ndarray of shape (P, 2) or sequence of (i, j), int, optional
        Member index pairs, ``i != j``; default: all ``m (m - 1) / 2`` pairs ``i < j`` in
        row-major order. The value is symmetric: (i, j) and (j, i) give the same number.

    Returns
    -------
    values : ndarray of shape (P,), float64
        Each pair's mean mutual information in nats, in [0, log 2].
    pairs : ndarray of shape (P, 2), int64
        The pairs, in the order of ``values``.
    """
    function = "pairwise_mutual_information"
    _checks.probabilities(function, "member_probabilities", member_probabilities, ndim=3)
    members = member_probabilities.shape[0]
    index = _pairs(function, pairs, members)
    from posteriorzoo.metrics._kernels import pair_mixture_entropies

    member_entropy = np.array([_entropy(p).mean() for p in member_probabilities])
    mixture_entropy = pair_mixture_entropies(_kernel_input(member_probabilities),
                                             index[:, 0].copy(), index[:, 1].copy())
    values = mixture_entropy - 0.5 * (member_entropy[index[:, 0]] + member_entropy[index[:, 1]])
    # Non-negative per sample (Jensen); rounding can leave -1e-16 for identical members.
    return np.maximum(values, 0.0), index
