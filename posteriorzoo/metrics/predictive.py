"""Scores of predicted probabilities against labels, and the ensemble's predictive.

Every function takes numpy arrays: probabilities ``(n, K)`` (rows summing to 1) and
integer labels ``(n,)`` in ``0..K-1``, or the members' probabilities ``(m, n, K)``.
Bad input raises :class:`~posteriorzoo.errors.InvalidOptionError`.
"""

from __future__ import annotations

import numpy as np

from posteriorzoo._api import public
from posteriorzoo.metrics import _checks

#: The number of equal-width confidence bins of :func:`expected_calibration_error`
#: (Rank-1 BNN's choice and torch-uncertainty's; EMP uses 20: record which was used).
DEFAULT_ECE_BINS = 15


def _probabilities_and_labels(function: str, probabilities: np.ndarray, labels: np.ndarray
                              ) -> tuple[np.ndarray, np.ndarray]:
    _checks.probabilities(function, "probabilities", probabilities, ndim=2)
    n, classes = probabilities.shape
    return probabilities, _checks.class_labels(function, labels, n, classes)


@public
def accuracy(probabilities: np.ndarray, labels: np.ndarray) -> float:
    """Top-1 accuracy of predicted probabilities.

    Parameters
    ----------
    probabilities : ndarray of shape (n, K), float
        Predicted class probabilities; each row sums to 1.
    labels : ndarray of shape (n,), int
        True classes in ``0..K-1``.

    Returns
    -------
    float
        The fraction in [0, 1] of samples whose most probable class (the first one on a
        tie, as ``argmax``) is the label.
    """
    probabilities, labels = _probabilities_and_labels("accuracy", probabilities, labels)
    return float((probabilities.argmax(axis=1) == labels).mean())


@public
def negative_log_likelihood(probabilities: np.ndarray, labels: np.ndarray) -> float:
    """Mean negative log-likelihood of the labels under predicted probabilities.

    Parameters
    ----------
    probabilities : ndarray of shape (n, K), float
        Predicted class probabilities; each row sums to 1.
    labels : ndarray of shape (n,), int
        True classes in ``0..K-1``.

    Returns
    -------
    float
        ``-mean_i log p_i[y_i]`` in nats, in [0, 27.6]: probabilities are clipped below at
        1e-12 so that a zero probability gives a large finite loss, not infinity.
    """
    probabilities, labels = _probabilities_and_labels("negative_log_likelihood",
                                                      probabilities, labels)
    picked = probabilities[np.arange(labels.shape[0]), labels].astype(np.float64)
    return float(-np.log(np.clip(picked, 1e-12, None)).mean())


@public
def brier_score(probabilities: np.ndarray, labels: np.ndarray) -> float:
    """Multi-class Brier score: the mean squared distance to the one-hot label.

    Parameters
    ----------
    probabilities : ndarray of shape (n, K), float
        Predicted class probabilities; each row sums to 1.
    labels : ndarray of shape (n,), int
        True classes in ``0..K-1``.

    Returns
    -------
    float
        ``mean_i sum_k (p_ik - [y_i = k])^2``, in [0, 2] (Brier 1950's multi-class sum, not
        divided by K). For K = 2 it is twice scikit-learn's binary ``brier_score_loss``,
        which scores the positive class only. Lower is better.
    """
    probabilities, labels = _probabilities_and_labels("brier_score", probabilities, labels)
    difference = probabilities.astype(np.float64)  # a copy: the one-hot is subtracted in place
    difference[np.arange(labels.shape[0]), labels] -= 1.0
    return float(np.square(difference).sum(axis=1).mean())


