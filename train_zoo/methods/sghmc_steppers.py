"""SGHMC's steppers: one chain run for the trainer, batch after batch.

:class:`SghmcStepper` (a chain of :func:`~train_zoo.methods.sghmc_update.update`, with
the ``beta_hat`` correction of :func:`~train_zoo.methods.sghmc_update.beta_hat`) and
:class:`WhitenedSghmcStepper` (a chain with a constant mass matrix,
:mod:`~train_zoo.methods.sghmc_metric`, and a dense correction), both recording what the
chain did (:meth:`SghmcStepper.record`), and :data:`LogPosteriorGradient`, the gradient an
engine gives them. :class:`train_zoo.methods.sghmc.Sghmc` builds them (it looks them up in
:mod:`train_zoo.methods.sghmc`, which re-exports every public name here); the loop that
drives them is :func:`train_zoo.loop.fit`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from train_zoo.methods.common import Params, flatten, unflatten
from train_zoo.methods.sghmc_metric import (
    DenseGradientNoise,
    Whitening,
    dense_noise_factor,
    dense_noise_update,
    whitened_update,
)
from train_zoo.methods.sghmc_update import (
    GradientNoise,
    beta_hat,
    init,
    kinetic_temperature,
    noise_update,
    update,
)

__all__ = ["LogPosteriorGradient", "SghmcStepper", "WhitenedSghmcStepper"]

#: ``gradient(params, batch) -> (loss, grad log p(theta | D))``: the loss is the negative
#: log posterior per training example (nats), the gradient at full-data scale.
LogPosteriorGradient = Callable[[Params, tuple], tuple[float, Params]]


def _chain_record(temperature_sum: float, capped_sum: float, count: int, alpha: float,
                  steps: int) -> dict[str, Any]:
    """An SGHMC chain's record: mean kinetic temperature and capped fraction over the
    ``count`` recorded steps (None when there were none, or when the chain diverged and
    its momentum is no longer finite: ``diverged`` says so)."""
    temperature = temperature_sum / count if count else None
    diverged = temperature is not None and not math.isfinite(temperature)
    return {"kinetic_temperature": None if diverged else temperature,
            "exact_temperature": 1.0 / (1.0 - alpha / 2.0),
            "beta_hat_capped": capped_sum / count if count and not diverged else None,
            "steps": steps, "recorded_steps": count, "diverged": diverged}


class SghmcStepper:
    """One SGHMC chain (:func:`update`) for ``total_steps`` steps.

    ``lr`` of :meth:`step` is ignored: the chain's step size ``eta`` is fixed. The chain
    stops after ``total_steps`` updates or at a non-finite loss.

    With ``noise_decay`` set, the running variance of the minibatch gradients
    (:func:`noise_update`) gives ``beta_hat``
    (:func:`beta_hat`), subtracted from the injected noise once
    ``warm_up`` steps have filled the estimate. After ``record_from`` steps the stepper
    averages the kinetic temperature and the fraction of capped ``beta_hat``
    (:meth:`record`).
    """

    def __init__(self, params: Params, gradient: LogPosteriorGradient, eta: float,
                 alpha: float, generator: torch.Generator, total_steps: int, *,
                 noise_decay: float | None = None, warm_up: int = 0,
                 record_from: int = 0) -> None:
        self.state = init(params)
        self.gradient = gradient
        self.eta = eta
        self.alpha = alpha
        self.generator = generator
        self.total_steps = total_steps
        self.stopped = total_steps == 0
        self.noise_decay = noise_decay
        self.warm_up = warm_up
        self.record_from = record_from
        self.noise: GradientNoise | None = None
        self._temperature = self._capped = 0.0
        self._recorded = 0

    def step(self, batch: tuple, lr: float) -> float:
        loss, grads = self.gradient(self.state.params, batch)
        beta, capped = None, 0.0
        if self.noise_decay is not None:
            self.noise = noise_update(self.noise, grads, self.noise_decay)
            if self.state.step >= self.warm_up:
                beta, capped = beta_hat(self.noise, self.eta, self.alpha)
        self.state = update(self.state, grads, self.eta, self.alpha, self.generator,
                                  beta)
        if self.state.step > self.record_from:
            self._temperature += kinetic_temperature(self.state, self.eta)
            self._capped += capped
            self._recorded += 1
        self.stopped = self.state.step >= self.total_steps or not math.isfinite(loss)
        return loss

    def arrays(self) -> dict[str, np.ndarray]:
        return {name: value.numpy() for name, value in self.state.params.items()}

    def record(self) -> dict[str, Any]:
        """What the chain did after ``record_from``: the mean kinetic temperature
        ``mean(v^2) / eta`` (its exact-chain value ``1 / (1 - alpha / 2)`` beside it), the
        mean fraction of coordinates whose ``beta_hat`` was capped, and the steps."""
        return _chain_record(self._temperature, self._capped, self._recorded, self.alpha,
                             self.state.step)


class WhitenedSghmcStepper:
    """One SGHMC chain with a constant mass matrix, run in whitened coordinates
    (:class:`Whitening`) for ``total_steps`` steps.

    The chain starts at ``params`` plus ``start_offset`` in whitened coordinates (a
    standard normal draw there is a draw of the Laplace approximation around ``params``).
    With ``noise_decay`` set, the injected noise is corrected for the minibatch noise
    (:func:`dense_noise_factor`):

    - during the first half of the burn-in (``record_from`` steps) from the running
      estimate with that decay, refreshed every ``refresh`` steps from ``warm_up`` on;
    - from then on from a plain mean of the gradient differences of the second half of
      the burn-in, frozen when the burn-in ends. A ``d x d`` estimate needs thousands of
      differences to settle; the frozen correction makes the kept part of the chain an
      SGHMC with a constant ``B_hat``. Without a burn-in, or with ``running``, the
      running estimate is used throughout (a chain that moves far, whose noise changes
      along the way).

    ``lr`` of :meth:`step` is ignored. :meth:`record` is :class:`SghmcStepper`'s in
    whitened coordinates (``mean(v_z^2) / lr_z``).
    """

    def __init__(self, params: Params, gradient: LogPosteriorGradient,
                 whitening: Whitening, lr: float, alpha: float,
                 generator: torch.Generator, total_steps: int, *,
                 start_offset: torch.Tensor | None = None, noise_decay: float | None = None,
                 warm_up: int = 0, record_from: int = 0, refresh: int = 100,
                 running: bool = False) -> None:
        self.like = {name: value.detach() for name, value in params.items()}
        self.whitening = whitening
        self.z = whitening.whiten(flatten(self.like))
        if start_offset is not None:
            self.z = self.z + start_offset.double()
        self.momentum = torch.zeros_like(self.z)
        self.gradient = gradient
        self.lr, self.alpha, self.generator = lr, alpha, generator
        self.total_steps, self.steps = total_steps, 0
        self.stopped = total_steps == 0
        self.noise_decay, self.warm_up, self.refresh = noise_decay, warm_up, refresh
        self.record_from = record_from
        self.running = running
        self.loss_sum = 0.0     # of the recorded steps: which chain sits lowest
        self.noise: DenseGradientNoise | None = None
        self.settled: DenseGradientNoise | None = None
        self.frozen = False
        self.factor, self.capped = dense_noise_factor(None, lr, alpha, self.z.numel())
        self._temperature = self._capped = 0.0
        self._recorded = 0
        self.params = self._params()

    def _correct(self, grad_z: torch.Tensor) -> None:
        """Update the noise estimates with ``grad_z`` and the factor when it is due."""
        size = self.z.numel()
        if not self.running and self.steps >= self.record_from // 2 and self.record_from > 0:
            self.settled = dense_noise_update(self.settled, grad_z, None)
            if self.steps + 1 >= self.record_from:
                self.factor, self.capped = dense_noise_factor(
                    self.settled, self.lr, self.alpha, size)
                self.frozen = True
                return
        self.noise = dense_noise_update(self.noise, grad_z, self.noise_decay)
        if self.steps >= self.warm_up and (self.steps - self.warm_up) % self.refresh == 0:
            self.factor, self.capped = dense_noise_factor(self.noise, self.lr,
                                                                self.alpha, size)

    def _params(self) -> Params:
        return unflatten(self.whitening.unwhiten(self.z), self.like)

    def step(self, batch: tuple, lr: float) -> float:
        loss, grads = self.gradient(self.params, batch)
        grad_z = self.whitening.gradient(flatten(grads))
        if self.noise_decay is not None and not self.frozen:
            self._correct(grad_z)
        self.z, self.momentum = whitened_update(self.z, self.momentum, grad_z, self.lr,
                                                      self.alpha, self.factor, self.generator)
        self.steps += 1
        self.params = self._params()
        if self.steps > self.record_from:
            self.loss_sum += loss
            self._temperature += float(self.momentum.square().mean()) / self.lr
            self._capped += self.capped
            self._recorded += 1
        self.stopped = (self.steps >= self.total_steps or not math.isfinite(loss)
                        or not bool(torch.isfinite(self.z).all()))
        return loss

    def arrays(self) -> dict[str, np.ndarray]:
        return {name: value.numpy() for name, value in self.params.items()}

    def record(self) -> dict[str, Any]:
        """:meth:`SghmcStepper.record`, in whitened coordinates."""
        return {**_chain_record(self._temperature, self._capped, self._recorded, self.alpha,
                                self.steps), "whitened": True}

