"""The pure predictive metrics: hand-computed values, scikit-learn, and bad input.

Tolerances (issue 30 section 1): every metric here is float64 arithmetic on float64 (or
float32) inputs drawn from numpy Generators, whose draws are the same bits on every CPU;
the roundings differ between implementations (numpy's pairwise sums, the numba kernels'
sequential ones, scikit-learn's, a hand formula's) and between instruction sets (numpy's
AVX-512 logarithm is SVML's, AVX2's glibc's). Each comparison is bounded by Higham's
``gamma(k, U64) = k u / (1 - k u)`` (``u = 2^-53``) of the terms' scale, k the roundings on
the longest path, plus :data:`LOG_ROUNDING` per logarithm (``tests/rounding_bounds.py``);
decimal inputs add their own rounding to float64 where a hand value is written in
decimals. Where the result is exact (integer counts, binary fractions, one correctly
rounded division of integers), equality is asserted. The bounds are 1e-16 to 1e-13;
a wrong formula moves these values by 1e-3 or more. Measured margins are stated where
the bounds are used (observed / bound, with AVX-512 and under the AVX2 settings).
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
from rounding_bounds import U32, U64, gamma
from scipy.special import entr
from sklearn.metrics import average_precision_score, brier_score_loss, roc_curve

from posteriorzoo.errors import InvalidOptionError
from posteriorzoo.metrics import (
    accuracy,
    aupr,
    brier_score,
    entropy,
    expected_calibration_error,
    fpr_at_95_recall,
    mean_mutual_information,
    mutual_information,
    negative_log_likelihood,
    ood_scores,
    pairwise_mutual_information,
    posterior_predictive,
)

LOG2 = math.log(2)

#: A float64 logarithm's relative error: numpy's AVX-512 loops (SVML) promise 4 ulp,
#: glibc's ``log`` (math.log, scipy's ``entr``, numba's ``np.log``) less than 1. An ulp is
#: at most 2 u of the value: 8 u.
LOG_ROUNDING = 8 * U64


def _entropy_terms(probabilities) -> np.ndarray:
    """``-p log p`` summed over the last axis, float64 (the exact value, to first order)."""
    return entr(np.asarray(probabilities, dtype=np.float64)).sum(axis=-1)


def _mi_rounding(members) -> np.ndarray:
    """Per sample ``(n,)``: how far one float64 evaluation of the mutual information of
    ``members`` ``(m, n, K)``, its sums in any order, may be from the exact value of the
    stored numbers (first order in u).

    The predictive's m-term sum and division put each ``P_k`` within ``gamma(m + 1)`` of
    itself, which moves ``-P log P`` by ``gamma(m + 1) P |1 + log P|`` (mean value
    theorem; ``P = 0`` only where every member is 0: exact). Each entropy's K terms
    ``-p log p`` are non-negative, each within ``LOG_ROUNDING + u`` (logarithm, product),
    their sum ``gamma(K - 1)`` more: ``(LOG_ROUNDING + gamma(K + 1)) H``. The members'
    mean entropy adds m terms and a division, ``gamma(m + 1)`` of it; the difference one
    rounding, the clip at 0 none (1-Lipschitz)."""
    p = np.asarray(members, dtype=np.float64)
    count, _, classes = p.shape
    predictive = p.mean(axis=0)
    h_predictive, h_members = _entropy_terms(predictive), _entropy_terms(p).mean(axis=0)
    slope = np.abs(1 + np.log(np.where(predictive > 0, predictive, 1.0)))
    return (gamma(count + 1, U64) * (predictive * slope).sum(axis=-1)
            + (LOG_ROUNDING + gamma(classes + 1, U64)) * (h_predictive + h_members)
            + (gamma(count + 1, U64) + U64) * h_members + U64 * h_predictive)


def _mean_mi_rounding(members) -> float:
    """:func:`_mi_rounding` of a mean over the n samples, however it is summed (the
    per-sample differences averaged, or each entropy averaged before the difference):
    n terms and a division, twice, ``gamma(n + 3)`` of the entropies' means."""
    p = np.asarray(members, dtype=np.float64)
    scale = _entropy_terms(p.mean(axis=0)).mean() + _entropy_terms(p).mean()
    return float(_mi_rounding(p).mean()) + gamma(p.shape[1] + 3, U64) * float(scale)


def _brier_rounding(probabilities, labels) -> float:
    """One float64 evaluation's distance from the exact Brier score of the stored numbers:
    each term ``(p - y)^2`` is non-negative, within 3 roundings (the difference, the
    square), its row sum adds ``K - 1``, the mean ``n``: ``gamma(n + K + 2)`` of it."""
    n, classes = probabilities.shape
    onehot = np.eye(classes)[labels]
    exact = float(np.square(probabilities - onehot).sum(axis=1).mean())
    return gamma(n + classes + 2, U64) * exact


