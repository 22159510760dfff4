"""SGHMC (Chen et al. 2014): stochastic-gradient Hamiltonian Monte Carlo, one chain.

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
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.func import grad

from posteriorzoo.errors import InvalidOptionError, PosteriorZooError
from posteriorzoo.options import check_integer, check_number
from posteriorzoo.vocabulary import (
    ADAPT_ALPHA,
    ADAPT_BATCH,
    ADAPT_LR,
    ADAPT_ROUND_STEPS,
    ADAPT_STEPS,
    ADAPT_THIN,
    ADAPTED_BATCH,
    ADAPTED_BURN_IN,
    ADAPTED_CHAINS,
    ADAPTED_THIN,
    AUTO_FULL_LAPLACE_PARAMETERS,
    ROUND_DRAWS,
    SGHMC_BURN_IN,
    SGHMC_LR,
    SGHMC_THIN,
    SGHMC_WHITENED_BATCH,
)
from train_zoo.loop import fit
from train_zoo.methods import laplace
from train_zoo.methods.base import (
    Collector,
    Context,
    Method,
    MethodOption,
    ModeRun,
    Posterior,
    Resolved,
    declared_options,
    generator_for,
)
from train_zoo.methods.common import Params, flatten, logits, parameters_of, unflatten

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


# --- A chain with a constant mass matrix ("whitened") ------------------------------------
#
# With a constant mass matrix the chain runs in whitened coordinates ``z = L^T theta``,
# ``L L^T = P`` a posterior precision estimate (the Laplace GGN plus the prior at the base
# network). There the posterior's curvature is close to the identity in every direction,
# so one step size suits them all: on OptuNet the unwhitened chain needs millions of steps
# to cross the flattest directions (the prior alone holds them, curvature 12 against
# about 1e5 for the stiffest), the whitened one a few thousand. A constant mass matrix
# leaves the target invariant (Chen et al. section 3; no correction term), and the update
# is the one above in ``z``: ``v <- (1 - alpha) v + lr_z grad_z + noise``, ``z <- z + v``,
# with ``grad_z = L^-1 grad_theta``.
#
# The minibatch noise of ``grad_z`` is correlated across coordinates, so its estimate is a
# matrix: ``V_hat`` (the running mean of half the outer product of successive gradient
# differences) and ``B_hat = lr_z V_hat / 2``; the injected noise has covariance
# ``2 (alpha I - B_hat) lr_z``, built from ``B_hat``'s eigendecomposition with eigenvalues
# capped at ``BETA_CAP alpha``.


@dataclass(frozen=True)
class Whitening:
    """``z = L^T theta`` for the lower Cholesky factor ``L`` of a precision ``P = L L^T``.

    Attributes
    ----------
    cholesky : torch.Tensor
        ``(d, d)`` lower-triangular float64, ``d`` the number of parameters.
    """

    cholesky: torch.Tensor

    def whiten(self, theta: torch.Tensor) -> torch.Tensor:
        """``(..., d)`` parameters -> whitened coordinates ``L^T theta`` (float64)."""
        return theta.double() @ self.cholesky

    def unwhiten(self, z: torch.Tensor) -> torch.Tensor:
        """``(..., d)`` whitened coordinates -> parameters ``L^-T z`` (float64)."""
        rows = z.reshape(-1, z.shape[-1]).T
        solved = torch.linalg.solve_triangular(self.cholesky.T, rows, upper=True)
        return solved.T.reshape(z.shape)

    def gradient(self, grad_theta: torch.Tensor) -> torch.Tensor:
        """``(..., d)`` gradient in ``theta`` -> gradient in ``z``: ``L^-1 g``."""
        rows = grad_theta.double().reshape(-1, grad_theta.shape[-1]).T
        solved = torch.linalg.solve_triangular(self.cholesky, rows, upper=False)
        return solved.T.reshape(grad_theta.shape)


#: An adapted metric never makes a direction narrower than the Laplace precision says: a
#: warm-up of a few relaxation times underestimates the spread of its slowest directions,
#: and those are the ones the adaptation is for.
ADAPT_FLOOR = 1.0


def adapted_whitening(laplace_whitening: Whitening, trajectories: Sequence[torch.Tensor],
                      temperature: float = 1.0) -> tuple[Whitening, torch.Tensor]:
    """A mass matrix from warm-up chains: the Laplace metric widened where they spread.

    In the Laplace-whitened coordinates ``z = L^T theta`` an exact posterior that the
    Laplace approximation describes has identity covariance. The chains' pooled
    within-chain covariance ``C`` there (divided by ``temperature``: a chain run at kinetic
    temperature T spreads about T times wider) has eigenvalues ``lambda``; each is raised
    to at least :data:`ADAPT_FLOOR`, and the new precision is
    ``L Q diag(1 / lambda') Q^T L^T``. On OptuNet / Fashion-MNIST the chains spread up to
    36 times the Laplace variance along 44 of 392 directions; whitened by the Laplace
    precision alone, a chain crosses those directions slowly, whatever its step.

    Parameters
    ----------
    laplace_whitening : Whitening
        The warm-up's metric, ``(d, d)``.
    trajectories : sequence of tensor
        Each chain's kept states, ``(n_c, d)`` parameters (n_c >= 2).
    temperature : float
        The warm-up chains' kinetic temperature (> 0).

    Returns
    -------
    whitening : Whitening
        The adapted metric.
    variances : tensor
        ``(d,)`` the eigenvalues ``lambda`` before the floor, ascending (float64).
    """
    check_number("temperature", temperature, 0, strict=True)
    size = laplace_whitening.cholesky.shape[0]
    if not trajectories or any(t.dim() != 2 or t.shape[1] != size or t.shape[0] < 2
                               for t in trajectories):
        raise InvalidOptionError(f"adapted_whitening needs chains of at least 2 states of "
                                 f"{size} parameters")
    covariances = [torch.cov(laplace_whitening.whiten(t).T) for t in trajectories]
    pooled = torch.stack(covariances).mean(0) / temperature
    variances, vectors = torch.linalg.eigh(0.5 * (pooled + pooled.T))
    floored = variances.clamp(min=ADAPT_FLOOR)
    return _rescaled(laplace_whitening, vectors, 1.0 / floored), variances


def _rescaled(whitening: Whitening, vectors: torch.Tensor, scales: torch.Tensor
              ) -> Whitening:
    """The metric ``L Q diag(scales) Q^T L^T`` (``Q``: orthonormal ``vectors`` in the
    whitened coordinates of ``whitening = L``; ``scales > 0`` multiply the precision along
    them). Its Cholesky factor comes from the QR decomposition ``F^T = Q' R`` of
    ``F = L Q diag(sqrt(scales))`` (``F F^T = R^T R``), never from ``F F^T`` itself: scales
    of 10^4 and more on an ill-conditioned Laplace precision would square a condition
    number past what float64 factorizes."""
    factor = whitening.cholesky.double() @ (vectors * scales.sqrt())
    upper = torch.linalg.qr(factor.T, mode="r")[1]
    return Whitening((upper.T * torch.sign(torch.diagonal(upper))).contiguous())


#: The noise a step may carry: ``noise_equalized_whitening`` caps every direction's noise
#: at the median direction's, and a cold chain's step is ``STEP_SCALE / v_ref``: then
#: ``lr V / 2`` is at most a quarter of the friction ``alpha = step`` in every direction,
#: which the dense correction removes with room to spare as the noise changes along
#: the chain.
NOISE_QUANTILE, STEP_SCALE = 0.5, 0.5
#: The largest step of a cold chain, in whitened units where the posterior's curvature is
#: about 1 (its discretisation error grows with the step): it binds only where the noise
#: is small, e.g. batches nearly as large as the training set.
MAX_STEP = 0.02


def noise_equalized_whitening(whitening: Whitening, gradients: torch.Tensor,
                              quantile: float = NOISE_QUANTILE
                              ) -> tuple[Whitening, float]:
    """A metric in which no direction's minibatch noise exceeds the ``quantile`` one's.

    Chen et al.'s correction holds only while ``lr V / 2 < alpha`` in every direction,
    so the noisiest direction bounds the step of all of them: on OptuNet, in an adapted
    metric, the noise covariance's eigenvalues span 26,800 to 98 (median). Stretching
    each direction whose noise ``v_i`` exceeds the reference ``v_ref`` by
    ``sqrt(v_i / v_ref)`` (its posterior spread grows by that factor, its noise falls to
    ``v_ref``) lets the chain take the step the median direction allows, and the noisy
    directions move at the speed their noise permits. Directions with less noise keep
    their metric.

    Parameters
    ----------
    whitening : Whitening
        The current metric, ``(d, d)``.
    gradients : tensor
        ``(n, d)`` minibatch gradients of the log posterior (full-data scale) in the
        parameters' coordinates, each centred on its own point's mean; ``n > d``.
    quantile : float
        Which noise eigenvalue is the reference, in (0, 1].

    Returns
    -------
    whitening : Whitening
        The new metric.
    reference : float
        ``v_ref`` (in the new metric every direction's noise is at most this): the
        ``quantile`` of the eigenvalues that are not 0 (above 1e-9 of the largest).
    """
    _number("quantile", quantile, 0, 1, strict=True)
    size = whitening.cholesky.shape[0]
    if gradients.dim() != 2 or gradients.shape[1] != size or gradients.shape[0] <= size:
        raise InvalidOptionError(f"noise_equalized_whitening needs more than {size} "
                                 f"gradients of {size} parameters")
    whitened = whitening.gradient(gradients.double())
    covariance = whitened.T @ whitened / whitened.shape[0]
    noise, vectors = torch.linalg.eigh(0.5 * (covariance + covariance.T))
    # Directions without noise (dead units, the softmax shift) do not count: on a
    # network with many, the median would be 0.
    noisy = noise[noise > noise[-1] * 1e-9]
    reference = float(torch.quantile(noisy, quantile)) if len(noisy) else 0.0
    if not reference > 0:
        raise InvalidOptionError("noise_equalized_whitening: the gradients carry no noise")
    return _rescaled(whitening, vectors, (noise / reference).clamp(min=1.0)), reference


@dataclass(frozen=True)
class DenseGradientNoise:
    """Running estimate of the minibatch gradient's covariance (whitened chain).

    Attributes
    ----------
    previous : torch.Tensor
        ``(d,)`` the last minibatch gradient.
    covariance : torch.Tensor
        ``(d, d)`` ``V_hat``, the bias-corrected exponentially weighted mean of
        ``(g_t - g_{t-1}) (g_t - g_{t-1})^T / 2`` (:func:`noise_update`'s matrix form).
    count : int
    decay : float or None
        None: a plain mean of every difference.
    """

    previous: torch.Tensor
    covariance: torch.Tensor
    count: int = 0
    decay: float | None = 0.99


def dense_noise_update(noise: DenseGradientNoise | None, gradient: torch.Tensor,
                       decay: float | None) -> DenseGradientNoise:
    """Add one ``(d,)`` minibatch gradient to the running covariance (``None``: start).

    ``(n, d)`` gradients of ``n`` parallel chains add the mean of their ``n`` outer
    products. ``decay=None`` weighs every difference equally (a plain mean): a ``d x d``
    covariance needs many more than ``d`` differences before its eigenvalues settle (with
    ``n`` of them they spread by about ``sqrt(d / n)``), more than an exponential window of
    ``1 / (1 - decay)`` steps holds when ``d`` is in the hundreds."""
    if decay is not None:
        decay = _number("noise_decay", decay, 0, 1, strict=True)
        if decay == 1:
            raise InvalidOptionError("sghmc option 'noise_decay' must be below 1, not 1")
    gradient = gradient.detach().double()
    if noise is None:
        size = gradient.shape[-1]
        return DenseGradientNoise(gradient.clone(),
                                  torch.zeros(size, size, dtype=torch.float64), 0, decay)
    count = noise.count + 1
    difference = (gradient - noise.previous).reshape(-1, gradient.shape[-1])
    half_outer = 0.5 * difference.T @ difference / difference.shape[0]
    if decay is None:
        covariance = noise.covariance + (half_outer - noise.covariance) / count
    else:
        previous_correction = 1.0 - decay ** noise.count if noise.count else 0.0
        running = decay * noise.covariance * previous_correction
        covariance = (running + (1 - decay) * half_outer) / (1.0 - decay ** count)
    return DenseGradientNoise(gradient.clone(), covariance, count, decay)


def dense_noise_factor(noise: DenseGradientNoise | None, lr: float, alpha: float, size: int
                       ) -> tuple[torch.Tensor, float]:
    """A factor ``S`` with ``S S^T = 2 (alpha I - B_hat) lr``, and the fraction capped.

    ``B_hat = lr V_hat / 2``; its eigenvalues are capped at ``BETA_CAP alpha`` (the fraction
    of eigenvalues that hit the cap is returned: there the chain runs hot). ``noise=None``
    (no estimate yet) gives ``sqrt(2 alpha lr) I``.

    Returns
    -------
    factor : torch.Tensor
        ``(size, size)`` float64.
    capped : float
    """
    if noise is None:
        return math.sqrt(2.0 * alpha * lr) * torch.eye(size, dtype=torch.float64), 0.0
    eigenvalues, vectors = torch.linalg.eigh(noise.covariance)
    raw = 0.5 * lr * eigenvalues.clamp(min=0.0)
    cap = BETA_CAP * alpha
    beta = raw.clamp(max=cap)
    scale = torch.sqrt(2.0 * (alpha - beta) * lr)
    # The symmetric square root Q diag(scale) Q^T, not Q diag(scale): it does not depend on
    # which basis eigh picks inside a repeated eigenvalue (a rank-deficient early estimate
    # has hundreds of zeros), so rounding differences do not change the injected noise.
    return (vectors * scale) @ vectors.T, float((raw > cap).double().mean())


def whitened_update(z: torch.Tensor, momentum: torch.Tensor, grad_z: torch.Tensor, lr: float,
                    alpha: float, factor: torch.Tensor, generator: torch.Generator
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """One SGHMC step in whitened coordinates (``(d,)``, or ``(n, d)`` for ``n`` parallel
    chains; float64).

    ``v' = (1 - alpha) v + lr grad_z + factor @ xi`` with ``xi ~ N(0, I)`` drawn from
    ``generator``, ``z' = z + v'``. Returns ``(z', v')``.
    """
    xi = torch.randn(z.shape, generator=generator, dtype=torch.float64)
    velocity = (1 - alpha) * momentum + lr * grad_z + xi @ factor.T
    return z + velocity, velocity


# ---------------------------------------------------------------- steppers
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


# ---------------------------------------------------------------- the method
# The numbers of SGHMC's (and SGLD's) options are the vocabulary's, declared once with
# their reasons: MAX_CHAINS, MAX_SGHMC_STEPS; SGHMC_LR, SGHMC_BURN_IN, SGHMC_THIN (measured
# on OptuNet / Fashion-MNIST); SGHMC_WHITENED_LR, SGHMC_WHITENED_BATCH (a preconditioned
# chain's); ADAPT_LR, ADAPT_ALPHA, ADAPT_BATCH, ADAPT_THIN and ADAPT_STEPS (the warm-up of
# preconditioner = "adapted"); ADAPT_ROUNDS, ADAPT_ROUND_STEPS, ADAPTED_BATCH, ROUND_DRAWS,
# SETTLE_STEPS (its cold rounds and settling); ADAPTED_CHAINS, ADAPTED_BURN_IN,
# ADAPTED_THIN (an adapted chain's defaults).
#
# Where a chain's minibatches come from (SGHMC_MINIBATCHES): the recipe's shuffled epochs,
# or independent draws with replacement. Chen et al.'s correction assumes independent
# minibatch noise; within an epoch the batches add up to the whole dataset, so their noise
# cancels over the epoch. A chain whose momentum lasts longer than an epoch (1 / alpha
# steps against N / batch_size) then feels less noise than the estimate subtracts and runs
# cold: four chains at 0.91-0.96 against 1.02 from the same start on OptuNet /
# Fashion-MNIST (batch 1024, alpha 2e-3, 59 batches an epoch), and in
# ``tests/test_sghmc_minibatches.py`` on a Gaussian.
#
# The cold rounds that follow the warm-up (``adapt_rounds``, ``adapt_round_steps``): each
# chain runs at temperature 1 in the noise-equalized metric; the metric is widened from
# the rounds' draws, and sampling starts from the end of the chain with the lowest loss.
# On OptuNet / Fashion-MNIST the chains' training loss keeps falling for about 100,000
# steps after the warm-up (0.657 at the trained network, 0.63 after the warm-up, 0.59
# at the end of the third round); chains started apart in that landscape stay apart
# (R-hat 1.27 after three rounds), chains from the common end mix (median ESS 86 of
# 100, R-hat 1.033, kinetic temperatures 0.975-0.997), all measured from DE member 0.
# From the SGHMC spec's base network (seed 6) the best chain was still descending after
# three rounds (losses 0.721 -> 0.700 -> 0.689), and sampling from there gave ESS 17.6
# and R-hat 1.22; settling it first (SETTLE_STEPS: five segments, to 0.678) gave ESS 64,
# R-hat 1.045 and kinetic temperatures 0.999-1.022 (the shipped file). The settling: the
# lowest-loss chain continues in segments of ``adapt_round_steps``, in the metric
# re-equalized at each segment's start, until its mean loss falls by less than the
# posterior's own energy fluctuation, sqrt(d / 2) / N per example (2.3e-4 on OptuNet,
# d = 392, N = 60,000).
#
# An adapted chain's defaults (what "auto" takes for OptuNet): its cold rounds and
# settling already bring each chain to the posterior, and in the noise-equalized metric
# 1,000 steps decorrelate a sample (lag-1 autocorrelation 0.04): the shipped collection,
# median ESS 64 of 100 and R-hat 1.045. The plain chain's 20,000 and 4,000
# (SGHMC_BURN_IN) gave ESS 8 and R-hat 1.96 on the same posterior.

#: Minibatch gradients (at least, and 5 per parameter) that measure the noise covariance.
NOISE_BATCHES = 2000
#: The running noise estimate of a cold chain: about 1,000 steps, which a d x d
#: covariance of a few hundred parameters needs.
ADAPTED_NOISE_DECAY = 0.999
#: SGHMC steps whose gradients fill the noise estimate before beta_hat is subtracted.
NOISE_WARM_UP = 100
#: Examples per batch when the preconditioner reads the training set.
READ_BATCH = 500


def _preconditioner(what: str, value: object, context: Context) -> object:
    if value == "auto":
        return _preconditioner_auto(context)
    if value in ("laplace", "adapted"):
        laplace.check_dense(what, value, context, "a dense mass matrix", "'none'")
    return value


def _preconditioner_auto(context: Context) -> Resolved:
    # The adapted metric is the one measured to mix on OptuNet (ADAPTED_BURN_IN); it needs
    # a dense d x d matrix, as full Laplace does, so it shares Laplace's size bound.
    bound = AUTO_FULL_LAPLACE_PARAMETERS
    count = context.parameter_count()
    if count <= bound:
        return Resolved("adapted", f"derived from the model ({count:,} parameters <= "
                                   f"{bound:,})")
    return Resolved("none", f"derived from the model ({count:,} parameters > {bound:,})",
                    note=f"{context.method}: preconditioner none (the model's {count:,} "
                         f"parameters are too many for a dense mass matrix; a plain chain at lr "
                         f"{SGHMC_LR:g} mixes slowly: check it with posteriorzoo diagnose)")


def _adapted_default(adapted: int, plain: int) -> Callable[[Context], Resolved]:
    """The default of burn_in or thin: ``adapted`` for an adapted chain, else ``plain``."""
    def default(context: Context) -> Resolved:
        # The preconditioner's value is resolved before this one (table order).
        if context.resolved.get("preconditioner") == "adapted":
            return Resolved(adapted, "default of an adapted chain")
        return Resolved(plain)
    return default


def _chains_default(context: Context) -> Resolved:
    # R-hat compares chains, so an adapted chain defaults to ADAPTED_CHAINS of them; the
    # count must divide samples_per_mode, so it falls to the largest that does.
    if context.resolved.get("preconditioner") != "adapted":
        return Resolved(1)
    per_mode = context.samples_per_mode or ADAPTED_CHAINS
    chains = max(c for c in range(1, ADAPTED_CHAINS + 1) if per_mode % c == 0)
    if chains == ADAPTED_CHAINS:
        return Resolved(chains, "default of an adapted chain")
    return Resolved(chains, f"derived from samples_per_mode={per_mode}",
                    note=f"{context.method}: chains {chains} (derived from "
                         f"samples_per_mode={per_mode}, not a multiple of "
                         f"{ADAPTED_CHAINS}; default {ADAPTED_CHAINS})")


def _batch_size_default(context: Context) -> Resolved:
    # The preconditioner's value is resolved before this one (table order).
    if context.resolved.get("preconditioner") == "adapted":
        return Resolved(ADAPTED_BATCH, "default of an adapted chain")
    if context.resolved.get("preconditioner") == "laplace":
        return Resolved(SGHMC_WHITENED_BATCH, "default of a preconditioned chain")
    return Resolved(context.recipe.batch_size, "derived from the recipe (its batch_size)")


def _minibatches_default(context: Context) -> Resolved:
    # A preconditioned chain runs at a low friction, its momentum outlasting an epoch.
    if context.resolved.get("preconditioner") in ("laplace", "adapted"):
        return Resolved("independent", "default of a preconditioned chain")
    return Resolved("epochs", "default")


def _preconditioned(context: Context) -> bool:
    # A chain without one records none of its options, as collections made before the
    # preconditioner existed (or before "auto" was its default) did.
    return context.resolved["preconditioner"] != "none"


def _adapted(context: Context) -> bool:
    return context.resolved["preconditioner"] == "adapted"


def _options(method: str) -> tuple[MethodOption, ...]:
    """The options of ``method`` (``sghmc``, or ``sgld``: the same without ``alpha``), with
    the rules of their derived defaults, what a collection records, and ``auto`` and the
    dense-matrix limit of the preconditioner."""
    return declared_options(
        method, checks={"preconditioner": _preconditioner},
        defaults={"burn_in": _adapted_default(ADAPTED_BURN_IN, SGHMC_BURN_IN),
                  "thin": _adapted_default(ADAPTED_THIN, SGHMC_THIN),
                  "chains": _chains_default, "batch_size": _batch_size_default,
                  "minibatches": _minibatches_default},
        recorded={"preconditioner": _preconditioned, "adapt_steps": _adapted,
                  "adapt_rounds": _adapted, "adapt_round_steps": _adapted,
                  "settle_steps": _adapted, "whitened_lr": _preconditioned,
                  "batch_size": lambda context: (context.resolved["batch_size"]
                                                 != context.recipe.batch_size),
                  "minibatches": lambda context: (context.resolved["minibatches"] != "epochs"
                                                  or _preconditioned(context))})


def chain_seed(seed: int, chain: int) -> int:
    """Chain 0 keeps the mode's own seed (a one-chain mode is unchanged); chain c > 0 a
    word derived from (seed, c)."""
    if chain == 0:
        return seed
    return int(np.random.SeedSequence([seed, chain]).generate_state(1, np.uint32)[0])


def round_seed(seed: int, number: int, chain: int | None = None) -> int:
    """The batch order of cold round ``number`` (of chain ``chain``; None: the round's
    noise measurement)."""
    words = [seed, number, 0xC01D] + ([] if chain is None else [chain])
    return int(np.random.SeedSequence(words).generate_state(1, np.uint32)[0])


def _copy(params: Params) -> Params:
    return {name: value.detach().clone() for name, value in params.items()}


def settle_seed(seed: int, segment: int, batches: bool) -> int:
    """Settling segment ``segment``'s batch order (``batches``) or noise measurement."""
    words = [seed, segment, 0x5E77, int(batches)]
    return int(np.random.SeedSequence(words).generate_state(1, np.uint32)[0])


def settled_loss_drop(size: int, num_data: int) -> float:
    """The fall in mean loss per example below which a chain counts as settled: one
    standard deviation of a ``size``-parameter Gaussian posterior's energy, sqrt(d / 2),
    per example of ``num_data``."""
    return math.sqrt(size / 2) / num_data


def noise_seed(seed: int, point: int) -> int:
    """The batches that measure the minibatch noise at point ``point``."""
    return int(np.random.SeedSequence([seed, point, 0x5EED]).generate_state(1, np.uint32)[0])


def adaptation_seed(seed: int, chain: int) -> int:
    """The batch order of chain ``chain``'s warm-up: a word derived from (seed, chain,
    and a tag), so that the sampling that follows does not replay its batches."""
    return int(np.random.SeedSequence([seed, chain, 0xADA]).generate_state(1, np.uint32)[0])


@dataclass(frozen=True)
class SghmcChains:
    """The kept samples of a mode's chains (state_dicts, chain-major) and the chain each
    was drawn from (stored as the metadata column ``chain``)."""

    samples: list[dict[str, torch.Tensor]]
    chains: list[int]


class Sghmc(Method):
    """SGHMC: ``chains`` independent chains from each trained base network, each keeping
    ``samples_per_mode / chains`` samples (chain-major: sample j is chain
    ``j // (samples_per_mode / chains)``).

    With ``preconditioner = "laplace"`` each chain runs in the whitened coordinates of the
    base network's Laplace precision (:class:`WhitenedSghmcStepper`) at ``whitened_lr``, on
    minibatches of ``batch_size``, and starts from its own draw of that Laplace
    approximation (so that R-hat compares chains started apart).

    With ``preconditioner = "adapted"`` every chain first warms up for ``adapt_steps`` in
    that metric at a cheap hot setting (:data:`ADAPT_LR`); the metric is then widened
    along the directions the warm-ups spread over (:func:`adapted_whitening`). On OptuNet
    the posterior spreads up to 36 times the Laplace variance along a few dozen
    directions, which a chain in the Laplace metric crosses too slowly to mix. Then
    ``adapt_rounds`` cold rounds (:meth:`_cold_rounds`): each chain runs
    ``adapt_round_steps`` at temperature 1 in the metric whose noisiest directions are
    stretched to the median's noise (:func:`noise_equalized_whitening`), at the step
    :data:`STEP_SCALE` ``/ v_ref`` with friction equal to the step, on independent
    minibatches with a running dense correction; the metric is widened from each round
    but the last. The last round's lowest-loss chain then settles alone (:meth:`_settle`,
    at most ``settle_steps``) until its loss stops falling. Sampling starts every chain
    from where it settled, in the metric re-equalized there."""

    name = "sghmc"
    summary = "stochastic-gradient HMC chains from each trained base network"
    #: The friction of the kept steps; None: the ``alpha`` option (an adapted chain's cold
    #: rounds derive their own). SGLD (:mod:`train_zoo.methods.sgld`) is this chain at 1.
    sampling_friction: float | None = None

    def _friction(self, opts: Mapping[str, Any], derived: float | None = None) -> float:
        if self.sampling_friction is not None:
            return self.sampling_friction
        return derived if derived is not None else opts["alpha"]

    options = _options("sghmc")

    def _whitening(self, run: ModeRun, model: nn.Module, params: Params, buffers: Params,
                   prior: float) -> Whitening:
        """The constant mass matrix of a ``preconditioner = "laplace"`` chain: the full
        Laplace posterior precision (GGN + prior, unaugmented training data) at the base
        network."""
        try:
            state = laplace.init(model, params, buffers,
                                 run.engine.read_batches(run.seeds.method, READ_BATCH),
                                 run.num_data, structure="full", prior_precision=prior)
        except PosteriorZooError as error:
            raise type(error)(f"sghmc preconditioner: {error}") from None
        curvature = state.curvature
        if not isinstance(curvature, laplace.FullCurvature):  # structure="full" above
            raise TypeError(f"sghmc preconditioner: a full curvature was asked for, not "
                            f"{type(curvature).__name__}")
        return Whitening(curvature.cholesky.double())

    def phase_steps(self, spec: Any, steps_per_epoch: int) -> int:
        """Every chain's steps up to its last kept sample; an adapted chain's settling
        (one chain's) counted at ``settle_steps``, its limit."""
        options = spec.method_options
        chains = options["chains"]
        per_chain = spec.samples_per_mode // chains
        warm_up = 0
        if options.get("preconditioner") == "adapted":
            warm_up = (options.get("adapt_steps", ADAPT_STEPS)
                       + options.get("adapt_rounds", 0)
                       * options.get("adapt_round_steps", ADAPT_ROUND_STEPS))
        settling = (options.get("settle_steps", 0) if options.get("adapt_rounds", 0)
                    and options.get("preconditioner") == "adapted" else 0)
        return settling + chains * (warm_up + chain_schedule(options["burn_in"],
                                                             options["thin"], per_chain)[-1])

    def fit(self, run: ModeRun) -> Posterior:
        spec, seeds, engine = run.spec, run.seeds, run.engine
        model, steps = engine.train_base()
        opts = spec.method_options
        num_data = run.num_data
        prior = opts["prior_precision"]
        if prior == "training":
            prior = prior_precision_from_weight_decay(num_data, spec.recipe.weight_decay)
        chains = opts["chains"]
        keep = chain_schedule(opts["burn_in"], opts["thin"], spec.samples_per_mode // chains)
        params, buffers = parameters_of(model)
        preconditioner = opts.get("preconditioner", "none")
        whitened = preconditioner in ("laplace", "adapted")
        batch_size = opts.get("batch_size") or spec.recipe.batch_size
        whitening = (self._whitening(run, model, params, buffers, prior)
                     if whitened else None)
        gradient = engine.log_posterior(model, params, buffers, num_data, prior)
        eta = opts["whitened_lr"] if whitened else opts["lr"] / num_data
        steps_per_epoch = math.ceil(num_data / batch_size)
        noise_decay = opts["noise_decay"] if opts["noise_correction"] else None
        independent = opts.get("minibatches", "epochs") == "independent"
        generators = [generator_for(chain_seed(seeds.sample, chain)) for chain in range(chains)]
        starts: Sequence[Params | None] = [None] * chains
        adaptation, alpha, running = None, self._friction(opts), False
        if preconditioner == "adapted":
            if whitening is None:  # whitened: _whitening set it above
                raise AssertionError("an adapted sghmc chain starts from the Laplace metric")
            whitening, adapted, adaptation, adapt_steps = self._adapt(
                run, model, params, gradient, whitening, generators,
                opts.get("adapt_steps", ADAPT_STEPS), noise_decay, independent)
            starts = adapted
            steps += adapt_steps
            if opts.get("adapt_rounds", 0):
                # a cold chain's running estimate spans about 1,000 steps
                noise_decay = ADAPTED_NOISE_DECAY if noise_decay is not None else None
                cold = self._cold_rounds(run, model, gradient, whitening, adapted,
                                         generators, opts, batch_size, independent,
                                         noise_decay)
                whitening, starts, eta, alpha, record = cold
                alpha = self._friction(opts, alpha)
                adaptation["cold"] = record
                steps += (sum(sum(r["steps"]) for r in record["rounds"])
                          + record["settling"]["steps"])
                running = True
        samples, records, chain_ids = [], [], []
        for chain in range(chains):
            generator = generators[chain]
            stepper: SghmcStepper | WhitenedSghmcStepper
            begin = starts[chain]
            if begin is not None:  # from where its adaptation ended
                if whitening is None:  # only an adapted chain has a start
                    raise AssertionError("an adapted sghmc chain has its metric")
                stepper = WhitenedSghmcStepper(
                    begin, gradient, whitening, eta, alpha, generator,
                    keep[-1], noise_decay=noise_decay, warm_up=NOISE_WARM_UP,
                    record_from=opts["burn_in"], running=running)
            elif whitening is not None:
                size = whitening.cholesky.shape[0]
                start = torch.randn(size, generator=generator, dtype=torch.float64)
                stepper = WhitenedSghmcStepper(
                    params, gradient, whitening, eta, alpha, generator, keep[-1],
                    start_offset=start, noise_decay=noise_decay, warm_up=NOISE_WARM_UP,
                    record_from=opts["burn_in"])
            else:
                stepper = SghmcStepper(params, gradient, eta, alpha, generator,
                                       keep[-1], noise_decay=noise_decay,
                                       warm_up=NOISE_WARM_UP, record_from=opts["burn_in"])
            collector = Collector(list(params), steps=set(keep))
            result = fit(stepper, engine.batches(model, chain_seed(seeds.method, chain),
                                                 batch_size, replacement=independent),
                         lambda epoch: eta, math.ceil(keep[-1] / steps_per_epoch),
                         index=run.index, phase=self.name,
                         callbacks=[*run.callbacks, collector])
            kept = collector.kept
            while len(kept) < len(keep):  # a chain that diverged: its last state
                last = stepper.arrays()
                kept.append({name: torch.tensor(last[name]) for name in params})
            samples += [{**sample, **buffers} for sample in kept]
            chain_ids += [chain] * len(kept)
            records.append({"chain": chain, **stepper.record()})
            steps += result.steps
        record = {"method": self.name, "chains": records,
                  "preconditioner": preconditioner if whitened else "none",
                  "batch_size": batch_size}
        if adaptation is not None:
            record["adaptation"] = adaptation
        return Posterior(SghmcChains(samples, chain_ids), steps, engine.name, record)

    def _adapt(self, run: ModeRun, model: nn.Module, params: Params,
               gradient: LogPosteriorGradient, whitening: Whitening,
               generators: Sequence[torch.Generator], adapt_steps: int,
               noise_decay: float | None, independent: bool
               ) -> tuple[Whitening, list[Params], dict[str, Any], int]:
        """Each chain's warm-up in the Laplace metric (from its own draw of the Laplace
        approximation), then the adapted metric from all of them
        (:func:`adapted_whitening`). Returns the metric, each chain's end state, the
        adaptation's record and the steps taken."""
        half = adapt_steps // 2
        keep = set(range(half + ADAPT_THIN, adapt_steps + 1, ADAPT_THIN))
        steps_per_epoch = math.ceil(run.num_data / ADAPT_BATCH)
        trajectories, ends, temperatures, steps = [], [], [], 0
        size = whitening.cholesky.shape[0]
        for chain, generator in enumerate(generators):
            start = torch.randn(size, generator=generator, dtype=torch.float64)
            stepper = WhitenedSghmcStepper(
                params, gradient, whitening, ADAPT_LR, ADAPT_ALPHA, generator, adapt_steps,
                start_offset=start, noise_decay=noise_decay, warm_up=NOISE_WARM_UP,
                record_from=half)
            collector = Collector(list(params), steps=keep)
            batches = run.engine.batches(model, adaptation_seed(run.seeds.method, chain),
                                         ADAPT_BATCH, replacement=independent)
            result = fit(stepper, batches, lambda epoch: ADAPT_LR,
                         math.ceil(adapt_steps / steps_per_epoch), index=run.index,
                         phase=f"{self.name}-adapt", callbacks=[*run.callbacks, collector])
            steps += result.steps
            temperature = stepper.record()["kinetic_temperature"]
            if temperature is None or len(collector.kept) < 2:
                raise PosteriorZooError(f"sghmc adaptation: chain {chain}'s warm-up diverged; "
                                        f"lower whitened_lr or raise adapt_steps")
            temperatures.append(temperature)
            trajectories.append(torch.stack([flatten(state).double()
                                             for state in collector.kept]))
            ends.append(_copy(stepper.params))
        temperature = sum(temperatures) / len(temperatures)
        adapted, variances = adapted_whitening(whitening, trajectories, temperature)
        record = {"steps": adapt_steps, "kept_per_chain": len(keep),
                  "kinetic_temperatures": temperatures,
                  "widened_directions": int((variances > ADAPT_FLOOR).sum()),
                  "largest_variance_ratio": float(variances[-1]),
                  "median_variance_ratio": float(variances.median())}
        return adapted, ends, record, steps

    def _noise_gradients(self, run: ModeRun, model: nn.Module, gradient: LogPosteriorGradient,
                         points: Sequence[Params], batch_size: int, seed: int
                         ) -> torch.Tensor:
        """``(n, d)`` independent minibatch gradients, ``n / len(points)`` at each point,
        each point's centred on their mean: a sample of the minibatch noise there."""
        size = sum(value.numel() for value in points[0].values())
        per_point = math.ceil(max(NOISE_BATCHES, 5 * size) / len(points))
        centred = []
        for number, point in enumerate(points):
            source = run.engine.batches(model, noise_seed(seed, number), batch_size,
                                        replacement=True)
            batches = (batch for epoch in itertools.count() for batch in source(epoch))
            sample = torch.stack([flatten(gradient(point, next(batches))[1]).double()
                                  for _ in range(per_point)])
            centred.append(sample - sample.mean(0))
        return torch.cat(centred)

    def _equalized(self, run: ModeRun, model: nn.Module, gradient: LogPosteriorGradient,
                   base: Whitening, points: Sequence[Params], batch_size: int, seed: int
                   ) -> tuple[Whitening, float, float, float]:
        """The noise-equalized metric at ``points``, its step's ``lr`` and ``alpha``, and
        the noise reference."""
        metric, reference = noise_equalized_whitening(
            base, self._noise_gradients(run, model, gradient, points, batch_size, seed))
        step = min(STEP_SCALE / reference, MAX_STEP)
        return metric, step * step, step, reference

    def _cold_chain(self, run: ModeRun, model: nn.Module, gradient: LogPosteriorGradient,
                    metric: Whitening, lr: float, alpha: float, start: Params,
                    generator: torch.Generator, steps: int, batch_size: int, batch_seed: int,
                    independent: bool, noise_decay: float | None, phase: str,
                    keep: set[int]) -> tuple[WhitenedSghmcStepper, list[Params], int]:
        """One chain at temperature 1 from ``start`` for ``steps`` steps, with a running
        dense correction: its stepper, the states kept at ``keep`` and the steps taken.
        Raises when it diverged."""
        stepper = WhitenedSghmcStepper(start, gradient, metric, lr, alpha, generator, steps,
                                       noise_decay=noise_decay, warm_up=NOISE_WARM_UP,
                                       record_from=steps // 2, running=True)
        collector = Collector(list(start), steps=keep)
        batches = run.engine.batches(model, batch_seed, batch_size, replacement=independent)
        steps_per_epoch = math.ceil(run.num_data / batch_size)
        result = fit(stepper, batches, lambda epoch: lr, math.ceil(steps / steps_per_epoch),
                     index=run.index, phase=phase, callbacks=[*run.callbacks, collector])
        if stepper.steps < steps or not math.isfinite(stepper.loss_sum):  # stopped early
            raise PosteriorZooError(f"sghmc {phase}: the chain diverged; raise "
                                    f"adapt_round_steps or adapt_steps")
        return stepper, collector.kept, result.steps

    def _cold_rounds(self, run: ModeRun, model: nn.Module,
                     gradient: LogPosteriorGradient, base: Whitening,
                     starts: list[Params], generators: Sequence[torch.Generator],
                     opts: Mapping[str, Any], batch_size: int, independent: bool,
                     noise_decay: float | None
                     ) -> tuple[Whitening, list[Params], float, float, dict[str, Any]]:
        """The cold rounds after the warm-up, then the settling of their lowest-loss chain
        (:meth:`_settle`). Returns the sampling metric, every chain's start (the settled
        chain's end), the sampling ``lr`` and ``alpha``, and the record."""
        rounds, round_steps = opts["adapt_rounds"], opts["adapt_round_steps"]
        thin = max(1, round_steps // ROUND_DRAWS)
        keep = set(range(thin, round_steps + 1, thin))
        seed = run.seeds.method
        records: list[dict[str, Any]] = []
        losses: list[float] = []
        ends = list(starts)
        for number in range(rounds):
            metric, lr, alpha, reference = self._equalized(run, model, gradient, base, ends,
                                                           batch_size, round_seed(seed, number))
            trajectories, temperatures, losses, finished, steps = [], [], [], [], []
            for chain, generator in enumerate(generators):
                stepper, kept, taken = self._cold_chain(
                    run, model, gradient, metric, lr, alpha, ends[chain], generator,
                    round_steps, batch_size, round_seed(seed, number, chain), independent,
                    noise_decay, f"{self.name}-round-{number + 1}", keep)
                trajectories.append(torch.stack([flatten(state).double() for state in kept]))
                temperatures.append(stepper.record()["kinetic_temperature"])
                losses.append(stepper.loss_sum / stepper.record()["recorded_steps"])
                finished.append(_copy(stepper.params))
                steps.append(taken)
            ends = finished
            record = {"lr": lr, "alpha": alpha, "noise_reference": reference,
                      "kinetic_temperatures": temperatures, "mean_losses": losses,
                      "steps": steps}
            if number < rounds - 1:
                base, variances = adapted_whitening(base, trajectories)
                record["widened_directions"] = int((variances > ADAPT_FLOOR).sum())
            records.append(record)
        best = int(np.argmin(losses))
        start, settling = self._settle(run, model, gradient, base, ends[best], losses[best],
                                       generators[best], opts, batch_size, independent,
                                       noise_decay)
        metric, lr, alpha, reference = self._equalized(run, model, gradient, base, [start],
                                                       batch_size, round_seed(seed, rounds))
        record = {"rounds": records, "start_chain": best, "settling": settling, "lr": lr,
                  "alpha": alpha, "noise_reference": reference}
        return metric, [start] * len(generators), lr, alpha, record

    def _settle(self, run: ModeRun, model: nn.Module, gradient: LogPosteriorGradient,
                base: Whitening, start: Params, loss: float, generator: torch.Generator,
                opts: Mapping[str, Any], batch_size: int, independent: bool,
                noise_decay: float | None) -> tuple[Params, dict[str, Any]]:
        """The rounds' lowest-loss chain (at ``start``, mean loss ``loss`` in its last
        round) continues alone, ``adapt_round_steps`` at a time, in ``base``
        re-equalized at each segment's start, until its mean loss falls by less than
        :func:`settled_loss_drop` or ``settle_steps`` run out. Chains started from a
        point that is still descending carry the descent into the samples (on OptuNet:
        R-hat 1.22 from a chain whose loss was falling 0.01 a round). Returns its end
        and the record."""
        limit, segment = opts.get("settle_steps", 0), opts["adapt_round_steps"]
        size = sum(value.numel() for value in start.values())
        tolerance = settled_loss_drop(size, run.num_data)
        losses: list[float] = []
        temperatures: list[float | None] = []
        steps, settled = 0, False
        while not settled and steps + segment <= limit:
            number = len(losses)
            metric, lr, alpha, _ = self._equalized(
                run, model, gradient, base, [start], batch_size,
                settle_seed(run.seeds.method, number, False))
            stepper, _, taken = self._cold_chain(
                run, model, gradient, metric, lr, alpha, start, generator, segment,
                batch_size, settle_seed(run.seeds.method, number, True), independent,
                noise_decay, f"{self.name}-settle-{number + 1}", set())
            mean = stepper.loss_sum / stepper.record()["recorded_steps"]
            settled = loss - mean < tolerance
            loss, start, steps = mean, _copy(stepper.params), steps + taken
            losses.append(mean)
            temperatures.append(stepper.record()["kinetic_temperature"])
        return start, {"mean_losses": losses, "kinetic_temperatures": temperatures,
                       "steps": steps, "tolerance": tolerance, "settled": settled}

    def sample(self, state: SghmcChains, generator: torch.Generator, count: int
               ) -> list[dict[str, torch.Tensor]]:
        """The first ``count`` kept samples: a chain's randomness is drawn while it runs
        (from the mode's ``sample`` seed), so ``generator`` is not used."""
        count = check_integer("sghmc option 'count'", count, 1, len(state.samples))
        return state.samples[:count]

    def sample_chains(self, state: SghmcChains, count: int) -> list[int]:
        """The chain each of the first ``count`` samples was drawn from (what
        :meth:`sample` returns, in its order)."""
        return state.chains[:count]


METHOD = Sghmc()
