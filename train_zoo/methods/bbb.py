"""Bayes by Backprop (Blundell et al. 2015): a mean-field Gaussian posterior over the weights.

Every weight ``w`` of a Linear or Conv layer (weights and biases) gets its own Gaussian
``q(w) = N(mu, sigma^2)`` with ``sigma = softplus(rho) = log1p(exp(rho))``. Settings follow
BLiTZ and torch-uncertainty (``METHODS_NOTES.md``), which agree:

- initialisation: ``mu ~ N(0, 0.1^2)`` (0.1 is the standard deviation), ``rho ~ N(-7, 0.1^2)``
  for Linear layers and ``N(-6, 0.1^2)`` for Conv layers; a bias takes its layer's values.
  The layer type is read from the module that owns the parameter.
- prior: the scale mixture ``pi N(0, sigma1^2) + (1 - pi) N(0, sigma2^2)`` on every
  weight, by default ``pi = 1`` and ``sigma1 = 0.1``, i.e. ``N(0, 0.1^2)``.
- loss per step (the negative ELBO per training example)::

      L = 1/S sum_s NLL(w_s) + kl_weight * KL(q || prior),   w_s = mu + sigma * eps_s

  with ``S = elbo_samples = 3`` reparameterised weight samples ``eps_s ~ N(0, I)``, NLL the
  minibatch *mean* negative log-likelihood (cross-entropy by default, pluggable) and
  ``kl_weight = 1 / num_data`` by default: with a mean NLL per example, ``1 / N`` makes ``L``
  the negative ELBO divided by ``N``. The KL is summed over all weights (as BLiTZ); it is the
  closed form ``sum log(sigma1 / sigma) + (sigma^2 + mu^2) / (2 sigma1^2) - 1/2`` when
  ``pi = 1`` and, as in BLiTZ, the Monte Carlo estimate ``1/S sum_s log q(w_s) - log p(w_s)``
  at the same weight samples when ``pi < 1``.
- optimiser: plain SGD (the recipe's learning rate, momentum and Nesterov flag) on ``mu``
  and ``rho``, **no weight decay** (the prior is the regulariser).

Parameters of other modules (BatchNorm's affine weights) are *point estimates*, as in
torch-uncertainty's Bayesian ResNets: they keep the model's values at :func:`init`, get
no noise and no KL, and are trained by the same SGD on the same loss. In training mode
BatchNorm updates the running statistics in ``buffers`` in place (once per ELBO sample).

The pieces: :func:`init` (state), :func:`loss_and_grad` (the loss and its gradients with
respect to ``mu`` and ``rho`` by the reparameterisation trick, on ``torch.func``),
:func:`update` (one SGD step), :func:`step` (both), :func:`sample` (state_dicts of the base
architecture). The numba fast path for OptuNet-shaped networks,
:class:`~train_zoo.methods.bbb_fast.FastBBB`, lives in :mod:`train_zoo.methods.bbb_fast`;
it draws its noise with :func:`draw_noise` too, so with the same generator both paths take
the same step up to float32 rounding.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass

import torch
from torch import Tensor, nn
from torch.func import grad_and_value

from posteriorzoo.errors import InvalidOptionError
from posteriorzoo.options import check_bool, check_integer, check_name, check_number, show
from train_zoo.methods.common import Params, mean_nll, state_dict_of

__all__ = [
    "CONV_TYPES",
    "LINEAR_TYPES",
    "MEAN_INITS",
    "BBBGrads",
    "BBBOptions",
    "BBBState",
    "draw_noise",
    "init",
    "kl_divergence",
    "layer_kinds",
    "log_prior",
    "loss_and_grad",
    "sample",
    "sample_weights",
    "step",
    "update",
]

#: Modules whose parameters are variational with the Linear initialisation.
LINEAR_TYPES: tuple[type[nn.Module], ...] = (nn.Linear, nn.Bilinear)
#: Modules whose parameters are variational with the Conv initialisation.
CONV_TYPES: tuple[type[nn.Module], ...] = (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.ConvTranspose1d,
                                           nn.ConvTranspose2d, nn.ConvTranspose3d)
#: Where the means start: ``N(0, mean_std^2)`` draws, or the model's current weights.
MEAN_INITS = ("random", "model")

#: ``nll(model, params, buffers, batch)`` -> scalar tensor: the minibatch mean negative
#: log-likelihood in nats per example (:func:`~train_zoo.methods.common.mean_nll`).
NLL = Callable[[nn.Module, Mapping[str, Tensor], Mapping[str, Tensor], tuple[Tensor, Tensor]],
               Tensor]

_HALF_LOG_2PI = 0.5 * math.log(2 * math.pi)


def _check_finite(what: str, value: object) -> float:
    if (not isinstance(value, numbers.Real) or isinstance(value, bool)
            or not math.isfinite(value)):
        raise InvalidOptionError(f"{what} must be a finite number, not {show(value)}")
    return value


@dataclass(frozen=True)
class BBBOptions:
    """The method's options, validated on construction (:class:`InvalidOptionError`).

    Attributes
    ----------
    prior_sigma : float, default 0.1
        ``sigma1``, the standard deviation of the prior's first component (with
        ``prior_pi = 1``, of the prior).
    prior_sigma2 : float, default 0.4
        ``sigma2``, the second component's standard deviation (unused when ``prior_pi = 1``).
    prior_pi : float, default 1.0
        Weight of the first component, in ``(0, 1]``.
    elbo_samples : int, default 3
        Weight samples per step (Monte Carlo samples of the expected NLL), 1 to 1000.
    kl_weight : float or None, default None
        Factor of the KL term; None means ``1 / num_data``.
    mean_init : {"random", "model"}, default "random"
        Means drawn from ``N(0, mean_std^2)``, or the model's current weights.
    mean_std : float, default 0.1
        Standard deviation of the random means, in [0, 10].
    rho_linear, rho_conv : float, default -7.0 and -6.0
        Mean of the initial ``rho`` of Linear and of Conv layers, in [-30, 10].
    rho_std : float, default 0.1
        Standard deviation of the initial ``rho``, in [0, 10].
    """

    prior_sigma: float = 0.1
    prior_sigma2: float = 0.4
    prior_pi: float = 1.0
    elbo_samples: int = 3
    kl_weight: float | None = None
    mean_init: str = "random"
    mean_std: float = 0.1
    rho_linear: float = -7.0
    rho_conv: float = -6.0
    rho_std: float = 0.1

    def __post_init__(self) -> None:
        check_number("prior_sigma", self.prior_sigma, 0, strict=True)
        check_number("prior_sigma2", self.prior_sigma2, 0, strict=True)
        check_number("prior_pi", self.prior_pi, 0, strict=True)
        if self.prior_pi > 1:
            raise InvalidOptionError(f"prior_pi must be in (0, 1], not {show(self.prior_pi)}")
        # Ranges: each ELBO sample is one more forward and backward pass per step (time);
        # sigma = softplus(rho) spans 1e-13 to 10 for rho in [-30, 10]; initial spreads
        # above 10 put weights far beyond any trained network's.
        check_integer("elbo_samples", self.elbo_samples, 1, 1_000)
        if self.kl_weight is not None:
            check_number("kl_weight", self.kl_weight, 0)
        check_name("mean_init", self.mean_init, MEAN_INITS)
        check_number("mean_std", self.mean_std, 0, maximum=10)
        for name in ("rho_linear", "rho_conv"):
            _check_finite(name, getattr(self, name))
            check_number(name, getattr(self, name), -30, maximum=10)
        check_number("rho_std", self.rho_std, 0, maximum=10)

    @property
    def closed_form_kl(self) -> bool:
        """True when the prior is one Gaussian (``prior_pi == 1``): the KL is exact."""
        return self.prior_pi == 1

    def kl_weight_for(self, num_data: int) -> float:
        """The KL factor for a training set of ``num_data`` examples."""
        check_integer("num_data", num_data, 1)
        return 1.0 / num_data if self.kl_weight is None else float(self.kl_weight)

    def record(self, num_data: int) -> dict[str, object]:
        """Every option with ``kl_weight`` resolved for ``num_data`` (what a run records)."""
        return {**asdict(self), "kl_weight": self.kl_weight_for(num_data),
                "kl": "closed form" if self.closed_form_kl else "monte carlo"}


@dataclass(frozen=True)
class BBBGrads:
    """Gradients (or SGD momentum buffers) for the means and the ``rho`` of a state.

    Attributes
    ----------
    mu : dict of str to tensor
        One entry per parameter, shaped like it.
    rho : dict of str to tensor
        One entry per variational parameter.
    """

    mu: Params
    rho: Params


@dataclass(frozen=True)
class BBBState:
    """A mean-field Gaussian over a network's parameters.

    Attributes
    ----------
    mu : dict of str to tensor
        Means of every parameter, keyed and ordered like ``model.named_parameters()``,
        in the parameters' dtype. For point estimates, the value itself.
    rho : dict of str to tensor
        ``sigma = softplus(rho)`` of the variational parameters (Linear and Conv layers),
        a subset of ``mu``'s keys in the same order.
    options : BBBOptions
    momentum : BBBGrads or None
        SGD momentum buffers (None before the first step, or without momentum).
    """

    mu: Params
    rho: Params
    options: BBBOptions
    momentum: BBBGrads | None = None

    @property
    def sigma(self) -> Params:
        """``softplus(rho)`` of the variational parameters."""
        return {name: nn.functional.softplus(rho) for name, rho in self.rho.items()}


def layer_kinds(model: nn.Module) -> dict[str, str]:
    """``{parameter name: "linear" | "conv" | "point"}`` in ``named_parameters`` order,
    from the type of the module that owns each parameter (:data:`LINEAR_TYPES`,
    :data:`CONV_TYPES`; anything else is a point estimate)."""
    owners: dict[str, str] = {}
    for prefix, module in model.named_modules():
        kind = ("linear" if isinstance(module, LINEAR_TYPES)
                else "conv" if isinstance(module, CONV_TYPES) else "point")
        for name, _ in module.named_parameters(recurse=False):
            owners[f"{prefix}.{name}" if prefix else name] = kind
    return {name: owners[name] for name, _ in model.named_parameters()}


def init(model: nn.Module, generator: torch.Generator, **options: object) -> BBBState:
    """The initial variational state of ``model``.

    Parameters
    ----------
    model : nn.Module
        The base architecture (its weights are used only with ``mean_init="model"`` and for
        the point estimates).
    generator : torch.Generator
        Source of the initial draws: for each variational parameter in order, its means
        (``mean_init="random"``) then its ``rho``.
    **options
        :class:`BBBOptions` fields (``prior_sigma=0.1``, ``elbo_samples=3``, ...).

    Returns
    -------
    BBBState
        Tensors shaped, typed and placed like the model's parameters; ``momentum`` None.
    """
    opts = BBBOptions(**options)
    kinds = layer_kinds(model)
    mu, rho = {}, {}
    for name, value in model.named_parameters():
        value = value.detach()
        if kinds[name] == "point":
            mu[name] = value.clone()
            continue
        if opts.mean_init == "random":
            mu[name] = opts.mean_std * torch.randn(value.shape, generator=generator,
                                                   dtype=value.dtype, device=value.device)
        else:
            mu[name] = value.clone()
        centre = opts.rho_linear if kinds[name] == "linear" else opts.rho_conv
        rho[name] = centre + opts.rho_std * torch.randn(value.shape, generator=generator,
                                                        dtype=value.dtype, device=value.device)
    return BBBState(mu=mu, rho=rho, options=opts)


def draw_noise(like: Mapping[str, Tensor], generator: torch.Generator, count: int
               ) -> list[Params]:
    """``count`` standard normal draws ``eps`` shaped like ``like`` (a state's ``rho``).

    The draw order (sample by sample, parameters in order, one ``torch.randn`` each) is
    the one both engines use, so one generator gives both the same noise.
    """
    return [{name: torch.randn(value.shape, generator=generator, dtype=value.dtype,
                               device=value.device) for name, value in like.items()}
            for _ in range(count)]


def _weights(mu: Mapping[str, Tensor], sigma: Mapping[str, Tensor],
             eps: Mapping[str, Tensor]) -> Params:
    """``mu + sigma * eps`` for the variational parameters, ``mu`` for the others."""
    return {name: mu[name] + sigma[name] * eps[name] if name in sigma else mu[name]
            for name in mu}


def sample_weights(state: BBBState, noise: Mapping[str, Tensor]) -> Params:
    """The parameters ``mu + softplus(rho) * noise`` (point estimates: ``mu``)."""
    return _weights(state.mu, state.sigma, noise)


def _gaussian_kl(mu: Mapping[str, Tensor], sigma: Mapping[str, Tensor],
                 prior_sigma: float) -> Tensor:
    total = 0.0
    for name, s in sigma.items():
        m = mu[name]
        total = total + (math.log(prior_sigma) - torch.log(s)
                         + (s * s + m * m) / (2 * prior_sigma ** 2) - 0.5).sum()
    return torch.as_tensor(total)


def _log_prior(weights: Mapping[str, Tensor], names: Sequence[str], opts: BBBOptions) -> Tensor:
    total = 0.0
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


def _negative_elbo(mu: Params, rho: Params, noise: Sequence[Mapping[str, Tensor]],
                   model: nn.Module, buffers: Mapping[str, Tensor],
                   batch: tuple[Tensor, Tensor], opts: BBBOptions, kl_weight: float,
                   nll: NLL) -> tuple[Tensor, tuple[Tensor, Tensor]]:
    """``(loss, (mean nll, kl))`` at ``mu, rho`` for the given noise (see the module doc)."""
    sigma = {name: nn.functional.softplus(value) for name, value in rho.items()}
    data, mc_kl = 0.0, 0.0
    for eps in noise:
        weights = _weights(mu, sigma, eps)
        data = data + nll(model, weights, buffers, batch)
        if not opts.closed_form_kl:
            # log q(w_s) through eps itself: (w_s - mu) / sigma would lose precision.
            log_q = sum((-torch.log(s) - 0.5 * eps[name] * eps[name] - _HALF_LOG_2PI).sum()
                        for name, s in sigma.items())
            mc_kl = mc_kl + log_q - _log_prior(weights, list(sigma), opts)
    data = data / len(noise)
    if opts.closed_form_kl:
        kl = _gaussian_kl(mu, sigma, float(opts.prior_sigma))
    else:
        kl = torch.as_tensor(mc_kl) / len(noise)
    return data + kl_weight * kl, (data.detach(), kl.detach())


def loss_and_grad(state: BBBState, model: nn.Module, buffers: Mapping[str, Tensor],
                  batch: tuple[Tensor, Tensor], generator: torch.Generator | None,
                  num_data: int, *, nll: NLL = mean_nll,
                  noise: Sequence[Mapping[str, Tensor]] | None = None
                  ) -> tuple[Tensor, BBBGrads]:
    """The negative ELBO per example on ``batch`` and its gradients (reparameterisation).

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
    loss : 0-d tensor
        ``mean_s nll(w_s) + kl_weight * KL`` (detached).
    grads : BBBGrads
        d loss / d mu (every parameter) and d loss / d rho (variational ones).
    """
    opts = state.options
    kl_weight = opts.kl_weight_for(num_data)
    if noise is None:
        if generator is None:
            raise ValueError("loss_and_grad needs a generator (or the noise itself)")
        noise = draw_noise(state.rho, generator, opts.elbo_samples)
    (grad_mu, grad_rho), (loss, _) = grad_and_value(
        _negative_elbo, argnums=(0, 1), has_aux=True)(
            dict(state.mu), dict(state.rho), noise, model, buffers, batch, opts, kl_weight, nll)
    return loss.detach(), BBBGrads(mu=grad_mu, rho=grad_rho)


def _sgd(value: Tensor, grad: Tensor, buf: Tensor | None, lr: float, momentum: float,
         nesterov: bool) -> tuple[Tensor, Tensor | None]:
    """``torch.optim.SGD``'s update of one tensor (no weight decay, no dampening), out of
    place: returns the new value and momentum buffer."""
    if momentum != 0:
        buf = grad.clone() if buf is None else buf.mul(momentum).add(grad)
        grad = grad.add(buf, alpha=momentum) if nesterov else buf
    return value.add(grad, alpha=-lr), buf


def update(state: BBBState, grads: BBBGrads, lr: float, *, momentum: float = 0.0,
           nesterov: bool = False) -> BBBState:
    """One SGD step on ``mu`` and ``rho`` (no weight decay), as ``torch.optim.SGD`` takes it.

    Parameters
    ----------
    state : BBBState
    grads : BBBGrads
        From :func:`loss_and_grad`.
    lr : float
        Learning rate (the recipe's, for the current epoch).
    momentum : float, default 0
        Heavy-ball momentum; the buffers live in the returned state.
    nesterov : bool, default False
        Nesterov momentum (needs ``momentum > 0``).

    Returns
    -------
    BBBState
        A new state (the input is not modified).
    """
    check_number("lr", lr, 0)
    check_number("momentum", momentum, 0)
    if check_bool("nesterov", nesterov) and momentum == 0:
        raise InvalidOptionError("nesterov needs momentum > 0")
    old = state.momentum
    new_mu, new_rho, buf_mu, buf_rho = {}, {}, {}, {}
    for target, bufs, values, gradients, previous in (
            (new_mu, buf_mu, state.mu, grads.mu, old.mu if old else None),
            (new_rho, buf_rho, state.rho, grads.rho, old.rho if old else None)):
        for name, value in values.items():
            prior_buf = previous[name] if previous is not None else None
            target[name], buf = _sgd(value, gradients[name], prior_buf, lr, momentum, nesterov)
            if buf is not None:
                bufs[name] = buf
    buffers = BBBGrads(mu=buf_mu, rho=buf_rho) if momentum != 0 else None
    return BBBState(mu=new_mu, rho=new_rho, options=state.options, momentum=buffers)


def step(state: BBBState, model: nn.Module, buffers: Mapping[str, Tensor],
         batch: tuple[Tensor, Tensor], generator: torch.Generator, num_data: int, lr: float,
         *, momentum: float = 0.0, nesterov: bool = False, nll: NLL = mean_nll
         ) -> tuple[BBBState, Tensor]:
    """:func:`loss_and_grad` then :func:`update`; returns the new state and the loss."""
    loss, grads = loss_and_grad(state, model, buffers, batch, generator, num_data, nll=nll)
    return update(state, grads, lr, momentum=momentum, nesterov=nesterov), loss


def sample(model: nn.Module, state: BBBState, generator: torch.Generator, count: int,
           buffers: Mapping[str, Tensor] | None = None) -> list[dict[str, Tensor]]:
    """``count`` draws from ``q``: state_dicts of the base architecture.

    Parameters
    ----------
    model : nn.Module
        The base architecture (key order and dtypes of the result).
    state : BBBState
    generator : torch.Generator
        Source of the noise (:func:`draw_noise`, one draw per sample).
    count : int
        Number of samples.
    buffers : dict of str to tensor, optional
        Buffers to store with every sample (default: the model's own).

    Returns
    -------
    list of dict of str to tensor
        ``mu + softplus(rho) * eps`` (point estimates: ``mu``) with the buffers; each loads
        with ``model.load_state_dict``.
    """
    check_integer("count", count, 0)
    if buffers is None:
        buffers = {name: value.detach() for name, value in model.named_buffers()}
    sigma = state.sigma
    return [state_dict_of(model, _weights(state.mu, sigma, eps), buffers)
            for eps in draw_noise(state.rho, generator, count)]