def _dirichlet(rng, shape, classes, concentration=0.5):
    """Random probability vectors (``shape + (classes,)``), rows summing to 1."""
    return rng.dirichlet(np.full(classes, concentration), size=shape)


# --- posterior predictive, Brier ------------------------------------------------------------

def test_posterior_predictive_is_the_members_mean_in_float64():
    members = np.array([[[0.8, 0.2], [0.4, 0.6]],
                        [[0.6, 0.4], [0.2, 0.8]]], dtype=np.float32)
    predictive = posterior_predictive(members)
    # (0.8 + 0.6) / 2 = 0.7, (0.2 + 0.4) / 2 = 0.3; (0.4 + 0.2) / 2 = 0.3, (0.6 + 0.8) / 2 = 0.7
    # The float32 inputs are within U32 of the decimals (so their mean is), the float64
    # sum rounds once (u), the literal too: U32 + 2 u < U32 + gamma(3, U64). A float32
    # mean would add up to U32 more; measured 0.43 of the bound (the inputs' rounding).
    np.testing.assert_allclose(predictive, [[0.7, 0.3], [0.3, 0.7]],
                               rtol=U32 + gamma(3, U64), atol=0)
    assert predictive.dtype == np.float64 and predictive.shape == (2, 2)


def test_brier_score_by_hand():
    probabilities = np.array([[0.7, 0.3], [0.2, 0.8], [0.6, 0.4]])
    labels = np.array([0, 1, 1])
    # (0.7-1)^2 + 0.3^2 = 0.18; 0.2^2 + (0.8-1)^2 = 0.08; 0.6^2 + (0.4-1)^2 = 0.72
    expected = (0.18 + 0.08 + 0.72) / 3
    # the float64 evaluation (_brier_rounding), the decimal inputs' rounding (u p each,
    # moving a term by 2 |p - y| u p: at most 2 u per row), the literal's three decimals,
    # their sum and division (gamma(4) of it, all positive). Measured: equal.
    bound = (_brier_rounding(probabilities, labels) + 2 * U64
             + gamma(4, U64) * expected)
    assert abs(brier_score(probabilities, labels) - expected) <= bound
    assert brier_score(np.eye(3), np.arange(3)) == 0.0
    # certain of the wrong class: (1-0)^2 + (0-1)^2 = 2, the top of the range (small
    # integers: every operation exact)
    assert brier_score(np.array([[0.0, 1.0]]), np.array([0])) == 2.0


def test_brier_score_against_scikit_learn():
    rng = np.random.default_rng(0)
    binary = _dirichlet(rng, 200, 2)
    labels = rng.integers(0, 2, 200)
    # scikit-learn's binary score looks at the positive class only: half the class sum.
    # It rebuilds p0 as 1 - p1, which differs from the stored p0 by the row's distance d
    # of its sum from 1 (the Dirichlet draw's normalisation) plus that subtraction's
    # rounding: a term (p0 - y0)^2 moves by at most 2 |p0 - y0| d + d^2. Both sides'
    # evaluations add _brier_rounding (K + 1: scikit-learn's extra subtraction).
    # Measured: equal in both cases.
    ours, theirs = brier_score(binary, labels), 2 * brier_score_loss(labels, binary[:, 1])
    distance = (np.abs([math.fsum((*row, -1.0)) for row in binary]) * (1 + U64)
                + U64 * np.abs(1 - binary[:, 1]))
    moved = float((2 * np.abs(binary[:, 0] - (labels == 0)) * distance + distance ** 2).mean())
    bound = moved + 2 * gamma(200 + 2 + 3, U64) * ours
    assert abs(ours - theirs) <= bound, (ours, theirs, bound)
    multi = _dirichlet(rng, 300, 5)
    labels = rng.integers(0, 5, 300)
    # the same formula on the same numbers, summed in other orders
    ours = brier_score(multi, labels)
    theirs = brier_score_loss(labels, multi, labels=np.arange(5), scale_by_half=False)
    assert abs(ours - theirs) <= 2 * _brier_rounding(multi, labels)


