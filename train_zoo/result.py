"""The outcome of training one checkpoint, as sent from a worker to the single writer."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from train_zoo.seeds import CheckpointSeeds


@dataclass
class CheckpointResult:
    """A trained checkpoint and everything its metadata row records.

    Attributes
    ----------
    index : int
        The mode: the base network's index in the spec (0 .. modes-1); stored as
        ``mode_id``.
    state : dict of str to numpy.ndarray
        The final state_dict, as numpy arrays (a worker-independent wire format).
    metrics : dict of str to float
        ``train_loss``, ``train_accuracy``, ``test_loss``, ``test_accuracy`` at the end
        (losses in nats per example, accuracies in [0, 1]).
    wall_time : float
        Seconds spent training and evaluating this checkpoint.
    diverged : bool
        Non-finite weights or metrics (:func:`is_diverged`); a finite run whose accuracy
        is near chance is undertrained, not diverged (:func:`near_chance`).
    seeds : CheckpointSeeds
    steps : int
        Optimiser steps taken.
    engine : str
        Which engine trained it (``torch``, ``fast``, ``vectorised``).
    sample : int
        The draw around the mode (0 .. samples_per_mode-1); stored as ``sample_id``.
    record : dict or None
        What the mode's method phase recorded (JSON-able; the same for every sample of a
        mode): SGHMC's kinetic temperature per chain, BBB's sigma and ELBO terms, SWAG's
        rank and iterates, Laplace's prior precision and evidence. None for DE.
    chain : int
        The Markov chain the sample was drawn from (0 .. chains-1 within its mode; -1
        for a method without chains); stored as ``chain``.
    """

    index: int
    state: dict[str, np.ndarray]
    metrics: dict[str, float]
    wall_time: float
    diverged: bool
    seeds: CheckpointSeeds
    steps: int
    engine: str
    sample: int = 0
    record: dict[str, Any] | None = None
    chain: int = -1

    def metadata(self, epochs: int, recipe_hash: str, source: str) -> dict[str, Any]:
        """The checkpoint's metadata row for :meth:`posteriorzoo.zoo.Zoo.append`."""
        return {"seed": self.seeds.init, "data_seed": self.seeds.data, "mode_id": self.index,
                "sample_id": self.sample, "chain": self.chain, "epoch": epochs,
                "recipe_hash": recipe_hash,
                "wall_time": self.wall_time, "diverged": self.diverged,
                "source": f"{source} mode {self.index} sample {self.sample} "
                          f"engine {self.engine}", **self.metrics}


def is_diverged(state: dict[str, np.ndarray], metrics: dict[str, float]) -> bool:
    """Training diverged: a weight or a final loss or accuracy that is NaN or infinite.

    A run that stays finite but ends near chance (a few steps, a learning rate too small)
    has not diverged: :func:`near_chance` names it undertrained."""
    finite = all(np.isfinite(v).all() for v in state.values() if v.dtype.kind == "f")
    return not finite or not all(np.isfinite(value) for value in metrics.values())


def near_chance(test_accuracy: float, num_classes: int) -> bool:
    """A finite final test accuracy within 1.5x of chance (``1 / num_classes``): the run
    learned little, e.g. undertrained."""
    return bool(np.isfinite(test_accuracy)) and test_accuracy < 1.5 / num_classes
