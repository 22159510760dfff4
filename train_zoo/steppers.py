"""Steppers of the method phases: SGHMC and BBB, on the torch and the numba engines.

Each adapts a method's functional ``update`` (:mod:`train_zoo.methods`) to
:func:`train_zoo.loop.fit`; the engines only supply gradients:

- torch: ``torch.func`` on the module (:func:`torch_log_posterior`,
  :func:`train_zoo.methods.bbb.step`);
- fast: the numba kernels' dL/dw (:func:`fast_log_posterior`,
  :class:`~train_zoo.methods.bbb_fast.FastBBB`).

Both draw their noise from the same ``torch.Generator`` in the same order, so the two
engines run the same chain up to float32 rounding.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn
from torch.func import grad_and_value

from train_zoo.fast.gradients import fast_loss_and_grad
from train_zoo.fast.layout import NetLayout
from train_zoo.methods import bbb, sghmc
from train_zoo.methods.bbb_fast import FastBBB
from train_zoo.methods.common import Params, flatten, unflatten

#: ``gradient(params, batch) -> (loss, grad log p(theta | D))``: the loss is the negative
#: log posterior per training example (nats), the gradient at full-data scale.
LogPosteriorGradient = Callable[[Params, tuple], tuple[float, Params]]


def torch_log_posterior(model: nn.Module, buffers: Mapping[str, torch.Tensor], num_data: int,
                        prior_precision: float) -> LogPosteriorGradient:
    """SGHMC's gradient with torch.func (any architecture; the model in eval mode)."""
    model.eval()

    def objective(params: Params, batch: tuple) -> torch.Tensor:
        return sghmc.log_posterior(model, params, buffers, batch, num_data, prior_precision)

    gradient = grad_and_value(objective)

    def evaluate(params: Params, batch: tuple) -> tuple[float, Params]:
        grads, value = gradient({k: v.detach() for k, v in params.items()}, batch)
        return -float(value) / num_data, dict(grads)

    return evaluate


def fast_log_posterior(layout: NetLayout, like: Params, num_data: int,
                       prior_precision: float) -> LogPosteriorGradient:
    """SGHMC's gradient on the numba kernels: ``-(N dL/dw + prior_precision * theta)``
    with ``L`` the batch's mean cross-entropy (batches in the kernels' layout)."""
    grad = np.empty(layout.num_params, dtype=np.float32)

    def evaluate(params: Params, batch: tuple) -> tuple[float, Params]:
        theta = flatten(params)
        x, labels = batch
        loss, _ = fast_loss_and_grad(layout, theta.numpy(), x, labels, grad=grad)
        g = torch.from_numpy(grad)
        log_grad = -(num_data * g + prior_precision * theta)
        square = float(theta.double().square().sum())
        return loss + 0.5 * prior_precision * square / num_data, unflatten(log_grad, like)

    return evaluate


def _chain_record(temperature_sum: float, capped_sum: float, count: int, alpha: float,
                  steps: int) -> dict[str, float | int | bool | None]:
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
    """One SGHMC chain (:func:`train_zoo.methods.sghmc.update`) for ``total_steps`` steps.

    ``lr`` of :meth:`step` is ignored: the chain's step size ``eta`` is fixed. The chain
    stops after ``total_steps`` updates or at a non-finite loss.

    With ``noise_decay`` set, the running variance of the minibatch gradients
    (:func:`~train_zoo.methods.sghmc.noise_update`) gives ``beta_hat``
    (:func:`~train_zoo.methods.sghmc.beta_hat`), subtracted from the injected noise once
    ``warm_up`` steps have filled the estimate. After ``record_from`` steps the stepper
    averages the kinetic temperature and the fraction of capped ``beta_hat``
    (:meth:`record`).
    """

    def __init__(self, params: Params, gradient: LogPosteriorGradient, eta: float,
                 alpha: float, generator: torch.Generator, total_steps: int, *,
                 noise_decay: float | None = None, warm_up: int = 0,
                 record_from: int = 0) -> None:
        self.state = sghmc.init(params)
        self.gradient = gradient
        self.eta = eta
        self.alpha = alpha
        self.generator = generator
        self.total_steps = total_steps
        self.stopped = total_steps == 0
        self.noise_decay = noise_decay
        self.warm_up = warm_up
        self.record_from = record_from
        self.noise: sghmc.GradientNoise | None = None
        self._temperature = self._capped = 0.0
        self._recorded = 0

    def step(self, batch: tuple, lr: float) -> float:
        loss, grads = self.gradient(self.state.params, batch)
        beta, capped = None, 0.0
        if self.noise_decay is not None:
            self.noise = sghmc.noise_update(self.noise, grads, self.noise_decay)
            if self.state.step >= self.warm_up:
                beta, capped = sghmc.beta_hat(self.noise, self.eta, self.alpha)
        self.state = sghmc.update(self.state, grads, self.eta, self.alpha, self.generator,
                                  beta)
        if self.state.step > self.record_from:
            self._temperature += sghmc.kinetic_temperature(self.state, self.eta)
            self._capped += capped
            self._recorded += 1
        self.stopped = self.state.step >= self.total_steps or not math.isfinite(loss)
        return loss

    def arrays(self) -> dict[str, np.ndarray]:
        return {name: value.numpy() for name, value in self.state.params.items()}

    def record(self) -> dict[str, float | int | None]:
        """What the chain did after ``record_from``: the mean kinetic temperature
        ``mean(v^2) / eta`` (its exact-chain value ``1 / (1 - alpha / 2)`` beside it), the
        mean fraction of coordinates whose ``beta_hat`` was capped, and the steps."""
        return _chain_record(self._temperature, self._capped, self._recorded, self.alpha,
                             self.state.step)