def test_accuracy_and_nll_still_agree_with_the_closed_form():
    probabilities = np.array([[0.7, 0.3], [0.2, 0.8], [0.6, 0.4]])
    labels = np.array([0, 1, 1], dtype=np.int32)
    # the mean of (True, False, True): 2 / 3 correctly rounded, as the literal
    assert accuracy(probabilities, labels) == 2 / 3
    logs = [math.log(0.7), math.log(0.8), math.log(0.4)]
    expected = -sum(logs) / 3
    # the same stored inputs; each side's three logarithms (LOG_ROUNDING: numpy's and
    # libm's differ), two additions and a division, gamma(3) more, of sum |log p| / 3.
    # Measured: equal.
    bound = 2 * (LOG_ROUNDING + gamma(3, U64)) * sum(abs(x) for x in logs) / 3
    assert abs(negative_log_likelihood(probabilities, labels) - expected) <= bound


# --- ECE -----------------------------------------------------------------------------------

def _binary(confidences, correct):
    """Two-class probabilities with these top-class confidences; label 0 when correct."""
    confidences = np.asarray(confidences, dtype=np.float64)
    probabilities = np.stack([confidences, 1.0 - confidences], axis=1)
    return probabilities, np.where(correct, 0, 1)


def test_ece_on_known_bins():
    # 5 bins, edges 0, .2, .4, .6, .8, 1, closed on the left; 1.0 goes in the last bin
    probabilities, labels = _binary([0.6, 0.7, 1.0, 0.9, 0.8, 0.55],
                                    [True, False, True, True, False, True])
    # [0.4, 0.6): {0.55 right}          -> |1 - 0.55|             = 0.45
    # [0.6, 0.8): {0.6 right, 0.7 wrong} -> |1 - (0.6 + 0.7)|      = 0.30
    # [0.8, 1.0]: {1.0 right, 0.9 right, 0.8 wrong} -> |2 - 2.7|  = 0.70
    # ECE = sum_b (n_b / n) |acc_b - conf_b| = sum_b |correct_b - sum conf_b| / n
    expected = (0.45 + 0.30 + 0.70) / 6
    # The evaluation: each bin's confidence sum (at most n terms), its difference with
    # the count, the sum over bins and the division: gamma(n + bins + 2) of
    # (correct + sum of confidences) / n; the decimal inputs' rounding, u of the
    # confidences' sum / n; the literal's decimals, sum and division, gamma(4) of it.
    # Measured: equal.
    bound = (gamma(6 + 5 + 2, U64) * (4 + 4.55) / 6 + U64 * 4.55 / 6
             + gamma(4, U64) * expected)
    assert abs(expected_calibration_error(probabilities, labels, bins=5) - expected) <= bound
    # Bins closed on the right instead, (lo, hi], would give (0.85 + 1.5 + 0.1) / 6:
    # 0.41 against 0.24, far beyond any rounding.
    assert abs(expected - (0.85 + 1.5 + 0.1) / 6) > 0.1


def test_ece_with_one_bin_is_the_accuracy_confidence_gap():
    rng = np.random.default_rng(1)
    probabilities = _dirichlet(rng, 500, 4)
    labels = rng.integers(0, 4, 500)
    correct, confidence = accuracy(probabilities, labels), probabilities.max(axis=1).mean()
    gap = abs(correct - confidence)
    # |count - sum of confidences| / n against |count / n - mean confidence|: each side
    # an n-term sum, a division and a subtraction, gamma(n + 2) of accuracy + mean
    # confidence. Measured 0.0012 of the bound.
    bound = 2 * gamma(500 + 2, U64) * (correct + confidence)
    assert abs(expected_calibration_error(probabilities, labels, bins=1) - gap) <= bound


def test_ece_of_a_calibrated_and_an_overconfident_predictor():
    # confidence 0.75 and 3 out of 4 right: perfectly calibrated, ECE 0 (0.75 and its
    # sums are binary fractions: every operation exact)
    probabilities, labels = _binary([0.75] * 4, [True, True, True, False])
    assert expected_calibration_error(probabilities, labels) == 0.0
    # certain and always wrong: |0 - 1| = 1, the top of the range (exact: |0 - 3| / 3)
    probabilities, labels = _binary([1.0] * 3, [False] * 3)
    assert expected_calibration_error(probabilities, labels) == 1.0


def test_ece_default_bins_is_15():
    rng = np.random.default_rng(2)
    probabilities = _dirichlet(rng, 400, 3)
    labels = rng.integers(0, 3, 400)
    assert expected_calibration_error(probabilities, labels) == \
        expected_calibration_error(probabilities, labels, bins=15)
    assert expected_calibration_error(probabilities, labels) != \
        expected_calibration_error(probabilities, labels, bins=3)


# --- entropy and mutual information ---------------------------------------------------------

