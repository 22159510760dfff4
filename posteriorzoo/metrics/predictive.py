"""Accuracy and negative log-likelihood of predicted probabilities."""

from __future__ import annotations

import numpy as np

from posteriorzoo._api import public


@public
def accuracy(probabilities: np.ndarray, labels: np.ndarray) -> float:
    """Top-1 accuracy in [0, 1] of probabilities (n, K) against labels (n,)."""
    return float((probabilities.argmax(axis=1) == labels).mean())


@public
def negative_log_likelihood(probabilities: np.ndarray, labels: np.ndarray) -> float:
    """Mean negative log-likelihood in nats of labels (n,) under probabilities (n, K)."""
    picked = probabilities[np.arange(labels.shape[0]), labels].astype(np.float64)
    return float(-np.log(np.clip(picked, 1e-12, None)).mean())
