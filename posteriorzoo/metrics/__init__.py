"""Predictive metrics of collections of checkpoints.

For now: member and ensemble probabilities, accuracy and negative log-likelihood.
Calibration (ECE, Brier) and OOD detection come with the posterior comparison work.
"""

from posteriorzoo.metrics.predictive import (
    accuracy,
    member_probabilities,
    negative_log_likelihood,
    normalized_images,
)

__all__ = ["accuracy", "member_probabilities", "negative_log_likelihood", "normalized_images"]