def test_entropy_by_hand():
    values = entropy(np.array([[0.25] * 4, [1.0, 0.0, 0.0, 0.0], [0.5, 0.5, 0.0, 0.0]]))
    # binary-fraction inputs: the entropy's own rounding, (LOG_ROUNDING + gamma(K + 1)) of
    # it, and math.log's (LOG_ROUNDING); log 1 = 0 and 0 log 0 = 0 exactly. Measured:
    # equal.
    np.testing.assert_allclose(values, [math.log(4), 0.0, LOG2],
                               rtol=2 * LOG_ROUNDING + gamma(4 + 1, U64), atol=0)


def test_mutual_information_is_zero_when_members_agree():
    rng = np.random.default_rng(3)
    one = _dirichlet(rng, 50, 6)
    members = np.stack([one, one, one])
    # 0 exactly, up to one evaluation's rounding (the predictive (p + p + p) / 3 need not
    # round back to p): _mi_rounding, 1e-15 here; measured 0.064 of it (the mean: 0.0015).
    bound = _mi_rounding(members)
    assert (np.abs(mutual_information(members)) <= bound).all()
    assert abs(mean_mutual_information(members)) <= _mean_mi_rounding(members)


def test_mutual_information_of_two_certain_disagreeing_members_is_log_2():
    members = np.array([[[1.0, 0.0, 0.0]], [[0.0, 1.0, 0.0]]])
    # H((1/2, 1/2, 0)) - (H(one-hot) + H(one-hot)) / 2 = log 2 - 0; binary fractions, so
    # only the logarithms (LOG_ROUNDING each side) and the two terms' sum round
    np.testing.assert_allclose(mutual_information(members), [LOG2],
                               rtol=2 * LOG_ROUNDING + gamma(2, U64), atol=0)


def test_mutual_information_by_hand():
    members = np.array([[[1.0, 0.0]], [[0.5, 0.5]]])
    # mean (0.75, 0.25): H = -(0.75 log 0.75 + 0.25 log 0.25) = 0.562335
    # members: H(1, 0) = 0, H(0.5, 0.5) = log 2 = 0.693147; mean 0.346574
    expected = -(0.75 * math.log(0.75) + 0.25 * math.log(0.25)) - LOG2 / 2
    # the comment's value shown to six decimals: within half a unit of the last
    assert abs(expected - 0.215762) <= 5e-7
    # exact inputs; the formula's three logarithms, two products, a sum and a
    # subtraction (LOG_ROUNDING + gamma(4) of its terms), and the function's _mi_rounding.
    # Measured: equal.
    terms = 0.75 * abs(math.log(0.75)) + 0.25 * abs(math.log(0.25)) + LOG2 / 2
    bound = (LOG_ROUNDING + gamma(4, U64)) * terms + _mi_rounding(members)
    assert (np.abs(mutual_information(members) - expected) <= bound).all()


def test_mean_mutual_information_is_the_mean_over_samples():
    rng = np.random.default_rng(4)
    members = _dirichlet(rng, (5, 40), 10).astype(np.float32)
    per_sample = mutual_information(members)
    assert per_sample.shape == (40,) and per_sample.dtype == np.float64
    # MI <= s log m for members whose rows sum to at most s (P_k >= p_mk / m): the
    # float32 rows sum to 1 only within float32 rounding, so s is their largest sum
    # (its float64 sum within gamma(K) of itself); plus the evaluation's rounding.
    # Measured: the largest MI is 0.48 of this limit.
    largest = members.sum(axis=2, dtype=np.float64).max() * (1 + gamma(10, U64))
    limit = math.log(5) * largest + _mi_rounding(members)
    assert (per_sample >= 0).all() and (per_sample <= limit).all()
    # the same function's values, averaged by the same numpy mean: bit for bit
    assert mean_mutual_information(members) == per_sample.mean()


# --- pairwise mutual information ------------------------------------------------------------

def test_pairwise_mi_of_two_certain_disagreeing_members():
    members = np.array([[[1.0, 0.0], [0.0, 1.0]],
                        [[0.0, 1.0], [0.0, 1.0]]])
    values, pairs = pairwise_mutual_information(members)
    # sample 1: they disagree, log 2; sample 2: they agree, 0; mean over samples log 2 / 2
    # (binary fractions: the logarithms' and the sums' rounding only)
    np.testing.assert_allclose(values, [LOG2 / 2], rtol=2 * LOG_ROUNDING + gamma(4, U64),
                               atol=0)
    np.testing.assert_array_equal(pairs, [[0, 1]])


