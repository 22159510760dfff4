"""Predictive metrics on probability arrays (a pure core: no files, no models).

``accuracy`` and ``negative_log_likelihood`` take probabilities ``(n, K)`` and labels
``(n,)``. Running a collection's checkpoints to get the probabilities is the collection
layer's job (:func:`posteriorzoo.collection.evaluate`,
:func:`posteriorzoo.collection.evaluation.member_probabilities`).
"""

from posteriorzoo.metrics.predictive import accuracy, negative_log_likelihood

__all__ = ["accuracy", "negative_log_likelihood"]
