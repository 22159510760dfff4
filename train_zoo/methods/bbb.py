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
- optimisers (:class:`BBBTraining`), **no weight decay** (the prior is the regulariser):
  one for ``mu`` and one for ``rho``, each plain SGD with the recipe's momentum and
  Nesterov flag (the paper's setting, at the recipe's learning rate) or Adam (as BLiTZ's
  examples train), each group from its own initial learning rate along the shape of the
  recipe's schedule. Why Adam: with ``rho`` near -7 the gradient of the per-example loss
  with respect to ``rho`` is ``sigmoid(rho) ~ sigma`` times ``d/dsigma``, whose KL part is
  ``kl_weight / sigma``: about ``1 / N`` (2e-5 for N = 60,000), far below its Monte Carlo
  noise. SGD at the recipe's learning rate moves ``rho`` by ~0.02 in 60 epochs and
  ``sigma`` stays at its initial value; Adam's step does not scale with the gradient.
- presets (:data:`PRESETS`): ``"paper"`` (the default: SGD as above, the paper's Table 1)
  and ``"trained-variance"`` (the paper's SGD for ``mu``, Adam for ``rho``; its ``sigma``
  reaches the mean-field optimum, measured by ``benchmarks/bbb_variance.py``). A preset
  only supplies defaults: options given with it win.

Parameters of other modules (BatchNorm's affine weights) are *point estimates*, as in
torch-uncertainty's Bayesian ResNets: they keep the model's values at :func:`init`, get
no noise and no KL, and are trained by the same SGD on the same loss. In training mode
BatchNorm updates the running statistics in ``buffers`` in place (once per ELBO sample).

The pieces: :func:`resolve_options` (a spec's options, checked, with the preset's defaults),
:func:`init` (state), :func:`elbo_and_grad` / :func:`loss_and_grad` (the loss, its terms
and its gradients with respect to ``mu`` and ``rho`` by the reparameterisation trick, on
``torch.func``), :func:`update` (one SGD or Adam step), :func:`step` (both),
:func:`sample` (state_dicts of the base architecture), :func:`variance_record` (how far
``sigma`` moved in training). The numba fast path for OptuNet-shaped networks,
:class:`~train_zoo.fast.bbb.FastBBB`, lives in :mod:`train_zoo.fast.bbb`;
it draws its noise with :func:`draw_noise` too, so with the same generator both paths take
the same step up to float32 rounding.
"""

from __future__ import annotations

import math
import numbers
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, fields

import numpy as np
import torch
from torch import Tensor, nn
from torch.func import grad_and_value

from posteriorzoo.errors import InvalidOptionError, UnknownNameError
from posteriorzoo.options import (
    check_bool,
    check_choice,
    check_integer,
    check_name,
    check_number,
    show,
)
from train_zoo.loop import fit
from train_zoo.methods.base import (
    Context,
    Method,
    MethodOption,
    ModeRun,
    Posterior,
    ResolvedOptions,
    constant,
    generator_for,
)
from train_zoo.methods.common import Params, mean_nll, state_dict_of

__all__ = [
    "ADAM_BETAS",
    "ADAM_EPS",
    "ADAM_LR",
    "CONV_TYPES",
    "LINEAR_TYPES",
    "MEAN_INITS",
    "OPTIMIZERS",
    "OPTION_HELP",
    "PRESETS",
    "BBBGrads",
    "BBBOptions",
    "BBBState",
    "BBBTraining",
    "ElboTerms",
    "OptimizerState",
    "draw_noise",
    "elbo_and_grad",
    "init",
    "kl_divergence",
    "kl_estimate",
    "layer_kinds",
    "log_prior",
    "loss_and_grad",
    "resolve_options",
    "sample",
    "sample_weights",
    "split_options",
    "step",
    "update",
    "variance_record",
]

#: Modules whose parameters are variational with the Linear initialisation.
LINEAR_TYPES: tuple[type[nn.Module], ...] = (nn.Linear, nn.Bilinear)
#: Modules whose parameters are variational with the Conv initialisation.
CONV_TYPES: tuple[type[nn.Module], ...] = (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.ConvTranspose1d,
                                           nn.ConvTranspose2d, nn.ConvTranspose3d)
#: Where the means start: ``N(0, mean_std^2)`` draws, or the model's current weights.
MEAN_INITS = ("random", "model")
#: The optimisers of ``mu`` and ``rho`` (:class:`BBBTraining`).
OPTIMIZERS = ("sgd", "adam")
#: Adam's moment decay rates and denominator term: ``torch.optim.Adam``'s defaults, which
#: BLiTZ's examples use.
ADAM_BETAS = (0.9, 0.999)
ADAM_EPS = 1e-8
#: Adam's initial learning rate when neither the options nor the preset give one (BLiTZ's
#: examples train with 1e-3).
ADAM_LR = 1e-3

#: The named settings: the options each one sets before the spec's own are applied.
#:
#: ``"paper"``
#:     The paper's Table 1 (appendix B.1 with BLiTZ's defaults): SGD at the recipe's
#:     learning rate on ``mu`` and ``rho``. ``sigma`` stays at its initial value (module
#:     docstring).
#: ``"trained-variance"``
#:     The paper's SGD for the means, Adam for ``rho`` (initial learning rate 1e-2 along
#:     the recipe's schedule). On OptuNet / Fashion-MNIST (60 epochs) the learned
#:     ``sigma`` of every layer is within a factor 2 of the mean-field optimum and the
#:     ELBO is higher than the paper's (``benchmarks/bbb_variance.py``). Adam on the means
#:     too (``optimizer = "adam"``, ``lr`` 2e-3) trains ``sigma`` as well, but its means
#:     end in other modes than SGD's, whose NLL differs by more than the KL gains: over
#:     four modes (base seed 3 modes 0-2, base seed 8 mode 0) its final ELBO per example
#:     on the training images was +0.019, +0.014, +0.047 and -0.033 from the paper's,
#:     this preset's +0.012, +0.006, +0.009 and +0.011.
PRESETS: dict[str, dict[str, object]] = {
    "paper": {},
    "trained-variance": {"rho_optimizer": "adam", "rho_lr": 1e-2},
}

#: One line of help per option of the method (``[method_options]`` of a spec).
OPTION_HELP: dict[str, str] = {
    "preset": f"named defaults for the options below: {', '.join(PRESETS)} (default paper)",
    "optimizer": "optimiser of the means: sgd (with the recipe's momentum) or adam "
                 "(default: the preset's, else sgd)",
    "lr": "initial learning rate of the means, on the recipe's schedule (default: the "
          f"preset's, else sgd: the recipe's, adam: {ADAM_LR:g})",
    "rho_optimizer": "optimiser of rho: sgd or adam (default: the preset's, else optimizer)",
    "rho_lr": "initial learning rate of rho, on the same schedule (default: the preset's, "
              "else lr, or rho_optimizer's default if it differs)",
    "prior_sigma": "standard deviation of the prior's first component (default 0.1)",
    "prior_sigma2": "standard deviation of the prior's second component (default 0.4)",
    "prior_pi": "weight of the prior's first component, in (0, 1] (default 1)",
    "elbo_samples": "weight samples per step for the expected NLL (default 3)",
    "kl_weight": "factor of the KL term (default 1 / number of training examples)",
    "mean_init": "initial means: random N(0, mean_std^2) draws or the model's weights "
                 "(default random)",
    "mean_std": "standard deviation of the random initial means (default 0.1)",
    "rho_linear": "mean of the initial rho of Linear layers (default -7)",
    "rho_conv": "mean of the initial rho of Conv layers (default -6)",
    "rho_std": "standard deviation of the initial rho (default 0.1)",
}

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
class BBBTraining:
    """How ``mu`` and ``rho`` are trained, validated on construction.

    Attributes
    ----------
    optimizer : {"sgd", "adam"}
        The means' optimiser: SGD with the recipe's momentum and Nesterov flag, or
        ``torch.optim.Adam`` (:data:`ADAM_BETAS`, :data:`ADAM_EPS`; the recipe's momentum
        is not used).
    lr : float
        Initial learning rate of the means, > 0.
    rho_optimizer : {"sgd", "adam"}
        ``rho``'s optimiser.
    rho_lr : float
        Initial learning rate of ``rho``, > 0.

    Both learning rates follow the shape of the recipe's schedule (:meth:`schedule`).
    """

    optimizer: str
    lr: float
    rho_optimizer: str
    rho_lr: float

    def __post_init__(self) -> None:
        check_choice("optimizer", self.optimizer, OPTIMIZERS)
        check_number("lr", self.lr, 0, strict=True)
        check_choice("rho_optimizer", self.rho_optimizer, OPTIMIZERS)
        check_number("rho_lr", self.rho_lr, 0, strict=True)

    def is_paper(self, recipe_lr: float) -> bool:
        """SGD at the recipe's learning rate for both ``mu`` and ``rho`` (the paper's)."""
        return (self.optimizer == self.rho_optimizer == "sgd" and self.lr == recipe_lr
                and self.rho_lr == self.lr)

    @property
    def rho_lr_factor(self) -> float:
        """``rho_lr / lr``: the learning rate of ``rho`` relative to the means' at every
        step."""
        return self.rho_lr / self.lr

    def schedule(self, recipe_schedule: Callable[[int], float], recipe_lr: float
                 ) -> Callable[[int], float]:
        """The means' learning rate per epoch: the recipe's ``recipe_schedule`` (whose
        initial value is ``recipe_lr``) scaled to start at :attr:`lr`; the recipe's own
        function when ``lr`` is the recipe's (so the paper's runs are unchanged to the
        bit)."""
        if self.lr == recipe_lr:
            return recipe_schedule
        scale = self.lr / recipe_lr
        return lambda epoch: scale * recipe_schedule(epoch)


def _training(options: Mapping[str, object], recipe_lr: float) -> BBBTraining:
    """The :class:`BBBTraining` of ``options`` (missing ones: the paper's)."""
    def default_lr(optimizer: str) -> float:
        return recipe_lr if optimizer == "sgd" else ADAM_LR

    optimizer = check_choice("optimizer", options.get("optimizer", "sgd"), OPTIMIZERS)
    rho_optimizer = check_choice("rho_optimizer", options.get("rho_optimizer", optimizer),
                                 OPTIMIZERS)
    lr = options.get("lr", default_lr(optimizer))
    rho_lr = options.get("rho_lr", lr if rho_optimizer == optimizer
                         else default_lr(rho_optimizer))
    return BBBTraining(optimizer, lr, rho_optimizer, rho_lr)


def resolve_options(options: Mapping[str, object], recipe_lr: float) -> dict[str, object]:
    """A spec's ``[method_options]`` for BBB, checked and completed: what a collection
    records.

    ``preset`` (:data:`PRESETS`, default ``"paper"``) supplies defaults; the options given
    win over it. The result has every :class:`BBBOptions` field, then ``preset``,
    ``optimizer``, ``lr``, ``rho_optimizer`` and ``rho_lr``, except when the training is the
    paper's (SGD at the recipe's learning rate ``recipe_lr`` for ``mu`` and ``rho``): then
    these are left out, so the record, and the recipe hash of collections made before
    they existed, stay as they were.

    Raises
    ------
    UnknownNameError
        An option BBB does not have (:data:`OPTION_HELP` lists them).
    InvalidOptionError
        A bad value; the message starts with the option's name.
    """
    given = dict(options)
    preset = check_choice("preset", given.pop("preset", "paper"), tuple(PRESETS))
    unknown = sorted(set(given) - set(OPTION_HELP))
    if unknown:
        raise UnknownNameError(f"unknown bbb option(s) {unknown}; options: "
                               f"{', '.join(OPTION_HELP)}")
    merged = {**PRESETS[preset], **given}
    model_options, training = split_options(merged, recipe_lr)
    record: dict[str, object] = asdict(BBBOptions(**model_options))
    if not training.is_paper(recipe_lr):
        record.update(preset=preset, **asdict(training))
    return record


def split_options(options: Mapping[str, object], recipe_lr: float
                  ) -> tuple[dict[str, object], BBBTraining]:
    """Resolved options (:func:`resolve_options`) as the keyword arguments of :func:`init`
    and the :class:`BBBTraining`; training options that are absent are the paper's."""
    names = {field.name for field in fields(BBBOptions)}
    return ({name: value for name, value in options.items() if name in names},
            _training(options, recipe_lr))


@dataclass(frozen=True)
class BBBGrads:
    """Gradients (or an optimiser's buffers) for the means and the ``rho`` of a state.

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
class OptimizerState:
    """An optimiser's buffers for one group of tensors (the means, or ``rho``), as
    ``torch.optim`` keeps them.

    Attributes
    ----------
    kind : {"sgd", "adam"}
    steps : int
        Updates taken (Adam's bias correction).
    first : dict of str to tensor
        SGD's momentum buffers, or Adam's first moments (``exp_avg``).
    second : dict of str to tensor or None
        Adam's second moments (``exp_avg_sq``); None for SGD.
    """

    kind: str
    steps: int
    first: Params
    second: Params | None = None


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
    mu_buffers, rho_buffers : OptimizerState or None
        The optimisers' buffers of the means and of ``rho`` (None before the first step,
        and with SGD without momentum).
    """

    mu: Params
    rho: Params
    options: BBBOptions
    mu_buffers: OptimizerState | None = None
    rho_buffers: OptimizerState | None = None

    @property
    def momentum(self) -> BBBGrads | None:
        """SGD's momentum buffers when both groups are trained by SGD with momentum, else
        None."""
        mu, rho = self.mu_buffers, self.rho_buffers
        if mu is None or rho is None or mu.kind != "sgd" or rho.kind != "sgd":
            return None
        return BBBGrads(mu=mu.first, rho=rho.first)

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
    """``(loss, (mean nll, kl))`` at ``mu, rho`` for the given noise (see the module doc)."""
    sigma = {name: nn.functional.softplus(value) for name, value in rho.items()}
    data, mc_kl = 0.0, 0.0
    for eps in noise:
        weights = _weights(mu, sigma, eps)
        data = data + nll(model, weights, buffers, batch)
        if not opts.closed_form_kl:
            mc_kl = mc_kl + _mc_kl_term(sigma, eps, weights, opts)
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


def _sgd(value: Tensor, grad: Tensor, buf: Tensor | None, lr: float, momentum: float,
         nesterov: bool) -> tuple[Tensor, Tensor | None]:
    """``torch.optim.SGD``'s update of one tensor (no weight decay, no dampening), out of
    place: returns the new value and momentum buffer."""
    if momentum != 0:
        buf = grad.clone() if buf is None else buf.mul(momentum).add(grad)
        grad = grad.add(buf, alpha=momentum) if nesterov else buf
    return value.add(grad, alpha=-lr), buf


def _adam(value: Tensor, grad: Tensor, first: Tensor | None, second: Tensor | None,
          steps: int, lr: float) -> tuple[Tensor, Tensor, Tensor]:
    """``torch.optim.Adam``'s update of one tensor (its single-tensor path, no weight
    decay, no amsgrad) at step ``steps`` (1 for the first), out of place: returns the new
    value and moments. The numba path calls it on its flat vectors too."""
    beta1, beta2 = ADAM_BETAS
    first = torch.zeros_like(value) if first is None else first
    second = torch.zeros_like(value) if second is None else second
    first = first.lerp(grad, 1 - beta1)
    second = second.mul(beta2).addcmul(grad, grad, value=1 - beta2)
    step_size = lr / (1 - beta1 ** steps)
    denom = (second.sqrt() / (1 - beta2 ** steps) ** 0.5).add(ADAM_EPS)
    return value.addcdiv(first, denom, value=-step_size), first, second


def _group_step(option: str, values: Params, grads: Params, buffers: OptimizerState | None,
                kind: str, lr: float, momentum: float, nesterov: bool
                ) -> tuple[Params, OptimizerState | None]:
    """One group's (the means' or rho's) step: new values and buffers."""
    if buffers is not None and buffers.kind != kind:
        raise InvalidOptionError(f"{option} is {kind}, but the state holds the buffers of "
                                 f"{buffers.kind}")
    steps = (buffers.steps if buffers else 0) + 1
    new, first, second = {}, {}, {}
    for name, value in values.items():
        old_first = buffers.first[name] if buffers else None
        if kind == "adam":
            new[name], first[name], second[name] = _adam(
                value, grads[name], old_first, buffers.second[name] if buffers else None,
                steps, lr)
        else:
            new[name], buf = _sgd(value, grads[name], old_first, lr, momentum, nesterov)
            if buf is not None:
                first[name] = buf
    if kind == "adam":
        return new, OptimizerState("adam", steps, first, second)
    return new, OptimizerState("sgd", steps, first) if momentum != 0 else None


def update(state: BBBState, grads: BBBGrads, lr: float, *, momentum: float = 0.0,
           nesterov: bool = False, optimizer: str = "sgd", rho_lr: float | None = None,
           rho_optimizer: str | None = None) -> BBBState:
    """One optimiser step on ``mu`` and ``rho`` (no weight decay), as ``torch.optim.SGD``
    or ``torch.optim.Adam`` takes it.

    Parameters
    ----------
    state : BBBState
    grads : BBBGrads
        From :func:`elbo_and_grad`.
    lr : float
        Learning rate of the means (for the current epoch).
    momentum : float, default 0
        SGD's heavy-ball momentum (Adam ignores it); the buffers live in the returned
        state.
    nesterov : bool, default False
        Nesterov momentum (needs ``momentum > 0``; SGD only).
    optimizer : {"sgd", "adam"}, default "sgd"
        The means' optimiser; Adam with :data:`ADAM_BETAS` and :data:`ADAM_EPS`.
    rho_lr : float, optional
        Learning rate of ``rho`` (default ``lr``).
    rho_optimizer : {"sgd", "adam"}, optional
        ``rho``'s optimiser (default ``optimizer``).

    Returns
    -------
    BBBState
        A new state (the input is not modified).
    """
    check_number("lr", lr, 0)
    rho_lr = lr if rho_lr is None else check_number("rho_lr", rho_lr, 0)
    check_number("momentum", momentum, 0)
    if check_bool("nesterov", nesterov) and momentum == 0:
        raise InvalidOptionError("nesterov needs momentum > 0")
    check_choice("optimizer", optimizer, OPTIMIZERS)
    rho_optimizer = optimizer if rho_optimizer is None else check_choice(
        "rho_optimizer", rho_optimizer, OPTIMIZERS)
    mu, mu_buffers = _group_step("optimizer", state.mu, grads.mu, state.mu_buffers,
                                 optimizer, lr, momentum, nesterov)
    rho, rho_buffers = _group_step("rho_optimizer", state.rho, grads.rho, state.rho_buffers,
                                   rho_optimizer, rho_lr, momentum, nesterov)
    return BBBState(mu=mu, rho=rho, options=state.options, mu_buffers=mu_buffers,
                    rho_buffers=rho_buffers)


def step(state: BBBState, model: nn.Module, buffers: Mapping[str, Tensor],
         batch: tuple[Tensor, Tensor], generator: torch.Generator, num_data: int, lr: float,
         *, momentum: float = 0.0, nesterov: bool = False, optimizer: str = "sgd",
         rho_lr: float | None = None, rho_optimizer: str | None = None, nll: NLL = mean_nll
         ) -> tuple[BBBState, Tensor]:
    """:func:`loss_and_grad` then :func:`update`; returns the new state and the loss."""
    loss, grads = loss_and_grad(state, model, buffers, batch, generator, num_data, nll=nll)
    return update(state, grads, lr, momentum=momentum, nesterov=nesterov,
                  optimizer=optimizer, rho_lr=rho_lr, rho_optimizer=rho_optimizer), loss


def variance_record(start: BBBState, end: BBBState) -> dict[str, dict[str, float]]:
    """How ``sigma`` moved between two states of one run, per variational parameter.

    Returns
    -------
    dict
        ``{name: {"sigma_median_start", "sigma_median_end", "rho_max_change"}}`` in the
        state's order: the median ``sigma`` of the tensor in each state and the largest
        ``|rho_end - rho_start|`` over its entries (plain floats, JSON-able).
    """
    def median(values: Tensor) -> float:  # the midpoint for an even count, as numpy's
        return float(torch.quantile(values.detach().reshape(-1).double(), 0.5))

    record = {}
    start_sigma, end_sigma = start.sigma, end.sigma
    for name, rho in start.rho.items():
        record[name] = {
            "sigma_median_start": median(start_sigma[name]),
            "sigma_median_end": median(end_sigma[name]),
            "rho_max_change": float((end.rho[name] - rho).abs().max()),
        }
    return record


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


# ---------------------------------------------------------------- steppers
@dataclass(frozen=True)
class BBBRun:
    """What every BBB step takes besides the batch: the noise generator, the training-set
    size (the KL weight's default 1 / N), the recipe's SGD momentum, and the optimisers
    (:class:`BBBTraining`: ``rho``'s learning rate is the means'
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
    (:func:`train_zoo.methods.elbo_and_grad`, :func:`~train_zoo.methods.update`)."""

    def __init__(self, state: BBBState, model: nn.Module, run: BBBRun) -> None:
        self.state = state
        self.model = model
        self.buffers = {name: value.detach().clone() for name, value in model.named_buffers()}
        self.run = run
        self.stopped = False
        self.log = ElboLog(state.options.kl_weight_for(run.num_data))

    def step(self, batch: tuple, lr: float) -> float:
        self.model.train()
        terms, grads = elbo_and_grad(self.state, self.model, self.buffers, batch,
                                         self.run.generator, self.run.num_data)
        self.state = update(self.state, grads, lr, momentum=self.run.momentum,
                                nesterov=self.run.nesterov, optimizer=self.run.optimizer,
                                rho_lr=self.run.rho_lr(lr),
                                rho_optimizer=self.run.rho_optimizer)
        self.log.add(float(terms.nll), float(terms.kl))
        value = float(terms.loss)
        self.stopped = not math.isfinite(value)
        return value

    def arrays(self) -> dict[str, np.ndarray]:
        return {name: value.detach().numpy() for name, value in self.state.mu.items()}

    def bbb_state(self) -> BBBState:
        return self.state


# ---------------------------------------------------------------- the method
def resolve_kl_weight(options: Mapping[str, object], num_data: int) -> dict[str, object]:
    """BBB's options with ``kl_weight`` set to ``1 / num_data`` when it was left unset."""
    if options.get("kl_weight") is not None:
        return dict(options)
    check_integer("the training-set size", num_data, 1)
    return {**options, "kl_weight": 1.0 / num_data}


@dataclass(frozen=True)
class BBBTrainingRun:
    """One mode's trained BBB posterior (:meth:`BayesByBackprop.fit`).

    Attributes
    ----------
    model : nn.Module
        The base architecture (its own weights unused).
    state : BBBState
        The variational posterior at the end.
    buffers : dict of str to tensor or None
        BatchNorm statistics (torch engine), None on the fast engine.
    steps : int
    engine : str
        The engine that ran it (``fast`` or ``torch``).
    record : dict
        What the diagnostics need, JSON-able: ``{"method": "bbb", "layers": {name:
        {"sigma_median_start", "sigma_median_end", "rho_max_change"}}, "elbo":
        {"first_epoch": {...}, "last_epoch": {...}}}`` (:func:`variance_record`,
        :meth:`ElboLog.record`).
    """

    model: nn.Module
    state: BBBState
    buffers: dict[str, torch.Tensor] | None
    steps: int
    engine: str
    record: dict[str, object]


class BayesByBackprop(Method):
    """Bayes by Backprop: each mode trains a mean-field variational posterior from the
    mode's seeds (instead of a base network) and draws its samples from it."""

    name = "bbb"
    summary = "Bayes by Backprop: a mean-field Gaussian posterior trained per mode"
    options_need_data = True
    trains_base = False

    def option_table(self) -> tuple[MethodOption, ...]:
        """Made from :data:`OPTION_HELP` and the defaults of :class:`BBBOptions`; their
        values are checked together by :func:`resolve_options` (a preset supplies
        several), see :meth:`explain`."""
        if self.options:
            return self.options
        defaults = {f.name: f.default for f in fields(BBBOptions)}
        defaults.update(preset="paper", kl_weight="1 / number of training examples")
        records = []
        for name, text in OPTION_HELP.items():
            match = re.search(r"\s*\(default:? ([^()]*)\)$", text)
            default_text = str(defaults.get(name, match.group(1) if match else ""))
            help_text = text[:match.start()] if match else text
            records.append(MethodOption(name, lambda what, value, context: value,
                                        constant(defaults.get(name)), default_text,
                                        help_text))
        self.options = tuple(records)
        return self.options

    def explain(self, options: Mapping[str, object], context: Context) -> ResolvedOptions:
        try:
            values = resolve_options(dict(options), context.recipe.lr)
        except InvalidOptionError as error:
            raise InvalidOptionError(f"bbb option {error}") from None
        preset = options.get("preset", "paper")
        sources = {}
        for name, value in values.items():
            if name in options:
                sources[name] = "given"
            elif name in PRESETS.get(preset, {}):
                sources[name] = f"from the preset {preset}"
            elif name == "kl_weight" and value is None:
                sources[name] = "default (1 / number of training examples, set at training)"
            elif name == "lr" and value == context.recipe.lr:
                sources[name] = "derived from the recipe (its lr)"
            elif name == "rho_optimizer" and value == values.get("optimizer"):
                sources[name] = "derived from optimizer"
            elif name == "rho_lr" and value == values.get("lr"):
                sources[name] = "derived from lr"
            else:
                sources[name] = "default"
        return ResolvedOptions(values, sources, ())

    def recorded_options(self, options: Mapping[str, object], num_data: int | None
                         ) -> dict[str, object]:
        """The options with ``kl_weight`` resolved for ``num_data`` examples when given."""
        return dict(options) if num_data is None else resolve_kl_weight(options, num_data)

    def fit(self, run: ModeRun) -> Posterior:
        spec, seeds = run.spec, run.seeds
        recipe = spec.recipe
        options, training = split_options(resolve_kl_weight(spec.method_options,
                                                            run.num_data), recipe.lr)
        model = run.engine.initial_model()
        start = init(model, generator_for(seeds.init), **options)
        bbb_run = BBBRun(generator_for(seeds.noise), run.num_data, recipe.momentum,
                         recipe.nesterov, training.optimizer, training.rho_optimizer,
                         training.rho_lr_factor)
        stepper = run.engine.bbb_stepper(model, start, bbb_run)
        result = fit(stepper, run.engine.batches(model, seeds.data),
                     training.schedule(recipe.learning_rate, recipe.lr), recipe.epochs,
                     index=run.index, phase="bbb", callbacks=[*run.callbacks, stepper.log])
        state = stepper.bbb_state()
        record = {"method": "bbb", "layers": variance_record(start, state),
                  "elbo": stepper.log.record()}
        trained = BBBTrainingRun(model, state, getattr(stepper, "buffers", None),
                                 result.steps, run.engine.name, record)
        return Posterior(trained, result.steps, run.engine.name, record)

    def sample(self, state: BBBTrainingRun, generator: torch.Generator, count: int
               ) -> list[dict[str, torch.Tensor]]:
        return sample(state.model, state.state, generator, count, buffers=state.buffers)


METHOD = BayesByBackprop()
