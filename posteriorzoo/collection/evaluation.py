"""Evaluate a collection's predictions: every member and their average (the ensemble).

The numbers come from the pure core :mod:`posteriorzoo.metrics` (on probability arrays);
this module runs the collection's checkpoints on a dataset split to get them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from posteriorzoo._api import public
from posteriorzoo.collection._open import Source, content_digest, model_of, opened, source_path
from posteriorzoo.data import ArrayDataset, Normalize, load_dataset
from posteriorzoo.metrics import accuracy, negative_log_likelihood
from posteriorzoo.options import check_integer
from posteriorzoo.provenance import record
from posteriorzoo.results import CollectionResult, csv_text

__all__ = ["EvaluateResult", "evaluate", "member_probabilities", "normalized_images"]


def normalized_images(dataset: ArrayDataset) -> torch.Tensor:
    """The dataset's images as float32 ``(N, C, H, W)``, normalised with its mean and std
    (uint8 values as stored, then ``(x / 255 - mean) / std``: how every collection was
    trained and evaluated)."""
    return Normalize(dataset.mean, dataset.std)(torch.from_numpy(dataset.images))


@torch.no_grad()
def member_probabilities(source: Source, images: torch.Tensor,
                         indices: Sequence[int] | None = None, batch_size: int = 2000,
                         verify: bool = True) -> np.ndarray:
    """Softmax outputs of each checkpoint, in eval mode.

    Parameters
    ----------
    source : path or Zoo
        A collection whose architecture is registered in :mod:`posteriorzoo.models`.
    images : torch.Tensor
        Model inputs ``(n, C, H, W)``, already normalised (:func:`normalized_images`).
    indices : sequence of int, optional
        Checkpoints to use (default: all).
    batch_size : int
        Images per forward pass.
    verify : bool
        Check each checkpoint's digests as it is read (for a path).

    Returns
    -------
    numpy.ndarray
        ``(n_checkpoints, n, num_classes)`` float32 probabilities.
    """
    check_integer("batch_size", batch_size, 1)
    with opened(source, verify=verify) as zoo:
        model, _ = model_of(zoo)
        indices = range(len(zoo)) if indices is None else indices
        outputs = []
        for index in indices:
            model.load_state_dict(zoo.state_dict(index))
            probabilities = [torch.softmax(model(images[start:start + batch_size]), dim=1)
                             for start in range(0, len(images), batch_size)]
            outputs.append(torch.cat(probabilities).numpy())
    return np.stack(outputs)


@dataclass
class EvaluateResult(CollectionResult):
    """A collection's predictive performance on one dataset split.

    Attributes
    ----------
    dataset, split : str
    member_accuracy, member_nll : numpy.ndarray
        ``(N,)`` accuracy in [0, 1] and mean negative log-likelihood (nats) of each
        checkpoint.
    ensemble_accuracy, ensemble_nll : float
        Of the average of the members' probabilities.
    """

    kind = "evaluate"
    dataset: str
    split: str
    member_accuracy: np.ndarray
    member_nll: np.ndarray
    ensemble_accuracy: float
    ensemble_nll: float

    def payload(self) -> dict[str, Any]:
        return {"dataset": self.dataset, "split": self.split,
                "members": len(self.member_accuracy),
                "member_accuracy_mean": float(np.mean(self.member_accuracy)),
                "member_nll_mean": float(np.mean(self.member_nll)),
                "ensemble_accuracy": self.ensemble_accuracy, "ensemble_nll": self.ensemble_nll}

    def tables(self) -> dict[str, str]:
        return {"members.csv": csv_text(
            ["checkpoint", "accuracy", "nll"],
            ([i, float(a), float(n)] for i, (a, n) in
             enumerate(zip(self.member_accuracy, self.member_nll, strict=True))))}


@public
def evaluate(source: Source, *, dataset: str | None = None, split: str = "test",
             data_dir: str | None = None, batch_size: int = 2000, verify: bool = True,
             command: str | None = None) -> EvaluateResult:
    """Accuracy and NLL of every checkpoint and of their ensemble on a dataset split.

    Parameters
    ----------
    source : path or Zoo
    dataset : str, optional
        A dataset of :func:`posteriorzoo.data.load_dataset` (default: the collection's).
    split : {"train", "test"}
    data_dir : str, optional
        Folder searched first for the dataset files.
    batch_size : int
        Images per forward pass.
    verify : bool
        Check each checkpoint's digests as it is read.
    command : str, optional
        Recorded in the provenance.
    """
    with opened(source, verify=verify) as zoo:
        name = dataset or zoo.dataset
        data = load_dataset(name, split, data_dir=data_dir)
        probabilities = member_probabilities(zoo, normalized_images(data),
                                             batch_size=batch_size)
        digest = content_digest(zoo)
    labels = data.labels
    ensemble = probabilities.mean(axis=0)
    return EvaluateResult(
        name, split, np.array([accuracy(p, labels) for p in probabilities]),
        np.array([negative_log_likelihood(p, labels) for p in probabilities]),
        accuracy(ensemble, labels), negative_log_likelihood(ensemble, labels),
        provenance=record("posteriorzoo evaluate", command=command,
                          inputs={"collection": {"path": str(source_path(source)),
                                                 "content_sha256": digest}},
                          options={"dataset": name, "split": split, "verify": verify}))