def test_pairwise_mi_is_the_mi_of_each_two_member_ensemble():
    rng = np.random.default_rng(5)
    members = _dirichlet(rng, (4, 30), 5)
    values, pairs = pairwise_mutual_information(members)
    np.testing.assert_array_equal(pairs, [[0, 1], [0, 2], [0, 3], [1, 2], [1, 3], [2, 3]])
    expected = [mean_mutual_information(members[[i, j]]) for i, j in pairs]
    # two evaluations of one mean MI, their sums in other orders: each within
    # _mean_mi_rounding (at most 1.3e-14 here); measured at most 0.019 of it
    bound = [2 * _mean_mi_rounding(members[[i, j]]) for i, j in pairs]
    assert (np.abs(values - expected) <= bound).all()
    assert (values > 0).all() and (values <= LOG2).all()


def test_pairwise_mi_is_symmetric_and_takes_chosen_pairs():
    rng = np.random.default_rng(6)
    members = _dirichlet(rng, (3, 25), 4)
    values, pairs = pairwise_mutual_information(members, pairs=[(2, 0), (0, 2), (1, 2)])
    # (p_2 + p_0) and (H_2 + H_0) are the same IEEE sums as (p_0 + p_2), (H_0 + H_2):
    # addition commutes, so the two pairs' values are equal bit for bit
    assert values[0] == values[1]
    np.testing.assert_array_equal(pairs, [[2, 0], [0, 2], [1, 2]])
    same, _ = pairwise_mutual_information(members, pairs=np.array([[1, 2]]))
    assert same[0] == values[2]


def _numpy_entropy(probabilities):
    return entr(np.asarray(probabilities, dtype=np.float64)).sum(axis=-1)


@pytest.mark.parametrize("dtype", [np.float32, np.float64, ">f8", np.int64])
def test_kernels_match_the_numpy_formulas(dtype):
    """The one-pass numba kernels against the formulas written with NumPy and scipy's
    entr (float32 and float64, a big-endian and an integer array, exact zeros, a view)."""
    rng = np.random.default_rng(7)
    members = _dirichlet(rng, (7, 300), 5)
    members[0, :3] = [1.0, 0.0, 0.0, 0.0, 0.0]            # 0 log 0 = 0
    if np.dtype(dtype).kind == "i":
        members = np.eye(5)[rng.integers(0, 5, size=(7, 300))]
    members = members.astype(dtype)
    view = members[:, ::2]                                   # not contiguous
    for array in (members, view):
        mean = array.mean(axis=0, dtype=np.float64)
        expected = sum(_numpy_entropy(member) for member in array) / len(array)
        reference = np.maximum(_numpy_entropy(mean) - expected, 0.0)
        # the same formula summed in other orders (the kernels sequentially, numpy
        # pairwise, scipy's entr against numba's log): each side within _mi_rounding
        # (at most 6.5e-15 per sample here); measured: equal (the pairs' means below:
        # at most 0.033 of their bound)
        assert (np.abs(mutual_information(array) - reference)
                <= 2 * _mi_rounding(array)).all()
        values, pairs = pairwise_mutual_information(array)
        for (i, j), value in zip(pairs, values, strict=True):
            mixture = 0.5 * (array[i].astype(np.float64) + array[j])
            pair = (_numpy_entropy(mixture)
                    - 0.5 * (_numpy_entropy(array[i]) + _numpy_entropy(array[j]))).mean()
            assert abs(value - max(pair, 0.0)) <= 2 * _mean_mi_rounding(array[[i, j]])


# --- OOD scores, AUPR, FPR95 ----------------------------------------------------------------

def test_ood_scores_by_hand():
    members = np.array([[[0.8, 0.2], [1.0, 0.0]],
                        [[0.6, 0.4], [0.0, 1.0]]])
    # predictive (0.7, 0.3) and (0.5, 0.5): 1 - max = 0.3 and 0.5. Sample 1 rounds the
    # decimal inputs (u of 0.8 and 0.6: u 0.7 in their mean), the sum (u 0.7), 1 - P
    # (u 0.3) and the literal (u 0.3): 2 u; sample 2 is exact. Measured 0.25 of it.
    np.testing.assert_allclose(ood_scores(members), [0.3, 0.5], rtol=0,
                               atol=gamma(2, U64))
    assert np.array_equal(ood_scores(members, score="max-probability"), ood_scores(members))
    # sample 2: two certain members of different classes, MI = log 2; the score is the
    # same function's value (ensemble_summary), bit for bit
    np.testing.assert_array_equal(ood_scores(members, score="mutual-information"),
                                  mutual_information(members))
    assert ood_scores(members, score="mutual-information")[1] == pytest.approx(
        LOG2, rel=2 * LOG_ROUNDING + gamma(2, U64), abs=0)