@public
def expected_calibration_error(probabilities: np.ndarray, labels: np.ndarray,
                               bins: int = DEFAULT_ECE_BINS) -> float:
    """Top-label expected calibration error with equal-width confidence bins.

    Each sample's confidence is its largest probability and it is correct when that class
    (the first one on a tie) is the label. Confidences are put in ``bins`` equal-width bins
    of [0, 1] with edges ``e_b = b / bins``: bin ``b`` holds ``e_b <= c < e_{b+1}`` (closed
    on the left, open on the right), except the last, ``[1 - 1/bins, 1]``, which is closed
    so that a confidence of exactly 1.0 falls in it. This is the binning of torchmetrics'
    ``CalibrationError``, which torch-uncertainty (the paper authors' library) wraps.

    Parameters
    ----------
    probabilities : ndarray of shape (n, K), float
        Predicted class probabilities; each row sums to 1.
    labels : ndarray of shape (n,), int
        True classes in ``0..K-1``.
    bins : int
        Number of bins, at least 1 (default 15; EMP's paper uses 20).

    Returns
    -------
    float
        ``sum_b (n_b / n) |acc_b - conf_b|`` in [0, 1], where ``n_b`` is the number of
        samples in bin ``b`` and ``acc_b``, ``conf_b`` their accuracy and mean confidence;
        empty bins contribute nothing. Multiply by 100 for the paper's percentages.
    """
    function = "expected_calibration_error"
    probabilities, labels = _probabilities_and_labels(function, probabilities, labels)
    bins = _checks.positive_int(function, "bins", bins)
    confidence = probabilities.max(axis=1).astype(np.float64)
    correct = (probabilities.argmax(axis=1) == labels).astype(np.float64)
    # b / bins is correctly rounded, so a confidence written 0.6 lands on the edge 3 / 5;
    # linspace's b * (1 / bins) gives 0.6000000000000001 and would move it a bin down.
    edges = np.arange(bins + 1) / bins
    # side="right" puts a confidence equal to an edge in the bin that starts there; the
    # clip moves 1.0 (past the last edge) into the last bin.
    index = np.clip(np.searchsorted(edges, confidence, side="right") - 1, 0, bins - 1)
    # (n_b / n) |acc_b - conf_b| = |sum of correct in b - sum of confidences in b| / n.
    correct_sum = np.bincount(index, weights=correct, minlength=bins)
    confidence_sum = np.bincount(index, weights=confidence, minlength=bins)
    return float(np.abs(correct_sum - confidence_sum).sum() / labels.shape[0])


@public
def posterior_predictive(member_probabilities: np.ndarray) -> np.ndarray:
    """The ensemble's (Bayesian model average's) predictive: the members' mean probabilities.

    Parameters
    ----------
    member_probabilities : ndarray of shape (m, n, K), float
        Each of ``m`` members' (posterior samples') softmax probabilities on ``n`` samples.

    Returns
    -------
    ndarray of shape (n, K), float64
        ``mean_m p_m``: rows in [0, 1] summing to 1.
    """
    _checks.probabilities("posterior_predictive", "member_probabilities",
                          member_probabilities, ndim=3)
    return member_probabilities.mean(axis=0, dtype=np.float64)


# Distances in function space: the NeurIPS 2021 approximate-inference competition's
# metrics (Wilson et al. 2022, "Evaluating Approximate Inference in Bayesian Deep
# Learning"), which score a method's predictive against a reference predictive (there,
# full-batch HMC's) on the same test inputs.


def _two_predictives(function: str, probabilities: np.ndarray, reference: np.ndarray
                     ) -> None:
    _checks.probabilities(function, "probabilities", probabilities, ndim=2)
    _checks.probabilities(function, "reference", reference, ndim=2)
    if probabilities.shape != reference.shape:
        _checks.fail(function, f"probabilities {probabilities.shape} and reference "
                               f"{reference.shape} must have the same shape (the same "
                               "test inputs, in the same order, and classes)")


def _agreement(first: np.ndarray, second: np.ndarray) -> float:
    return float((first.argmax(axis=1) == second.argmax(axis=1)).mean())


def _total_variation(first: np.ndarray, second: np.ndarray) -> float:
    difference = first.astype(np.float64) - second.astype(np.float64)
    return float(0.5 * np.abs(difference).sum(axis=1).mean())


