"""Out-of-distribution detection: per-sample OOD scores, AUPR and FPR95.

Conventions (torch-uncertainty's, the paper authors' library, after Hendrycks & Gimpel
2017): a score says **how OOD** a sample looks -- higher means more out-of-distribution --
and OOD samples are the **positive** class. A detector flags a sample as OOD when its
score is at least a threshold; recall is the fraction of OOD samples flagged, the false
positive rate the fraction of in-distribution samples flagged.

>>> id_score = ood_scores(members_on_test_set)            # (n_id,)
>>> ood_score = ood_scores(members_on_ood_set)            # (n_ood,)
>>> aupr(id_score, ood_score), fpr_at_95_recall(id_score, ood_score)
"""

from __future__ import annotations

import numpy as np

from posteriorzoo._api import public
from posteriorzoo.metrics import _checks
from posteriorzoo.metrics.information import ensemble_summary
from posteriorzoo.vocabulary import OOD_SCORES  # the per-sample scores ood_scores computes


@public
def ood_scores(member_probabilities: np.ndarray, score: str = "max-probability"
               ) -> np.ndarray:
    """How out-of-distribution each sample looks to an ensemble (higher: more OOD).

    Parameters
    ----------
    member_probabilities : ndarray of shape (m, n, K), float
        Each of ``m`` members' softmax probabilities on ``n`` samples (``m = 1`` for a
        single network).
    score : {"max-probability", "mutual-information"}
        ``"max-probability"``: ``1 - max_k p_k`` of the ensemble's predictive
        ``p = mean_m p_m`` (the maximum softmax probability baseline, negated), in
        [0, 1 - 1/K]. ``"mutual-information"``: the ensemble's mutual information
        (:func:`~posteriorzoo.metrics.mutual_information`) in nats, in [0, log(min(m, K))];
        it is 0 for a single network.

    Returns
    -------
    ndarray of shape (n,), float64
        The scores; higher means more OOD.
    """
    function = "ood_scores"
    _checks.choice(function, "score", score, OOD_SCORES)
    return scores_of(*ensemble_summary(function, member_probabilities), score)


def scores_of(predictive: np.ndarray, information: np.ndarray, score: str) -> np.ndarray:
    """:func:`ood_scores` from an ensemble's predictive ``(n, K)`` and per-sample mutual
    information ``(n,)`` (:func:`~posteriorzoo.metrics.information.ensemble_summary`),
    ``score`` checked by the caller."""
    return information if score == "mutual-information" else 1.0 - predictive.max(axis=1)


def _id_and_ood(function: str, id_scores: np.ndarray, ood_scores: np.ndarray
                ) -> tuple[np.ndarray, np.ndarray]:
    return (_checks.scores(function, "id_scores", id_scores),
            _checks.scores(function, "ood_scores", ood_scores))


@public
def aupr(id_scores: np.ndarray, ood_scores: np.ndarray) -> float:
    """Area under the precision-recall curve of OOD detection, OOD as the positive class.

    Parameters
    ----------
    id_scores : ndarray of shape (n_id,), float
        OOD scores (higher: more OOD) of in-distribution samples.
    ood_scores : ndarray of shape (n_ood,), float
        OOD scores of out-of-distribution samples.

    Returns
    -------
    float
        Average precision in [0, 1]: the step sum ``sum_t (R_t - R_{t-1}) P_t`` over the
        operating points (each distinct score, from the highest down), as scikit-learn's
        ``average_precision_score`` and torchmetrics' ``BinaryAveragePrecision`` (which
        torch-uncertainty reports as AUPR) compute it; equal to scikit-learn's to the bit
        (tested against it). Higher is better; a detector no better than chance scores
        ``n_ood / (n_id + n_ood)``.
    """
    # Summed here rather than by scikit-learn: importing it takes about a second, which
    # was a tenth of the report on the shipped zoo; the operating points are FPR95's.
    id_scores, ood_scores = _id_and_ood("aupr", id_scores, ood_scores)
    true_positives, false_positives = _operating_points(id_scores, ood_scores)
    precision = true_positives / (true_positives + false_positives)
    recall = true_positives / true_positives[-1]
    # From the lowest threshold up, the recall's steps negative: scikit-learn's order of
    # the same floating-point sum, hence the same bits.
    steps = np.diff(np.r_[recall[::-1], 0.0])
    return float(max(0.0, -np.sum(steps * precision[::-1])))


@public
def fpr_at_95_recall(id_scores: np.ndarray, ood_scores: np.ndarray) -> float:
    """False positive rate of OOD detection at 95% recall of the OOD samples (FPR95).

    Follows torch-uncertainty's ``FPR95`` (``FPRx`` with recall 0.95; its tie-aware form
    since 0.13, which equals Hendrycks' ``anomaly-seg`` rule whenever no in-distribution
    score equals an OOD score) and scikit-learn's ROC curve read at the first true
    positive rate of at least 0.95. The operating points are the thresholds at the
    distinct scores, from the highest down; the chosen one is the **first** (highest)
    threshold whose recall ``k / n_ood`` is at least 0.95, and every in-distribution
    sample scored at or above it counts as a false positive. With 450 OOD samples, for
    example, the threshold is the 428th highest OOD score (recall 428/450 >= 0.95 >
    427/450).

    Parameters
    ----------
    id_scores : ndarray of shape (n_id,), float
        OOD scores (higher: more OOD) of in-distribution samples (the negatives).
    ood_scores : ndarray of shape (n_ood,), float
        OOD scores of out-of-distribution samples (the positives).

    Returns
    -------
    float
        The fraction in [0, 1] of in-distribution samples flagged as OOD. Lower is better.
    """
    id_scores, ood_scores = _id_and_ood("fpr_at_95_recall", id_scores, ood_scores)
    true_positives, false_positives = _operating_points(id_scores, ood_scores)
    # recall >= 0.95 as 20 TP >= 19 n_ood, in integers so that an exact 0.95 is exact.
    first = int(np.flatnonzero(20 * true_positives >= 19 * ood_scores.size)[0])
    return float(false_positives[first] / id_scores.size)


def _operating_points(id_scores: np.ndarray, ood_scores: np.ndarray
                      ) -> tuple[np.ndarray, np.ndarray]:
    """``(true_positives, false_positives)``, int64: the OOD and the in-distribution
    samples scored at or above each distinct score, from the highest score down."""
    scores = np.r_[ood_scores, id_scores]
    is_ood = np.r_[np.ones(ood_scores.size, dtype=np.int64),
                   np.zeros(id_scores.size, dtype=np.int64)]
    order = np.argsort(-scores, kind="stable")
    ranked = scores[order]
    # The last position of each run of equal scores: one operating point per distinct score.
    ends = np.r_[np.flatnonzero(ranked[1:] != ranked[:-1]), ranked.size - 1]
    true_positives = np.cumsum(is_ood[order])[ends]
    return true_positives, ends + 1 - true_positives