def test_higher_scores_mean_more_ood():
    confident = np.tile(np.array([[[0.98, 0.01, 0.01]]]), (2, 10, 1))   # agreeing, certain
    confused = np.tile(np.array([[[0.9, 0.05, 0.05]], [[0.05, 0.9, 0.05]]]), (1, 10, 1))
    for score in ("max-probability", "mutual-information"):
        assert ood_scores(confused, score=score).min() > ood_scores(confident, score=score).max()
        assert aupr(ood_scores(confident, score=score), ood_scores(confused, score=score)) == 1.0
        assert fpr_at_95_recall(ood_scores(confident, score=score),
                                ood_scores(confused, score=score)) == 0.0


def test_aupr_by_hand():
    # ranked: 0.8 OOD, 0.4 ID, 0.35 OOD, 0.1 ID (OOD is the positive class)
    # AP = sum (R_t - R_t-1) P_t = 0.5 * 1 (at 0.8) + 0.5 * 2/3 (at 0.35) = 5/6. The
    # recalls and steps are exact; fl(2/3) (u 2/3, halved), the sum (u 5/6) and the
    # literal 5/6 (u 5/6) round: 2 u, 2.4 u of 5/6. Measured 0.4 of the bound.
    assert aupr(np.array([0.1, 0.4]), np.array([0.35, 0.8])) == pytest.approx(
        5 / 6, rel=gamma(3, U64), abs=0)


@pytest.mark.parametrize("seed", range(12))
def test_aupr_is_scikit_learns_average_precision_to_the_bit(seed):
    # The oracle: scikit-learn's average_precision_score, on scores with many ties
    # (rounded), ties across the classes, a single OOD sample, all scores equal, and
    # separable scores both ways.
    rng = np.random.default_rng(seed)
    n_id, n_ood = rng.integers(1, 400), rng.integers(1, 200)
    decimals = int(rng.integers(0, 4))
    id_scores = rng.normal(0.0, 1.0, n_id).round(decimals)
    ood = rng.normal(rng.uniform(-1, 3), 1.0, n_ood).round(decimals)
    cases = [(id_scores, ood), (id_scores, ood[:1]), (np.zeros(n_id), np.zeros(n_ood)),
             (id_scores - 10, ood + 10), (id_scores + 10, ood - 10)]
    for id_case, ood_case in cases:
        truth = np.r_[np.zeros(id_case.size), np.ones(ood_case.size)]
        expected = average_precision_score(truth, np.r_[id_case, ood_case])
        assert aupr(id_case, ood_case) == expected


def test_fpr95_torch_uncertainty_cases():
    # torch-uncertainty's own tests of FPR95: 99 OOD at 1.0 and one ID at 0.99 -> 0
    assert fpr_at_95_recall(np.array([0.99]), np.ones(99)) == 0.0
    # 100 OOD at 0.9; ID 50 at 0.95 (flagged at any threshold that catches OOD), 50 at 0.85
    assert fpr_at_95_recall(np.r_[np.full(50, 0.95), np.full(50, 0.85)],
                            np.full(100, 0.9)) == 0.5


def test_fpr95_takes_the_first_threshold_reaching_the_recall():
    # 20 OOD scored 20, 19, ..., 1: recall 19/20 = 0.95 exactly from the threshold 2 on.
    # Only the ID sample 19.5 is at or above 2: FPR = 1/3 (the lower thresholds in (1, 2)
    # keep the recall at 0.95 but would also flag 1.5: 2/3).
    # (a count over the ID samples, one correctly rounded division of integers: exact)
    assert fpr_at_95_recall(np.array([19.5, 1.5, 0.5]),
                            np.arange(20, 0, -1, dtype=float)) == 1 / 3


def test_fpr95_needs_at_least_95_percent_recall():
    # 10 OOD scored 10..1: recall 0.9 is as far from 0.95 as 1.0, but below it; recall 1
    # (threshold 1) flags the ID samples 11, 5.5 and 1.0: 3/4.
    assert fpr_at_95_recall(np.array([11.0, 5.5, 1.0, 0.5]),
                            np.arange(10, 0, -1, dtype=float)) == 3 / 4


def test_fpr95_with_450_ood_samples_stops_at_the_428th():
    # 0.95 x 450 = 427.5: the audit's case. OOD scored 450..1, one ID sample between each
    # pair of OOD scores (449.5, ..., 0.5). The first threshold with recall >= 0.95 is the
    # 428th OOD score (23): the ID samples 449.5 ... 23.5 are flagged, 427 of 450.
    ood = np.arange(450, 0, -1, dtype=float)
    assert fpr_at_95_recall(ood - 0.5, ood) == 427 / 450       # one division of integers


