"""SGHMC's constant mass matrix: the whitened chain's metric, noise estimate and step.

:class:`Whitening` (``z = L^T theta`` for a posterior precision ``P = L L^T``), the metrics
an adapted chain moves to (:func:`adapted_whitening`, widened where warm-up chains spread;
:func:`noise_equalized_whitening`, stretched where the minibatch noise is largest), the
dense estimate of the minibatch noise (:class:`DenseGradientNoise`,
:func:`dense_noise_update`) and the injected noise it leaves (:func:`dense_noise_factor`),
and the step in whitened coordinates (:func:`whitened_update`). The step is
:func:`train_zoo.methods.sghmc_update.update` in ``z``; the reasons are below. The
stepper that runs such a chain is :class:`~train_zoo.methods.sghmc_steppers.WhitenedSghmcStepper`;
:mod:`train_zoo.methods.sghmc` re-exports every public name here.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from posteriorzoo.errors import InvalidOptionError
from posteriorzoo.options import check_number
from train_zoo.methods.sghmc_update import BETA_CAP, _number

__all__ = [
    "ADAPT_FLOOR",
    "MAX_STEP",
    "NOISE_QUANTILE",
    "STEP_SCALE",
    "DenseGradientNoise",
    "Whitening",
    "adapted_whitening",
    "dense_noise_factor",
    "dense_noise_update",
    "noise_equalized_whitening",
    "whitened_update",
]

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