class WhitenedSghmcStepper:
    """One SGHMC chain with a constant mass matrix, run in whitened coordinates
    (:class:`~train_zoo.methods.sghmc.Whitening`) for ``total_steps`` steps.

    The chain starts at ``params`` plus ``start_offset`` in whitened coordinates (a
    standard normal draw there is a draw of the Laplace approximation around ``params``).
    With ``noise_decay`` set, the injected noise is corrected for the minibatch noise
    (:func:`~train_zoo.methods.sghmc.dense_noise_factor`):

    - during the first half of the burn-in (``record_from`` steps) from the running
      estimate with that decay, refreshed every ``refresh`` steps from ``warm_up`` on;
    - from then on from a plain mean of the gradient differences of the second half of
      the burn-in, frozen when the burn-in ends. A ``d x d`` estimate needs thousands of
      differences to settle; the frozen correction makes the kept part of the chain an
      SGHMC with a constant ``B_hat``. Without a burn-in the running estimate is used
      throughout.

    ``lr`` of :meth:`step` is ignored. :meth:`record` is :class:`SghmcStepper`'s in
    whitened coordinates (``mean(v_z^2) / lr_z``).
    """

    def __init__(self, params: Params, gradient: LogPosteriorGradient,
                 whitening: sghmc.Whitening, lr: float, alpha: float,
                 generator: torch.Generator, total_steps: int, *,
                 start_offset: torch.Tensor | None = None, noise_decay: float | None = None,
                 warm_up: int = 0, record_from: int = 0, refresh: int = 100) -> None:
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
        self.noise: sghmc.DenseGradientNoise | None = None
        self.settled: sghmc.DenseGradientNoise | None = None
        self.frozen = False
        self.factor, self.capped = sghmc.dense_noise_factor(None, lr, alpha, self.z.numel())
        self._temperature = self._capped = 0.0
        self._recorded = 0
        self.params = self._params()

    def _correct(self, grad_z: torch.Tensor) -> None:
        """Update the noise estimates with ``grad_z`` and the factor when it is due."""
        size = self.z.numel()
        if self.steps >= self.record_from // 2 and self.record_from > 0:
            self.settled = sghmc.dense_noise_update(self.settled, grad_z, None)
            if self.steps + 1 >= self.record_from:
                self.factor, self.capped = sghmc.dense_noise_factor(
                    self.settled, self.lr, self.alpha, size)
                self.frozen = True
                return
        self.noise = sghmc.dense_noise_update(self.noise, grad_z, self.noise_decay)
        if self.steps >= self.warm_up and (self.steps - self.warm_up) % self.refresh == 0:
            self.factor, self.capped = sghmc.dense_noise_factor(self.noise, self.lr,
                                                                self.alpha, size)

    def _params(self) -> Params:
        return unflatten(self.whitening.unwhiten(self.z), self.like)

    def step(self, batch: tuple, lr: float) -> float:
        loss, grads = self.gradient(self.params, batch)
        grad_z = self.whitening.gradient(flatten(grads))
        if self.noise_decay is not None and not self.frozen:
            self._correct(grad_z)
        self.z, self.momentum = sghmc.whitened_update(self.z, self.momentum, grad_z, self.lr,
                                                      self.alpha, self.factor, self.generator)
        self.steps += 1
        self.params = self._params()
        if self.steps > self.record_from:
            self._temperature += float(self.momentum.square().mean()) / self.lr
            self._capped += self.capped
            self._recorded += 1
        self.stopped = (self.steps >= self.total_steps or not math.isfinite(loss)
                        or not bool(torch.isfinite(self.z).all()))
        return loss

    def arrays(self) -> dict[str, np.ndarray]:
        return {name: value.numpy() for name, value in self.params.items()}

    def record(self) -> dict[str, float | int | None]:
        """:meth:`SghmcStepper.record`, in whitened coordinates."""
        return {**_chain_record(self._temperature, self._capped, self._recorded, self.alpha,
                                self.steps), "whitened": True}