def _fpr95_from_roc_curve(id_scores, ood):
    """scikit-learn's ROC curve read at the first true positive rate >= 0.95."""
    truth = np.r_[np.zeros(id_scores.size), np.ones(ood.size)]
    fpr, tpr, _ = roc_curve(truth, np.r_[id_scores, ood], drop_intermediate=False)
    return fpr[np.flatnonzero(tpr >= 0.95)[0]]


def _torch_uncertainty_fpr95():
    """torch-uncertainty's own FPR95 (0.13), loaded from its module file alone: the package's
    ``__init__`` imports torchvision, which has no working CPU build here. Skips when the
    oracle is not installed (``make test`` installs it)."""
    import importlib.util

    spec = importlib.util.find_spec("torch_uncertainty")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("torch-uncertainty (test oracle) is not installed")
    path = Path(spec.submodule_search_locations[0]) / "metrics/classification/fpr.py"
    module_spec = importlib.util.spec_from_file_location("_tu_fpr", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module.FPR95


@pytest.mark.parametrize(("seed", "n_id", "n_ood", "decimals"),
                         [(0, 300, 137, None), (1, 500, 213, None), (2, 200, 97, 1),
                          (3, 400, 140, 1), (4, 50, 33, 0)])
def test_fpr95_against_roc_curve(seed, n_id, n_ood, decimals):
    rng = np.random.default_rng(seed)
    id_scores = rng.normal(0.0, 1.0, n_id)
    ood = rng.normal(1.5, 1.0, n_ood)
    if decimals is not None:   # tied scores: one operating point per distinct score
        id_scores, ood = id_scores.round(decimals), ood.round(decimals)
    expected = _fpr95_from_roc_curve(id_scores, ood)
    # scikit-learn's FPR is its integer count of false positives divided by n_id in
    # float64, correctly rounded as ours: the same operating point gives the same bits
    # (and its TPR >= 0.95 picks the point our 20 TP >= 19 n_ood does: k / n_ood is
    # 0.95 exactly or at least 1 / (20 n_ood) away, far beyond its rounding)
    assert fpr_at_95_recall(id_scores, ood) == expected
    assert 0.0 < expected < 1.0


@pytest.mark.parametrize(("seed", "n_id", "n_ood", "decimals"),
                         [(0, 300, 137, None), (2, 200, 97, 1), (3, 400, 140, 1),
                          (4, 50, 33, 0), (5, 10000, 450, None), (6, 1000, 450, 2),
                          (7, 100, 20, 0)])
def test_fpr95_equals_torch_uncertainty(seed, n_id, n_ood, decimals):
    torch = pytest.importorskip("torch")
    metric = _torch_uncertainty_fpr95()(pos_label=1)
    rng = np.random.default_rng(seed)
    id_scores = rng.normal(0.0, 1.0, n_id)
    ood = rng.normal(1.5, 1.0, n_ood)
    if decimals is not None:
        id_scores, ood = id_scores.round(decimals), ood.round(decimals)
    metric.update(torch.as_tensor(np.r_[id_scores, ood]),
                  torch.as_tensor(np.r_[np.zeros(n_id), np.ones(n_ood)]).long())
    expected = float(metric.compute())
    # torch-uncertainty divides the same integer counts in float32 (its recall >= 0.95
    # picks the same point: k / n_ood is 0.95 exactly or 1 / (20 n_ood) >> U32 away):
    # one float32 rounding of the quotient against our float64 one
    ours = fpr_at_95_recall(id_scores, ood)
    assert abs(ours - expected) <= (U32 + 2 * U64) * ours


# --- bad input ------------------------------------------------------------------------------

P = np.array([[0.7, 0.3], [0.2, 0.8], [0.6, 0.4]])
Y = np.array([0, 1, 1])
M = np.stack([P, P[::-1]])
S = np.array([0.1, 0.2, 0.3])

BAD = {
    "probabilities not 2-D": (accuracy, (P[0], Y[:1]), "shape"),
    "no samples": (brier_score, (np.zeros((0, 2)), np.zeros(0, dtype=int)), "empty"),
    "NaN probability": (brier_score, (np.array([[np.nan, 0.5], [0.2, 0.8], [0.6, 0.4]]), Y),
                        "NaN"),
    "logits": (negative_log_likelihood, (np.array([[2.0, -1.0], [0.2, 0.8], [0.6, 0.4]]), Y),
               r"\[0, 1\]"),
    "rows not summing to 1": (accuracy, (np.array([[0.5, 0.3], [0.2, 0.8], [0.6, 0.4]]), Y),
                              "sum to 1"),
    "complex probabilities": (accuracy, (P.astype(complex), Y), "real numbers"),
    "labels too short": (accuracy, (P, Y[:2]), r"shape \(3,\)"),
    "label out of range": (brier_score, (P, np.array([0, 2, 1])), "0..1"),
    "negative label": (expected_calibration_error, (P, np.array([0, -1, 1])), "0..1"),
    "float labels": (negative_log_likelihood, (P, Y.astype(float)), "integers"),
    "bins = 0": (expected_calibration_error, (P, Y, 0), "bins"),
    "bins < 0": (expected_calibration_error, (P, Y, -3), "bins"),
    "bins = True": (expected_calibration_error, (P, Y, True), "bins"),
    "bins not an int": (expected_calibration_error, (P, Y, 2.5), "bins"),
    "members not 3-D": (posterior_predictive, (P,), r"\(m, n, K\)"),
    "NaN member": (mutual_information, (np.where(M == 0.7, np.nan, M),), "NaN"),
    "members beyond 1": (mean_mutual_information, (M * 2,), r"\[0, 1\]"),
    "unknown score": (ood_scores, (M, "entropy"), "max-probability, mutual-information"),
    "score not a string": (ood_scores, (M, 1), "score"),
    "ID scores 2-D": (aupr, (S[None], S), "1-D"),
    "no OOD scores": (fpr_at_95_recall, (S, np.array([])), "non-empty"),
    "NaN score": (fpr_at_95_recall, (S, np.array([np.nan])), "NaN"),
    "scores a list": (aupr, ([0.1, 0.2], S), "id_scores"),
    "pair out of range": (pairwise_mutual_information, (M, [(0, 2)]), "0..1"),
    "pair of one member": (pairwise_mutual_information, (M, [(1, 1)]), "different"),
    "pairs not pairs": (pairwise_mutual_information, (M, np.array([[0, 1, 1]])), r"\(P, 2\)"),
    "float pairs": (pairwise_mutual_information, (M, np.array([[0.0, 1.0]])), "integer"),
    "no pairs": (pairwise_mutual_information, (M, np.zeros((0, 2), dtype=int)), "at least"),
    "one member": (pairwise_mutual_information, (M[:1],), "at least 2 members"),
    "entropy of 3-D": (entropy, (M,), r"\(n, K\)"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_input_is_refused_with_one_line(case):
    function, args, match = BAD[case]
    with pytest.raises(InvalidOptionError, match=match) as caught:
        function(*args)
    message = str(caught.value)
    assert "\n" not in message and function.__name__ in message


def _refusal(call) -> str | None:
    try:
        call()
    except InvalidOptionError as error:
        return str(error)
    return None


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_the_one_pass_check_refuses_what_the_full_check_refuses(dtype):
    """ensemble_summary checks the members in the pass that averages them: each bad array
    gets the full check's own message, rows summing to 1 within rounding of the
    tolerance included, and a good array the same predictive and MI as before."""
    from posteriorzoo.metrics import _checks
    from posteriorzoo.metrics.information import _ensemble, ensemble_summary

    rng = np.random.default_rng(3)
    good = _dirichlet(rng, (6, 700), 4).astype(dtype)
    cases = {"good": good.copy()}
    for name, value in (("NaN", np.nan), ("inf", np.inf), ("negative", -1e-7),
                        ("above 1", 1.0 + 1e-6)):
        bad = good.copy()
        bad[4, 613, 2] = value
        cases[name] = bad
    for offset in (-1e-6, 0.0, 1e-6):    # a row's sum 1e-3 + offset from 1
        edge = good.astype(np.float64)
        edge[2, 9] = [0.2, 0.2, 0.2, 0.4 + _checks.SUM_TOLERANCE + offset]
        cases[f"sum {offset}"] = edge
    for name, members in cases.items():
        full = _refusal(lambda m=members: _checks.probabilities(
            "f", "member_probabilities", m, ndim=3))
        fused = _refusal(lambda m=members: ensemble_summary("f", m))
        assert fused == full, name
        if full is None:
            predictive, information = ensemble_summary("f", members)
            expected_predictive, expected_information = _ensemble(members)
            assert np.array_equal(predictive, expected_predictive), name
            assert np.array_equal(information, expected_information), name
    refused = {name for name, members in cases.items()
               if _refusal(lambda m=members: ensemble_summary("f", m)) is not None}
    assert {"NaN", "inf", "negative", "above 1", "sum 1e-06"} <= refused
    assert not {"good", "sum -1e-06"} & refused   # "sum 0.0": as the full check decides
