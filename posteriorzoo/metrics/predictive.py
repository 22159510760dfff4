"""Predictions of a collection of checkpoints: member and ensemble probabilities."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from posteriorzoo.data import ArrayDataset, Normalize
from posteriorzoo.models import build
from posteriorzoo.zoo import Zoo


def normalized_images(dataset: ArrayDataset) -> torch.Tensor:
    """The dataset's images as float32 (N, C, H, W), normalised with its mean and std."""
    return Normalize(dataset.mean, dataset.std)(torch.from_numpy(dataset.images))


@torch.no_grad()
def member_probabilities(zoo: Zoo, images: torch.Tensor, indices: Sequence[int] | None = None,
                         batch_size: int = 2000) -> np.ndarray:
    """Softmax outputs of each checkpoint, in eval mode.

    Parameters
    ----------
    zoo : Zoo
        A collection whose architecture is registered in :mod:`posteriorzoo.models`.
    images : torch.Tensor
        Model inputs, shape (n, C, H, W) (already normalised).
    indices : sequence of int, optional
        Checkpoints to use (default: all).
    batch_size : int
        Images per forward pass.

    Returns
    -------
    numpy.ndarray of shape (n_checkpoints, n, num_classes), float32.
    """
    model = build(zoo.architecture, num_classes=zoo.num_classes, **zoo.model_options)
    model.eval()
    indices = range(len(zoo)) if indices is None else indices
    outputs = []
    for index in indices:
        model.load_state_dict(zoo.state_dict(index))
        probabilities = [torch.softmax(model(images[start:start + batch_size]), dim=1)
                         for start in range(0, len(images), batch_size)]
        outputs.append(torch.cat(probabilities).numpy())
    return np.stack(outputs)


def accuracy(probabilities: np.ndarray, labels: np.ndarray) -> float:
    """Top-1 accuracy in [0, 1] of probabilities (n, K) against labels (n,)."""
    return float((probabilities.argmax(axis=1) == labels).mean())


def negative_log_likelihood(probabilities: np.ndarray, labels: np.ndarray) -> float:
    """Mean negative log-likelihood in nats of labels (n,) under probabilities (n, K)."""
    picked = probabilities[np.arange(labels.shape[0]), labels].astype(np.float64)
    return float(-np.log(np.clip(picked, 1e-12, None)).mean())
