"""Bayes by Backprop's loss: the prior, the KL and the negative ELBO with its gradients.

:func:`kl_divergence` (closed form for a Gaussian prior), :func:`kl_estimate` and
:func:`log_prior` (the scale-mixture prior's Monte Carlo KL), and :func:`elbo_and_grad` /
:func:`loss_and_grad`: the negative ELBO per example on a batch, its terms
(:class:`ElboTerms`) and its gradients with respect to ``mu`` and ``rho`` by the
reparameterisation trick on ``torch.func``. The objective is written out in
:mod:`train_zoo.methods.bbb`'s docstring; this module is the code of that formula alone,
apart from the optimisers (:mod:`~train_zoo.methods.bbb_update`) that consume its
gradients and from the state (:mod:`~train_zoo.methods.bbb_state`) it is evaluated at.
Every public name is re-exported by :mod:`train_zoo.methods.bbb`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.func import grad_and_value

from posteriorzoo.errors import InvalidOptionError
from posteriorzoo.options import show
from train_zoo.methods.bbb_options import BBBOptions
from train_zoo.methods.bbb_state import BBBGrads, BBBState, _weights, draw_noise
from train_zoo.methods.common import Params, mean_nll

__all__ = [
    "NLL",
    "ElboTerms",
    "elbo_and_grad",
    "kl_divergence",
    "kl_estimate",
    "log_prior",
    "loss_and_grad",
]

#: ``nll(model, params, buffers, batch)`` -> scalar tensor: the minibatch mean negative
#: log-likelihood in nats per example (:func:`~train_zoo.methods.common.mean_nll`).
NLL = Callable[[nn.Module, Mapping[str, Tensor], Mapping[str, Tensor], tuple[Tensor, Tensor]],
               Tensor]

_HALF_LOG_2PI = 0.5 * math.log(2 * math.pi)


def _gaussian_kl(mu: Mapping[str, Tensor], sigma: Mapping[str, Tensor],
                 prior_sigma: float) -> Tensor:
    total: Tensor | float = 0.0
    for name, s in sigma.items():
        m = mu[name]
        total = total + (math.log(prior_sigma) - torch.log(s)
                         + (s * s + m * m) / (2 * prior_sigma ** 2) - 0.5).sum()
    return torch.as_tensor(total)


def _log_prior(weights: Mapping[str, Tensor], names: Sequence[str], opts: BBBOptions) -> Tensor:
    total: Tensor | float = 0.0
    s1, s2, pi = float(opts.prior_sigma), float(opts.prior_sigma2), float(opts.prior_pi)
    for name in names:
        w2 = weights[name] * weights[name]
        first = -w2 / (2 * s1 * s1) - math.log(s1) - _HALF_LOG_2PI
        if pi == 1:
            total = total + first.sum()
            continue
        second = -w2 / (2 * s2 * s2) - math.log(s2) - _HALF_LOG_2PI
        total = total + torch.logaddexp(first + math.log(pi), second + math.log1p(-pi)).sum()
    return torch.as_tensor(total)


def kl_divergence(state: BBBState) -> Tensor:
    """The exact ``KL(q || prior)`` for a Gaussian prior (``prior_pi = 1``), summed over
    the variational parameters (a 0-d tensor)."""
    if not state.options.closed_form_kl:
        raise InvalidOptionError("prior_pi must be 1 for the closed-form KL, "
                                 f"not {show(state.options.prior_pi)}")
    return _gaussian_kl(state.mu, state.sigma, float(state.options.prior_sigma))


def log_prior(state: BBBState, weights: Mapping[str, Tensor]) -> Tensor:
    """``log p(w)`` of the variational parameters of ``weights`` under the scale-mixture
    prior (a 0-d tensor; point estimates have no prior)."""
    return _log_prior(weights, list(state.rho), state.options)


def _mc_kl_term(sigma: Mapping[str, Tensor], eps: Mapping[str, Tensor],
                weights: Mapping[str, Tensor], opts: BBBOptions) -> Tensor:
    """``log q(w) - log p(w)`` at ``w = mu + sigma * eps``, summed over the variational
    parameters."""
    # log q(w) through eps itself: (w - mu) / sigma would lose precision.
    log_q = sum((-torch.log(s) - 0.5 * eps[name] * eps[name] - _HALF_LOG_2PI).sum()
                for name, s in sigma.items())
    return log_q - _log_prior(weights, list(sigma), opts)


def kl_estimate(state: BBBState, noise: Sequence[Mapping[str, Tensor]]) -> Tensor:
    """The Monte Carlo KL: ``log q(w) - log p(w)`` at ``w = mu + softplus(rho) * eps``
    for each ``eps`` of ``noise``, summed over the variational parameters and averaged
    over the draws (a 0-d tensor). Its expectation is ``KL(q || prior)``; the training
    loss uses it when the prior is a mixture (``prior_pi < 1``)."""
    if not noise:
        raise InvalidOptionError("kl_estimate needs at least one noise draw")
    sigma = state.sigma
    total = sum(_mc_kl_term(sigma, eps, _weights(state.mu, sigma, eps), state.options)
                for eps in noise)
    return torch.as_tensor(total) / len(noise)


def _negative_elbo(mu: Params, rho: Params, noise: Sequence[Mapping[str, Tensor]],
                   model: nn.Module, buffers: Mapping[str, Tensor],
                   batch: tuple[Tensor, Tensor], opts: BBBOptions, kl_weight: float,
                   nll: NLL) -> tuple[Tensor, tuple[Tensor, Tensor]]:
    """``(loss, (mean nll, kl))`` at ``mu, rho`` for the given noise (see
    :mod:`train_zoo.methods.bbb`'s docstring)."""
    sigma = {name: nn.functional.softplus(value) for name, value in rho.items()}
    data: Tensor | float = 0.0
    mc_kl: Tensor | float = 0.0
    for eps in noise:
        weights = _weights(mu, sigma, eps)
        data = data + nll(model, weights, buffers, batch)
        if not opts.closed_form_kl:
            mc_kl = mc_kl + _mc_kl_term(sigma, eps, weights, opts)
    if not isinstance(data, Tensor):
        raise ValueError("the ELBO needs at least one noise draw")
    data = data / len(noise)
    if opts.closed_form_kl:
        kl = _gaussian_kl(mu, sigma, float(opts.prior_sigma))
    else:
        kl = torch.as_tensor(mc_kl) / len(noise)
    return data + kl_weight * kl, (data.detach(), kl.detach())


@dataclass(frozen=True)
class ElboTerms:
    """One step's negative ELBO per example and its terms (0-d tensors).

    Attributes
    ----------
    loss : tensor
        ``nll + kl_weight * kl``.
    nll : tensor
        The expected negative log-likelihood per example: the minibatch mean NLL averaged
        over the weight samples.
    kl : tensor
        ``KL(q || prior)`` in nats, summed over the variational parameters (closed form,
        or the Monte Carlo estimate at the same samples).
    kl_weight : float
        The KL's factor.
    """

    loss: Tensor
    nll: Tensor
    kl: Tensor
    kl_weight: float


def elbo_and_grad(state: BBBState, model: nn.Module, buffers: Mapping[str, Tensor],
                  batch: tuple[Tensor, Tensor], generator: torch.Generator | None,
                  num_data: int, *, nll: NLL = mean_nll,
                  noise: Sequence[Mapping[str, Tensor]] | None = None
                  ) -> tuple[ElboTerms, BBBGrads]:
    """The negative ELBO per example on ``batch``, its terms, and its gradients
    (reparameterisation).

    Parameters
    ----------
    state : BBBState
    model : nn.Module
        The base architecture, evaluated with ``torch.func.functional_call``.
    buffers : dict of str to tensor
        The model's buffers (BatchNorm statistics; updated in place in training mode).
    batch : (tensor ``(B, C, H, W)``, int64 tensor ``(B,)``)
        Images and labels (or whatever ``nll`` takes).
    generator : torch.Generator
        Source of the ``elbo_samples`` noise draws (:func:`draw_noise`).
    num_data : int
        Training-set size ``N`` (the default KL weight is ``1 / N``).
    nll : callable, default :func:`~train_zoo.methods.common.mean_nll`
        ``nll(model, params, buffers, batch)``: minibatch mean negative log-likelihood.
    noise : sequence of dicts, optional
        The ``eps`` draws to use instead of drawing from ``generator`` (their count sets
        the number of samples).

    Returns
    -------
    terms : ElboTerms
        ``loss = mean_s nll(w_s) + kl_weight * KL`` and its terms (detached).
    grads : BBBGrads
        d loss / d mu (every parameter) and d loss / d rho (variational ones).
    """
    opts = state.options
    kl_weight = opts.kl_weight_for(num_data)
    if noise is None:
        if generator is None:
            raise ValueError("loss_and_grad needs a generator (or the noise itself)")
        noise = draw_noise(state.rho, generator, opts.elbo_samples)
    (grad_mu, grad_rho), (loss, (data, kl)) = grad_and_value(
        _negative_elbo, argnums=(0, 1), has_aux=True)(
            dict(state.mu), dict(state.rho), noise, model, buffers, batch, opts, kl_weight, nll)
    return (ElboTerms(loss.detach(), data, kl, kl_weight),
            BBBGrads(mu=grad_mu, rho=grad_rho))


def loss_and_grad(state: BBBState, model: nn.Module, buffers: Mapping[str, Tensor],
                  batch: tuple[Tensor, Tensor], generator: torch.Generator | None,
                  num_data: int, *, nll: NLL = mean_nll,
                  noise: Sequence[Mapping[str, Tensor]] | None = None
                  ) -> tuple[Tensor, BBBGrads]:
    """:func:`elbo_and_grad` with the loss alone: ``(loss, grads)``, the loss a detached
    0-d tensor."""
    terms, grads = elbo_and_grad(state, model, buffers, batch, generator, num_data, nll=nll,
                                 noise=noise)
    return terms.loss, grads