@public
def agreement(probabilities: np.ndarray, reference: np.ndarray) -> float:
    """The share of inputs on which two predictives pick the same class.

    The competition's first metric: a method that predicts as the reference posterior
    does scores 1 whatever its calibration, so it measures the decisions, not the
    probabilities (:func:`total_variation` measures those).

    Parameters
    ----------
    probabilities : ndarray of shape (n, K), float
        The method's predictive (:func:`posterior_predictive`).
    reference : ndarray of shape (n, K), float
        The reference predictive on the same ``n`` inputs, in the same order.

    Returns
    -------
    float
        ``mean_i [argmax_k p_ik = argmax_k q_ik]`` in [0, 1]; a tie picks the first of the
        tied classes, as ``argmax``.
    """
    _two_predictives("agreement", probabilities, reference)
    return _agreement(probabilities, reference)


@public
def total_variation(probabilities: np.ndarray, reference: np.ndarray) -> float:
    """The mean total-variation distance between two predictives.

    The competition's second metric: per input, the largest difference in probability
    the two predictives give any event (set of classes), which is half their L1 distance.

    Parameters
    ----------
    probabilities : ndarray of shape (n, K), float
        The method's predictive (:func:`posterior_predictive`).
    reference : ndarray of shape (n, K), float
        The reference predictive on the same ``n`` inputs, in the same order.

    Returns
    -------
    float
        ``mean_i 0.5 sum_k |p_ik - q_ik|``, computed in float64: 0 for equal
        predictives, 1 for one-hot predictives that pick different classes everywhere;
        in [0, 1] (to within the rows' sums' tolerance). Symmetric, and a metric.
    """
    _two_predictives("total_variation", probabilities, reference)
    return _total_variation(probabilities, reference)


@public
def predictive_noise(members: np.ndarray, held_out: int, splits: int, seed: int
                     ) -> dict[str, np.ndarray]:
    """The noise band of :func:`agreement` and :func:`total_variation` against a target.

    A method of ``held_out`` samples scored against a target of ``m`` members is only
    meaningful next to what another draw of the target scores: each split draws
    ``held_out`` of the members without replacement, and compares their predictive (as a
    method's) with the predictive of the other ``m - held_out`` members (as the target's).
    This is the function-space analogue of :func:`posteriorzoo.mmd.noise.noise_floor`;
    the band is the splits' 5th to 95th percentile (``BAND_PERCENTILES`` there).

    Memory is the members and two ``(n, K)`` float64 sums: all members are summed once,
    and each split's remaining members' predictive is ``(total - drawn sum) / (m -
    held_out)``.

    Parameters
    ----------
    members : ndarray of shape (m, n, K), float
        The target's members' probabilities (:func:`posterior_predictive`'s input).
    held_out : int
        Members drawn per split (the methods' sample size), ``1 <= held_out <= m - 1``.
    splits : int
        Number of splits, at least 1.
    seed : int
        Seed of :func:`numpy.random.default_rng`; split ``s`` holds out
        ``rng.permutation(m)[:held_out]``, the ``s``-th permutation drawn from it.

    Returns
    -------
    dict
        ``{"agreement": (splits,), "total_variation": (splits,)}`` float64 arrays.
    """
    function = "predictive_noise"
    _checks.probabilities(function, "members", members, ndim=3)
    count = members.shape[0]
    splits = _checks.positive_int(function, "splits", splits)
    if isinstance(held_out, bool | np.bool_) or not 1 <= held_out <= count - 1:
        _checks.fail(function, f"held_out must lie in 1..{count - 1} (the target's "
                               f"{count} members, at least one kept), not {held_out!r}")
    if isinstance(seed, bool | np.bool_) or seed < 0:
        _checks.fail(function, f"seed must be a non-negative integer, not {seed!r}")
    held_out = int(held_out)
    rng = np.random.default_rng(int(seed))
    total = members.sum(axis=0, dtype=np.float64)
    drawn = np.empty_like(total)
    values = {"agreement": np.empty(splits), "total_variation": np.empty(splits)}
    for split in range(splits):
        chosen = np.sort(rng.permutation(count)[:held_out])   # sorted: reads in order
        drawn[...] = 0.0
        for index in chosen:                     # one member at a time: O(n K) memory
            drawn += members[index]
        rest = (total - drawn) / (count - held_out)
        method = drawn / held_out
        values["agreement"][split] = _agreement(method, rest)
        values["total_variation"][split] = _total_variation(method, rest)
    return values