@dataclass(frozen=True)
class BBBRun:
    """What every BBB step takes besides the batch: the noise generator, the training-set
    size (the KL weight's default 1 / N), the recipe's SGD momentum, and the optimisers
    (:class:`~train_zoo.methods.bbb.BBBTraining`: ``rho``'s learning rate is the means'
    times ``rho_lr_factor`` at every step)."""

    generator: torch.Generator
    num_data: int
    momentum: float
    nesterov: bool
    optimizer: str = "sgd"
    rho_optimizer: str = "sgd"
    rho_lr_factor: float = 1.0

    def rho_lr(self, lr: float) -> float:
        """The learning rate of ``rho`` when the means' is ``lr`` (``lr`` itself for a
        factor of 1, so the paper's runs are unchanged to the bit)."""
        return lr if self.rho_lr_factor == 1 else lr * self.rho_lr_factor


class ElboLog:
    """The ELBO's terms averaged over each epoch, kept for the first and the last.

    The BBB steppers :meth:`add` every step's terms; as a callback of
    :func:`train_zoo.loop.fit` it closes an epoch at ``on_epoch_end``. :meth:`record` is
    JSON-able.
    """

    def __init__(self, kl_weight: float) -> None:
        self.kl_weight = kl_weight
        self._nll, self._kl, self._steps = 0.0, 0.0, 0
        self.first: dict[str, float] | None = None
        self.last: dict[str, float] | None = None

    def add(self, nll: float, kl: float) -> None:
        self._nll += nll
        self._kl += kl
        self._steps += 1

    def on_epoch_end(self, info, weights) -> None:
        if not self._steps:
            return
        nll, kl = self._nll / self._steps, self._kl / self._steps
        epoch = {"epoch": info.epoch, "steps": self._steps, "nll": nll, "kl": kl,
                 "kl_weight": self.kl_weight, "negative_elbo": nll + self.kl_weight * kl}
        if self.first is None:
            self.first = epoch
        self.last = epoch
        self._nll, self._kl, self._steps = 0.0, 0.0, 0

    def record(self) -> dict[str, dict[str, float] | None]:
        """``{"first_epoch": ..., "last_epoch": ...}``, each with the epoch (0-based), its
        steps, the mean expected NLL per example (``nll``), KL in nats (``kl``),
        ``kl_weight`` and ``negative_elbo = nll + kl_weight * kl`` (per example); None
        before an epoch has ended."""
        return {"first_epoch": self.first, "last_epoch": self.last}


class BBBStepper:
    """BBB's SGD or Adam on the negative ELBO with torch.func
    (:func:`train_zoo.methods.bbb.elbo_and_grad`, :func:`~train_zoo.methods.bbb.update`)."""

    def __init__(self, state: bbb.BBBState, model: nn.Module, run: BBBRun) -> None:
        self.state = state
        self.model = model
        self.buffers = {name: value.detach().clone() for name, value in model.named_buffers()}
        self.run = run
        self.stopped = False
        self.log = ElboLog(state.options.kl_weight_for(run.num_data))

    def step(self, batch: tuple, lr: float) -> float:
        self.model.train()
        terms, grads = bbb.elbo_and_grad(self.state, self.model, self.buffers, batch,
                                         self.run.generator, self.run.num_data)
        self.state = bbb.update(self.state, grads, lr, momentum=self.run.momentum,
                                nesterov=self.run.nesterov, optimizer=self.run.optimizer,
                                rho_lr=self.run.rho_lr(lr),
                                rho_optimizer=self.run.rho_optimizer)
        self.log.add(float(terms.nll), float(terms.kl))
        value = float(terms.loss)
        self.stopped = not math.isfinite(value)
        return value

    def arrays(self) -> dict[str, np.ndarray]:
        return {name: value.detach().numpy() for name, value in self.state.mu.items()}

    def bbb_state(self) -> bbb.BBBState:
        return self.state


class FastBBBStepper:
    """BBB's SGD or Adam on the numba kernels
    (:class:`~train_zoo.methods.bbb_fast.FastBBB`)."""

    def __init__(self, fast: FastBBB, run: BBBRun) -> None:
        self.fast = fast
        self.run = run
        self.stopped = False
        self.log = ElboLog(fast.options.kl_weight_for(run.num_data))

    def step(self, batch: tuple, lr: float) -> float:
        x, labels = batch
        loss = self.fast.step(x, labels, self.run.generator, self.run.num_data, lr,
                              momentum=self.run.momentum, nesterov=self.run.nesterov,
                              optimizer=self.run.optimizer, rho_lr=self.run.rho_lr(lr),
                              rho_optimizer=self.run.rho_optimizer)
        self.log.add(self.fast.nll, self.fast.kl)
        self.stopped = not math.isfinite(loss)
        return loss

    def arrays(self) -> dict[str, np.ndarray]:
        return self.fast.arrays()

    def bbb_state(self) -> bbb.BBBState:
        return self.fast.state()
