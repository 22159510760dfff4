"""The one training loop: epochs of seeded batches, a schedule, callbacks, divergence.

Every phase of every method is this loop around a *stepper*, the piece an engine and a
method provide together:

- base networks: SGD on the recipe (the torch engine's :class:`~train_zoo.torch_engine.TorchSGD`,
  the numba engine's :class:`~train_zoo.fast.engine.FastNet`, the vectorised engine's
  stacked models);
- SWAG: the same SGD steppers continued on SWAG's schedule, with a collector callback;
- SGHMC: :class:`~train_zoo.methods.sghmc.SghmcStepper` on an engine's gradient;
- BBB: :class:`~train_zoo.methods.bbb.BBBStepper` (torch.func) or
  :class:`~train_zoo.fast.bbb.FastBBB` (numba).

A stepper has ``step(batch, lr) -> loss`` (the mini-batch loss before the update),
``arrays()`` (the current weights as numpy arrays in state_dict layout, for callbacks)
and ``stopped`` (true once its loss or weights are non-finite: training stops there, as a
diverged run cannot recover). Batches come from ``batches(epoch)``, so the data order is a
function of the epoch and the seed its builder was given, never of the loop's history.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from train_zoo.callbacks import StepInfo, notify


class Stepper(Protocol):
    """What :func:`fit` drives (module docstring)."""

    stopped: bool

    def step(self, batch: Any, lr: float) -> float: ...

    def arrays(self) -> Mapping[str, np.ndarray]: ...


@dataclass(frozen=True)
class FitResult:
    """What :func:`fit` did: updates taken, the last mini-batch loss, and whether the
    stepper stopped early (a non-finite loss)."""

    steps: int
    loss: float
    stopped: bool


def fit(stepper: Stepper, batches: Callable[[int], Iterable[Any]],
        schedule: Callable[[int], float], epochs: int, *, index: int = 0,
        phase: str = "train", callbacks: Sequence[object] = ()) -> FitResult:
    """Run ``epochs`` epochs of ``stepper`` on ``batches(epoch)`` at ``schedule(epoch)``.

    Parameters
    ----------
    stepper : Stepper
    batches : callable
        ``batches(epoch)`` yields the epoch's mini-batches in the stepper's format.
    schedule : callable
        ``schedule(epoch)`` is the learning rate during ``epoch`` (0-based).
    epochs : int
        Number of epochs (0: nothing happens).
    index : int
        The mode, reported to callbacks.
    phase : str
        Reported to callbacks (:class:`~train_zoo.callbacks.StepInfo`).
    callbacks : sequence
        Objects with ``on_step_end`` and/or ``on_epoch_end`` (read-only weights).

    Returns
    -------
    FitResult
    """
    step, loss, lr = 0, float("nan"), float("nan")
    for epoch in range(epochs):
        lr = schedule(epoch)
        for batch in batches(epoch):
            loss = float(stepper.step(batch, lr))
            step += 1
            if callbacks:
                notify(callbacks, "on_step_end", StepInfo(index, epoch, step, lr, loss, phase),
                       stepper.arrays())
            if stepper.stopped:
                break
        if callbacks:
            notify(callbacks, "on_epoch_end", StepInfo(index, epoch, step, lr, loss, phase),
                   stepper.arrays())
        if stepper.stopped:
            break
    return FitResult(step, loss, stepper.stopped)
