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

The pieces, each in a module of its own and every public name re-exported here:

- :mod:`~train_zoo.methods.bbb_options`: the options, the presets and their checks
  (:class:`BBBOptions`, :class:`BBBTraining`, :func:`resolve_options`, :func:`split_options`,
  :func:`resolve_kl_weight`);
- :mod:`~train_zoo.methods.bbb_state`: the variational state (:class:`BBBState`),
  :func:`init`, :func:`draw_noise`, :func:`sample` (state_dicts of the base architecture)
  and :func:`variance_record` (how far ``sigma`` moved in training);
- :mod:`~train_zoo.methods.bbb_elbo`: the KL, the prior and :func:`elbo_and_grad` /
  :func:`loss_and_grad` (the loss, its terms and its gradients with respect to ``mu`` and
  ``rho`` by the reparameterisation trick, on ``torch.func``);
- :mod:`~train_zoo.methods.bbb_update`: :func:`update` (one SGD or Adam step) and
  :func:`step` (both).

This module holds the method itself: the torch engine's stepper (:class:`BBBRun`,
:class:`ElboLog`, :class:`BBBStepper`) and :class:`BayesByBackprop` with its phase.
The numba fast path for OptuNet-shaped networks,
:class:`~train_zoo.fast.bbb.FastBBB`, lives in :mod:`train_zoo.fast.bbb`;
it draws its noise with :func:`draw_noise` too, so with the same generator both paths take
the same step up to float32 rounding.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from posteriorzoo.errors import InvalidOptionError
from train_zoo.loop import fit
from train_zoo.methods.base import (
    Context,
    Method,
    ModeRun,
    Posterior,
    Resolved,
    ResolvedOptions,
    declared_options,
    generator_for,
)
from train_zoo.methods.bbb_elbo import (
    _HALF_LOG_2PI as _HALF_LOG_2PI,  # train_zoo.fast.bbb's
)
from train_zoo.methods.bbb_elbo import (
    NLL as NLL,
)
from train_zoo.methods.bbb_elbo import (
    ElboTerms,
    elbo_and_grad,
    kl_divergence,
    kl_estimate,
    log_prior,
    loss_and_grad,
)
from train_zoo.methods.bbb_options import (
    ADAM_BETAS,
    ADAM_EPS,
    ADAM_LR,
    MEAN_INITS,
    OPTIMIZERS,
    OPTION_HELP,
    PRESETS,
    BBBOptions,
    BBBTraining,
    resolve_kl_weight,
    resolve_options,
    split_options,
)
from train_zoo.methods.bbb_state import (
    CONV_TYPES,
    LINEAR_TYPES,
    BBBGrads,
    BBBState,
    OptimizerState,
    draw_noise,
    init,
    layer_kinds,
    sample,
    sample_weights,
    variance_record,
)
from train_zoo.methods.bbb_update import (
    _adam as _adam,  # train_zoo.fast.bbb's and the tests'
)
from train_zoo.methods.bbb_update import step, update

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


def _training_default(context: Context, name: str) -> Resolved:
    """The training option ``name`` that the preset and the options resolved before it
    (table order: preset, optimizer, lr, rho_optimizer, rho_lr) imply."""
    given = {key: value for key, value in context.resolved.items()
             if key in ("optimizer", "lr", "rho_optimizer", "rho_lr")}
    merged = {**PRESETS[context.resolved["preset"]], **given}
    value = getattr(split_options(merged, context.recipe.lr)[1], name)
    return Resolved(value, "derived from the preset and the recipe")


class BayesByBackprop(Method):
    """Bayes by Backprop: each mode trains a mean-field variational posterior from the
    mode's seeds (instead of a base network) and draws its samples from it."""

    name = "bbb"
    summary = "Bayes by Backprop: a mean-field Gaussian posterior trained per mode"
    options_need_data = True
    trains_base = False

    #: The vocabulary's options (BBB_OPTIONS). Their values are checked together by
    #: :func:`resolve_options` (a preset supplies several), see :meth:`explain`; the rules
    #: below give the listing's and the records' derived defaults the same meaning.
    options = declared_options("bbb", defaults={
        "optimizer": lambda context: _training_default(context, "optimizer"),
        "lr": lambda context: _training_default(context, "lr"),
        "rho_optimizer": lambda context: _training_default(context, "rho_optimizer"),
        "rho_lr": lambda context: _training_default(context, "rho_lr")})

    def explain(self, options: Mapping[str, object], context: Context) -> ResolvedOptions:
        try:
            values = resolve_options(dict(options), context.recipe.lr)
        except InvalidOptionError as error:
            raise InvalidOptionError(f"bbb option {error}") from None
        preset = str(options.get("preset", "paper"))  # resolve_options checked it
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
