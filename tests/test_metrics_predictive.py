"""The pure predictive metrics: hand-computed values, scikit-learn, and bad input."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
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


def _dirichlet(rng, shape, classes, concentration=0.5):
    """Random probability vectors (``shape + (classes,)``), rows summing to 1."""
    return rng.dirichlet(np.full(classes, concentration), size=shape)


# --- posterior predictive, Brier ------------------------------------------------------------

def test_posterior_predictive_is_the_members_mean_in_float64():
    members = np.array([[[0.8, 0.2], [0.4, 0.6]],
                        [[0.6, 0.4], [0.2, 0.8]]], dtype=np.float32)
    predictive = posterior_predictive(members)
    # (0.8 + 0.6) / 2 = 0.7, (0.2 + 0.4) / 2 = 0.3; (0.4 + 0.2) / 2 = 0.3, (0.6 + 0.8) / 2 = 0.7
    np.testing.assert_allclose(predictive, [[0.7, 0.3], [0.3, 0.7]], rtol=1e-6)
    assert predictive.dtype == np.float64 and predictive.shape == (2, 2)


def test_brier_score_by_hand():
    probabilities = np.array([[0.7, 0.3], [0.2, 0.8], [0.6, 0.4]])
    labels = np.array([0, 1, 1])
    # (0.7-1)^2 + 0.3^2 = 0.18; 0.2^2 + (0.8-1)^2 = 0.08; 0.6^2 + (0.4-1)^2 = 0.72
    assert brier_score(probabilities, labels) == pytest.approx((0.18 + 0.08 + 0.72) / 3)
    assert brier_score(np.eye(3), np.arange(3)) == 0.0
    # certain of the wrong class: (1-0)^2 + (0-1)^2 = 2, the top of the range
    assert brier_score(np.array([[0.0, 1.0]]), np.array([0])) == pytest.approx(2.0)


def test_brier_score_against_scikit_learn():
    rng = np.random.default_rng(0)
    binary = _dirichlet(rng, 200, 2)
    labels = rng.integers(0, 2, 200)
    # scikit-learn's binary score looks at the positive class only: half the class sum
    assert brier_score(binary, labels) == pytest.approx(
        2 * brier_score_loss(labels, binary[:, 1]))
    multi = _dirichlet(rng, 300, 5)
    labels = rng.integers(0, 5, 300)
    assert brier_score(multi, labels) == pytest.approx(
        brier_score_loss(labels, multi, labels=np.arange(5), scale_by_half=False))


def test_accuracy_and_nll_still_agree_with_the_closed_form():
    probabilities = np.array([[0.7, 0.3], [0.2, 0.8], [0.6, 0.4]])
    labels = np.array([0, 1, 1], dtype=np.int32)
    assert accuracy(probabilities, labels) == pytest.approx(2 / 3)
    expected = -(math.log(0.7) + math.log(0.8) + math.log(0.4)) / 3
    assert negative_log_likelihood(probabilities, labels) == pytest.approx(expected)


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
    assert expected_calibration_error(probabilities, labels, bins=5) == pytest.approx(expected)
    # Bins closed on the right instead, (lo, hi], would give (0.85 + 1.5 + 0.1) / 6.
    assert not math.isclose(expected, (0.85 + 1.5 + 0.1) / 6)


def test_ece_with_one_bin_is_the_accuracy_confidence_gap():
    rng = np.random.default_rng(1)
    probabilities = _dirichlet(rng, 500, 4)
    labels = rng.integers(0, 4, 500)
    gap = abs(accuracy(probabilities, labels) - probabilities.max(axis=1).mean())
    assert expected_calibration_error(probabilities, labels, bins=1) == pytest.approx(gap)


def test_ece_of_a_calibrated_and_an_overconfident_predictor():
    # confidence 0.75 and 3 out of 4 right: perfectly calibrated, ECE 0
    probabilities, labels = _binary([0.75] * 4, [True, True, True, False])
    assert expected_calibration_error(probabilities, labels) == pytest.approx(0.0, abs=1e-12)
    # certain and always wrong: |0 - 1| = 1, the top of the range
    probabilities, labels = _binary([1.0] * 3, [False] * 3)
    assert expected_calibration_error(probabilities, labels) == pytest.approx(1.0)


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
    np.testing.assert_allclose(values, [math.log(4), 0.0, LOG2])


def test_mutual_information_is_zero_when_members_agree():
    rng = np.random.default_rng(3)
    one = _dirichlet(rng, 50, 6)
    members = np.stack([one, one, one])
    np.testing.assert_allclose(mutual_information(members), 0.0, atol=1e-12)
    assert mean_mutual_information(members) == pytest.approx(0.0, abs=1e-12)


def test_mutual_information_of_two_certain_disagreeing_members_is_log_2():
    members = np.array([[[1.0, 0.0, 0.0]], [[0.0, 1.0, 0.0]]])
    # H((1/2, 1/2, 0)) - (H(one-hot) + H(one-hot)) / 2 = log 2 - 0
    np.testing.assert_allclose(mutual_information(members), [LOG2])


def test_mutual_information_by_hand():
    members = np.array([[[1.0, 0.0]], [[0.5, 0.5]]])
    # mean (0.75, 0.25): H = -(0.75 log 0.75 + 0.25 log 0.25) = 0.562335
    # members: H(1, 0) = 0, H(0.5, 0.5) = log 2 = 0.693147; mean 0.346574
    expected = -(0.75 * math.log(0.75) + 0.25 * math.log(0.25)) - LOG2 / 2
    assert expected == pytest.approx(0.215762, abs=1e-6)
    np.testing.assert_allclose(mutual_information(members), [expected])


def test_mean_mutual_information_is_the_mean_over_samples():
    rng = np.random.default_rng(4)
    members = _dirichlet(rng, (5, 40), 10).astype(np.float32)
    per_sample = mutual_information(members)
    assert per_sample.shape == (40,) and per_sample.dtype == np.float64
    assert (per_sample >= 0).all() and (per_sample <= math.log(5) + 1e-9).all()
    assert mean_mutual_information(members) == pytest.approx(per_sample.mean())


# --- pairwise mutual information ------------------------------------------------------------

def test_pairwise_mi_of_two_certain_disagreeing_members():
    members = np.array([[[1.0, 0.0], [0.0, 1.0]],
                        [[0.0, 1.0], [0.0, 1.0]]])
    values, pairs = pairwise_mutual_information(members)
    # sample 1: they disagree, log 2; sample 2: they agree, 0; mean over samples log 2 / 2
    np.testing.assert_allclose(values, [LOG2 / 2])
    np.testing.assert_array_equal(pairs, [[0, 1]])


def test_pairwise_mi_is_the_mi_of_each_two_member_ensemble():
    rng = np.random.default_rng(5)
    members = _dirichlet(rng, (4, 30), 5)
    values, pairs = pairwise_mutual_information(members)
    np.testing.assert_array_equal(pairs, [[0, 1], [0, 2], [0, 3], [1, 2], [1, 3], [2, 3]])
    expected = [mean_mutual_information(members[[i, j]]) for i, j in pairs]
    np.testing.assert_allclose(values, expected, rtol=1e-12, atol=1e-15)
    assert (values > 0).all() and (values <= LOG2).all()


def test_pairwise_mi_is_symmetric_and_takes_chosen_pairs():
    rng = np.random.default_rng(6)
    members = _dirichlet(rng, (3, 25), 4)
    values, pairs = pairwise_mutual_information(members, pairs=[(2, 0), (0, 2), (1, 2)])
    assert values[0] == pytest.approx(values[1], rel=1e-14)
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
        np.testing.assert_allclose(mutual_information(array), reference, rtol=1e-12,
                                   atol=1e-15)
        values, pairs = pairwise_mutual_information(array)
        for (i, j), value in zip(pairs, values, strict=True):
            mixture = 0.5 * (array[i].astype(np.float64) + array[j])
            pair = (_numpy_entropy(mixture)
                    - 0.5 * (_numpy_entropy(array[i]) + _numpy_entropy(array[j]))).mean()
            assert value == pytest.approx(max(pair, 0.0), rel=1e-12, abs=1e-15)


# --- OOD scores, AUPR, FPR95 ----------------------------------------------------------------

def test_ood_scores_by_hand():
    members = np.array([[[0.8, 0.2], [1.0, 0.0]],
                        [[0.6, 0.4], [0.0, 1.0]]])
    # predictive (0.7, 0.3) and (0.5, 0.5): 1 - max = 0.3 and 0.5
    np.testing.assert_allclose(ood_scores(members), [0.3, 0.5])
    np.testing.assert_allclose(ood_scores(members, score="max-probability"), [0.3, 0.5])
    # sample 2: two certain members of different classes, MI = log 2
    np.testing.assert_allclose(ood_scores(members, score="mutual-information"),
                               mutual_information(members))
    assert ood_scores(members, score="mutual-information")[1] == pytest.approx(LOG2)


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
    # AP = sum (R_t - R_t-1) P_t = 0.5 * 1 (at 0.8) + 0.5 * 2/3 (at 0.35) = 5/6
    assert aupr(np.array([0.1, 0.4]), np.array([0.35, 0.8])) == pytest.approx(5 / 6)


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
    assert fpr_at_95_recall(np.array([19.5, 1.5, 0.5]),
                            np.arange(20, 0, -1, dtype=float)) == pytest.approx(1 / 3)


def test_fpr95_needs_at_least_95_percent_recall():
    # 10 OOD scored 10..1: recall 0.9 is as far from 0.95 as 1.0, but below it; recall 1
    # (threshold 1) flags the ID samples 11, 5.5 and 1.0: 3/4.
    assert fpr_at_95_recall(np.array([11.0, 5.5, 1.0, 0.5]),
                            np.arange(10, 0, -1, dtype=float)) == pytest.approx(3 / 4)


def test_fpr95_with_450_ood_samples_stops_at_the_428th():
    # 0.95 x 450 = 427.5: the audit's case. OOD scored 450..1, one ID sample between each
    # pair of OOD scores (449.5, ..., 0.5). The first threshold with recall >= 0.95 is the
    # 428th OOD score (23): the ID samples 449.5 ... 23.5 are flagged, 427 of 450.
    ood = np.arange(450, 0, -1, dtype=float)
    assert fpr_at_95_recall(ood - 0.5, ood) == pytest.approx(427 / 450)


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
    assert fpr_at_95_recall(id_scores, ood) == pytest.approx(expected, abs=1e-12)
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
    assert fpr_at_95_recall(id_scores, ood) == pytest.approx(expected, abs=1e-6)


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
