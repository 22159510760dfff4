"""Predictive metrics on probability arrays (a pure core: no files, no models).

Inputs are numpy arrays: probabilities ``(n, K)`` whose rows sum to 1, integer labels
``(n,)`` in ``0..K-1``, and an ensemble's (a posterior approximation's) member
probabilities ``(m, n, K)``. Bad input raises
:class:`~posteriorzoo.errors.InvalidOptionError`. The metrics of the paper's Table 1:

>>> p = posterior_predictive(members)                  # (m, n, K) -> (n, K)
>>> accuracy(p, labels), expected_calibration_error(p, labels, bins=15)
>>> brier_score(p, labels), negative_log_likelihood(p, labels)
>>> idmi = mean_mutual_information(members)            # nats; OODMI on the OOD set
>>> s_id, s_ood = ood_scores(members), ood_scores(members_ood)   # higher: more OOD
>>> aupr(s_id, s_ood), fpr_at_95_recall(s_id, s_ood)             # OOD is the positive class
>>> values, pairs = pairwise_mutual_information(members)         # functional collapse
>>> agreement(p, reference), total_variation(p, reference)      # against a reference
>>> band = predictive_noise(target_members, held_out=100, splits=50, seed=0)

Modules: :mod:`~posteriorzoo.metrics.predictive` (accuracy, NLL, Brier, ECE, the
predictive; agreement and total variation against a reference predictive, the NeurIPS
2021 competition's distances in function space, and their noise band),
:mod:`~posteriorzoo.metrics.information` (entropy, mutual information, its pairwise
form), :mod:`~posteriorzoo.metrics.ood` (OOD scores, AUPR, FPR95). Running a
collection's checkpoints to get the probabilities is the collection layer's job
(:func:`posteriorzoo.collection.evaluate`,
:func:`posteriorzoo.collection.evaluation.member_probabilities`).
"""

from posteriorzoo.metrics.information import (
    draw_pairs,
    entropy,
    mean_mutual_information,
    mutual_information,
    pairwise_mutual_information,
)
from posteriorzoo.metrics.ood import OOD_SCORES, aupr, fpr_at_95_recall, ood_scores
from posteriorzoo.metrics.predictive import (
    DEFAULT_ECE_BINS,
    accuracy,
    agreement,
    brier_score,
    expected_calibration_error,
    negative_log_likelihood,
    posterior_predictive,
    predictive_noise,
    total_variation,
)

__all__ = [
    "DEFAULT_ECE_BINS",
    "OOD_SCORES",
    "accuracy",
    "agreement",
    "aupr",
    "brier_score",
    "draw_pairs",
    "entropy",
    "expected_calibration_error",
    "fpr_at_95_recall",
    "mean_mutual_information",
    "mutual_information",
    "negative_log_likelihood",
    "ood_scores",
    "pairwise_mutual_information",
    "posterior_predictive",
    "predictive_noise",
    "total_variation",
]
