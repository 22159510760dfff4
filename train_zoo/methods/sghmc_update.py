"""SGHMC (Chen et al. 2014): stochastic-gradient Hamiltonian Monte Carlo, one chain's update.

The update (Chen et al.'s "SGD with momentum" form, eq. 15)::

    v     <- (1 - alpha) v + lr * grad log p(theta | D) + N(0, 2 (alpha - beta_hat) lr)
    theta <- theta + v

``beta_hat = lr V_hat / 2`` is the part of the friction the minibatch gradient's own
noise already supplies (Chen et al. section 3.2), ``V_hat`` the per-coordinate variance of
the (full-data scale) minibatch gradient. With ``beta_hat = 0`` that noise adds to the
injected noise and the chain runs hot: its kinetic temperature ``mean(v^2) / lr``
(:func:`kinetic_temperature`; ``1 / (1 - alpha / 2)`` for an exact chain of this
discretisation, 1.05 at ``alpha = 0.1``) rises with ``lr V / (2 alpha)``. The trainer
estimates ``V_hat`` from the running mean of half the squared difference of successive
minibatch gradients (:class:`GradientNoise`, :func:`noise_update`) and subtracts ``beta_hat``
(:func:`beta_hat`), capped below ``alpha``: where the cap binds, the step size is too
large for the gradient noise and the chain stays hot, which the recorded temperature
shows.

``log p(theta | D)`` is the *full-data*, untempered log posterior: ``N`` times the mean
per-example log-likelihood of the minibatch, plus the log prior (:func:`log_posterior`).
``lr`` plays the role of ``eta = eps^2 / m`` and ``alpha`` the friction (``1 -`` momentum).
For small ``lr`` the chain leaves ``p(theta | D)`` invariant; the noise variance must be
exactly ``2 alpha lr`` (torch-uncertainty's 0.01 factor on it gives a chain that collapses
onto a mode, not a sampler). The `posteriors` library writes the same update per datum
(gradient divided by ``N``) with temperature ``1 / N`` on the noise: the same chain.

Prior: ``theta ~ N(0, I / prior_precision)`` over every parameter. Training with SGD weight
decay ``wd`` on ``N`` examples minimises ``mean NLL + wd / 2 ||theta||^2``, i.e. the log
posterior divided by ``N`` with ``prior_precision = N * wd``
(:func:`prior_precision_from_weight_decay`); that is the default the trainer uses (OptuNet /
MNIST: 60000 * 2e-4 = 12).

A chain is the trainer's loop: ``state = init(base_params)``, then for each step ``k = 1, 2,
...`` a minibatch, ``grad = log_posterior_grad(...)``, ``state = update(state, grad, ...)``,
and the parameters are kept as a sample when ``k`` is in ``chain_schedule(burn_in, thin,
samples)``. Several chains (independent, from different base networks) are several such
loops; every piece here is per chain. Randomness comes only from the ``generator``.

This module is the chain's step; the mass matrix of a whitened chain is in
:mod:`~train_zoo.methods.sghmc_metric`, the steppers that run a chain for the trainer in
:mod:`~train_zoo.methods.sghmc_steppers`, and the method (options, adaptation, sampling)
in :mod:`train_zoo.methods.sghmc`, which re-exports every public name here.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
from torch import nn
from torch.func import grad

from posteriorzoo.errors import InvalidOptionError
from posteriorzoo.options import check_integer, check_number
from train_zoo.methods.common import Params, logits

__all__ = [
    "GradientNoise",
    "SghmcState",
    "beta_hat",
    "chain_schedule",
    "init",
    "kinetic_temperature",
    "noise_update",
    "log_posterior",
    "log_posterior_grad",
    "prior_precision_from_weight_decay",
    "update",
]

MeanNll = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def _integer(name: str, value: object, minimum: int) -> int:
    return check_integer(f"sghmc option {name!r}", value, minimum)


def _number(name: str, value: object, minimum: float, maximum: float | None = None, *,
            strict: bool = False) -> float:
    return float(check_number(f"sghmc option {name!r}", value, minimum, strict=strict,
                              maximum=maximum))


@dataclass(frozen=True)
class SghmcState:
    """One chain's position.

    Attributes
    ----------
    params : dict[str, torch.Tensor]
        ``theta``, keyed like ``model.named_parameters()``.
    momentum : dict[str, torch.Tensor]
        ``v``, same keys, shapes and dtypes.
    step : int
        Updates done so far.
    """

    params: Params
    momentum: Params
    step: int = 0


def init(params: Mapping[str, torch.Tensor],
         momentum: Mapping[str, torch.Tensor] | None = None) -> SghmcState:
    """A chain at ``params`` (detached copies) with momentum ``momentum`` (default zero).

    Parameters
    ----------
    params : Mapping[str, torch.Tensor]
        Starting point, e.g. a trained base network's parameters.
    momentum : Mapping[str, torch.Tensor], optional
        Starting momentum with the same keys and shapes.

    Returns
    -------
    SghmcState
        ``step == 0``.
    """
    if not params:
        raise InvalidOptionError("sghmc option 'params' must hold at least one tensor")
    theta = {name: value.detach().clone() for name, value in params.items()}
    if momentum is None:
        velocity = {name: torch.zeros_like(value) for name, value in theta.items()}
    else:
        _check_like("momentum", momentum, theta)
        velocity = {name: momentum[name].detach().to(theta[name].dtype).clone()
                    for name in theta}
    return SghmcState(params=theta, momentum=velocity, step=0)


def _check_like(name: str, values: Mapping[str, torch.Tensor], like: Params) -> None:
    if set(values) != set(like) or any(values[k].shape != like[k].shape for k in like):
        raise InvalidOptionError(f"sghmc option {name!r} must have the names and shapes of "
                                 f"the chain's parameters")


def _noise_std(lr: float, alpha: float) -> float:
    """Standard deviation of the injected noise: ``sqrt(2 alpha lr)``."""
    return math.sqrt(2.0 * alpha * lr)


@dataclass(frozen=True)
class GradientNoise:
    """Running estimate of the minibatch gradient's variance, per coordinate.

    Attributes
    ----------
    previous : dict[str, torch.Tensor]
        The last minibatch gradient seen, keyed like the chain's parameters.
    variance : dict[str, torch.Tensor]
        ``V_hat``: the bias-corrected exponentially weighted mean of
        ``(g_t - g_{t-1})^2 / 2``.
    count : int
        Differences seen.
    decay : float
        Weight of the past in the running mean.
    """

    previous: Params
    variance: Params
    count: int = 0
    decay: float = 0.99


def noise_update(noise: GradientNoise | None, grad_log_posterior: Mapping[str, torch.Tensor],
                 decay: float) -> GradientNoise:
    """Add one minibatch gradient to the running estimate (``None``: start one).

    Two successive minibatch gradients are independent draws around nearly the same true
    gradient (the chain moves little in one step), so half their squared difference
    estimates the minibatch noise ``V`` without the slower change of the true gradient
    along the chain. The exponentially weighted mean (weight ``1 - decay``) is
    bias-corrected like Adam's moments: ``V_hat = m / (1 - decay^count)``.
    """
    decay = _number("noise_decay", decay, 0, 1, strict=True)
    if decay == 1:
        raise InvalidOptionError("sghmc option 'noise_decay' must be below 1, not 1")
    if noise is None:
        return GradientNoise({k: g.detach().clone() for k, g in grad_log_posterior.items()},
                             {k: torch.zeros_like(g) for k, g in grad_log_posterior.items()},
                             0, decay)
    count = noise.count + 1
    correction = 1.0 - decay ** count
    previous_correction = 1.0 - decay ** noise.count if noise.count else 1.0
    variance = {}
    for name, g in grad_log_posterior.items():
        half_square = 0.5 * (g.detach() - noise.previous[name]) ** 2
        running = noise.variance[name] * previous_correction if noise.count else 0.0
        variance[name] = (decay * running + (1 - decay) * half_square) / correction
    return GradientNoise({k: g.detach().clone() for k, g in grad_log_posterior.items()},
                         variance, count, decay)


#: ``beta_hat`` is capped at this fraction of ``alpha`` (the injected noise stays positive).
BETA_CAP = 0.95


def beta_hat(noise: GradientNoise, lr: float, alpha: float) -> tuple[Params, float]:
    """``min(lr V_hat / 2, BETA_CAP alpha)`` per coordinate, and the fraction capped.

    Returns
    -------
    beta : dict[str, torch.Tensor]
        Keyed like the parameters.
    capped : float
        Fraction of the coordinates whose estimate exceeded the cap (there the chain is
        hotter than its temperature: lower ``lr`` or raise ``alpha``).
    """
    cap = BETA_CAP * alpha
    beta, capped, total = {}, 0, 0
    for name, variance in noise.variance.items():
        raw = 0.5 * lr * variance
        capped += int((raw > cap).sum())
        total += raw.numel()
        beta[name] = raw.clamp(max=cap)
    return beta, capped / max(total, 1)


def kinetic_temperature(state: SghmcState, lr: float) -> float:
    """``mean(v^2) / lr`` over every coordinate of the chain's momentum.

    At the sampler's temperature (1) the momentum of this discretisation has variance
    ``lr / (1 - alpha / 2)`` per coordinate; minibatch noise that was not corrected for
    raises it.
    """
    squares = sum(float(v.double().square().sum()) for v in state.momentum.values())
    count = sum(v.numel() for v in state.momentum.values())
    return squares / count / lr


def update(state: SghmcState, grad_log_posterior: Mapping[str, torch.Tensor], lr: float,
           alpha: float, generator: torch.Generator,
           beta: Mapping[str, torch.Tensor] | None = None) -> SghmcState:
    """One SGHMC step.

    Parameters
    ----------
    state : SghmcState
    grad_log_posterior : Mapping[str, torch.Tensor]
        ``grad log p(theta | D)`` at ``state.params`` (full-data scale, e.g. from
        :func:`log_posterior_grad`), same keys and shapes.
    lr : float
        Learning rate ``eta > 0``.
    alpha : float
        Friction in ``(0, 1]`` (``1 - momentum``).
    generator : torch.Generator
        The only source of randomness (on the parameters' device); one standard normal
        tensor per parameter, in the parameters' order.
    beta : Mapping[str, torch.Tensor], optional
        ``beta_hat`` per coordinate (:func:`beta_hat`), each below ``alpha``; default 0.

    Returns
    -------
    SghmcState
        ``v' = (1 - alpha) v + lr * grad + sqrt(2 (alpha - beta) lr) * z``,
        ``theta' = theta + v'``, ``step + 1``.
    """
    lr = _number("lr", lr, 0, strict=True)
    alpha = _number("alpha", alpha, 0, 1, strict=True)
    _check_like("grad_log_posterior", grad_log_posterior, state.params)
    if beta is not None:
        _check_like("beta", beta, state.params)
    std = _noise_std(lr, alpha)
    params, momentum = {}, {}
    for name, theta in state.params.items():
        noise = torch.randn(theta.shape, generator=generator, dtype=theta.dtype,
                            device=theta.device)
        if beta is not None:
            noise = noise * torch.sqrt(2.0 * (alpha - beta[name].to(theta.dtype)) * lr)
        else:
            noise = std * noise
        velocity = ((1 - alpha) * state.momentum[name]
                    + lr * grad_log_posterior[name].detach().to(theta.dtype) + noise)
        momentum[name] = velocity
        params[name] = theta + velocity
    return SghmcState(params=params, momentum=momentum, step=state.step + 1)


def prior_precision_from_weight_decay(num_data: int, weight_decay: float) -> float:
    """``N * weight_decay``: the Gaussian prior precision SGD weight decay corresponds to."""
    num_data = _integer("num_data", num_data, 1)
    return num_data * _number("weight_decay", weight_decay, 0)


def _cross_entropy(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(outputs, targets)


def log_posterior(model: nn.Module, params: Mapping[str, torch.Tensor],
                  buffers: Mapping[str, torch.Tensor], batch: tuple[torch.Tensor, torch.Tensor],
                  num_data: int, prior_precision: float, *, nll: MeanNll = _cross_entropy
                  ) -> torch.Tensor:
    """Minibatch estimate of the full-data log posterior, up to a constant.

    ``-N * nll(f(x; theta), y) - prior_precision / 2 * ||theta||^2``, with ``nll`` the mean
    negative log-likelihood per example of the batch (cross-entropy by default).

    Parameters
    ----------
    model : torch.nn.Module
        The architecture, evaluated functionally in its current mode (evaluation mode for
        networks with BatchNorm or dropout, unless the trainer wants otherwise).
    params : Mapping[str, torch.Tensor]
        ``theta``, keyed like ``model.named_parameters()``.
    buffers : Mapping[str, torch.Tensor]
        The model's buffers; copies are used, so a training-mode BatchNorm does not change
        them.
    batch : (inputs, targets)
        ``(B, ...)`` inputs and ``(B,)`` targets.
    num_data : int
        ``N``, the training-set size.
    prior_precision : float
        Precision of the prior ``N(0, I / prior_precision)`` (>= 0; 0 is a flat prior).
    nll : callable, default cross-entropy
        ``nll(outputs (B, K), targets) -> scalar`` mean negative log-likelihood (e.g. a
        Gaussian's ``0.5 * mean((outputs[:, 0] - y)^2) / sigma^2`` for regression).

    Returns
    -------
    torch.Tensor
        Scalar.
    """
    num_data = _integer("num_data", num_data, 1)
    prior_precision = _number("prior_precision", prior_precision, 0)
    inputs, targets = batch
    copies = {name: value.clone() for name, value in buffers.items()}
    outputs = logits(model, params, copies, inputs)
    square = sum((value * value).sum() for value in params.values())
    return -num_data * nll(outputs, targets) - 0.5 * prior_precision * square


def log_posterior_grad(model: nn.Module, params: Mapping[str, torch.Tensor],
                       buffers: Mapping[str, torch.Tensor],
                       batch: tuple[torch.Tensor, torch.Tensor], num_data: int,
                       prior_precision: float, *, nll: MeanNll = _cross_entropy) -> Params:
    """``grad log p(theta | D)`` estimated on one minibatch (:func:`log_posterior`).

    Computed with :func:`torch.func.grad`; the arguments are those of
    :func:`log_posterior`. An unbiased estimate of the full-data gradient when the batch
    is drawn uniformly. ``prior_precision`` is ``N * weight_decay`` by default in the
    trainer (:func:`prior_precision_from_weight_decay`).

    Returns
    -------
    dict[str, torch.Tensor]
        Keys and shapes of ``params``.
    """
    num_data = _integer("num_data", num_data, 1)
    prior_precision = _number("prior_precision", prior_precision, 0)

    def objective(theta: Params) -> torch.Tensor:
        return log_posterior(model, theta, buffers, batch, num_data, prior_precision, nll=nll)

    detached = {name: value.detach() for name, value in params.items()}
    return dict(grad(objective)(detached))


def chain_schedule(burn_in: int, thin: int, samples: int) -> list[int]:
    """The steps of a chain whose parameters are kept as samples.

    Steps count updates from 1 (step ``k`` is the state after the ``k``-th update). The
    first ``burn_in`` steps are discarded; then every ``thin``-th step is kept::

        burn_in + thin, burn_in + 2 thin, ..., burn_in + samples * thin

    so the chain runs ``burn_in + samples * thin`` updates in all.

    Parameters
    ----------
    burn_in : int
        Updates discarded (>= 0).
    thin : int
        Updates between kept samples (>= 1).
    samples : int
        Samples kept from this chain (>= 1).

    Returns
    -------
    list of int

    Examples
    --------
    >>> chain_schedule(1000, 50, 3)
    [1050, 1100, 1150]
    """
    burn_in = _integer("burn_in", burn_in, 0)
    thin = _integer("thin", thin, 1)
    samples = _integer("samples", samples, 1)
    return [burn_in + thin * i for i in range(1, samples + 1)]

