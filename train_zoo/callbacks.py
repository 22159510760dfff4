"""Hooks called during training with read-only access to the weights.

A callback receives a :class:`StepInfo` and the current weights as read-only numpy views
(``{key: array}``; writing to them raises). Analyses record trajectories this way, e.g.
the sorting permutation of each layer at every step (paper section 5.2). Callbacks run
in the process that trains, so they are supported by the serial backend only.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np


@dataclass(frozen=True)
class StepInfo:
    """Where training is: the mode's index, epoch (0-based), step (1-based after the
    first update), learning rate, the mini-batch loss of the last step (nats; a method
    phase reports its own objective, e.g. BBB's negative ELBO per example), and the phase:
    ``"train"`` for the base network, else the method's phase (``"swag"``, ``"sghmc"``,
    ``"bbb"``). Epochs and steps count from 0 in each phase."""

    index: int
    epoch: int
    step: int
    lr: float
    loss: float
    phase: str = "train"


class Callback(Protocol):
    """Either method may be omitted; both receive read-only weight views."""

    def on_step_end(self, info: StepInfo, weights: Mapping[str, np.ndarray]) -> None: ...

    def on_epoch_end(self, info: StepInfo, weights: Mapping[str, np.ndarray]) -> None: ...


def read_only(arrays: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Read-only views of ``arrays`` (no copy)."""
    views = {}
    for key, array in arrays.items():
        view = array.view()
        view.flags.writeable = False
        views[key] = view
    return views


def notify(callbacks: Sequence[object], event: str, info: StepInfo,
           arrays: Mapping[str, np.ndarray]) -> None:
    """Call ``event`` (``on_step_end`` or ``on_epoch_end``) on every callback that has it."""
    hooks = [getattr(c, event) for c in callbacks if hasattr(c, event)]
    if hooks:
        views = read_only(arrays)
        for hook in hooks:
            hook(info, views)
