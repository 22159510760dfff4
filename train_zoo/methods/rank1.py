"""Rank-1 Bayesian neural networks (Dusenberry et al. 2020): a posterior over rank-1 factors.

Every chosen Conv2d or Linear layer (:func:`rank1_layers`, all of them by default) keeps
its weight ``W`` as a point estimate and gains two random vectors: ``s`` over its input
channels and ``r`` over its output channels, so that the layer computes with

    W' = W * (r s^T),    i.e.  y = (W (x * s)) * r + b_k

(for a Conv2d, ``s`` scales input channels and ``r`` output channels; a grouped conv folds
per group). The variational posterior over all ``(r, s)`` of the network is a mixture of
``K`` (default 4) factorised Gaussians, or Cauchy distributions, with equal weights:
component ``k`` has its own locations and scales ``softplus(rho)``. The prior on every
factor is ``N(prior_mean, prior_scale^2)`` (default ``N(1, 0.1^2)``, the reference's CIFAR
setting), a Cauchy of that location and scale for ``distribution="cauchy"``.

Choices, read from the paper (seed 002) and its reference code (edward2's ``DenseRank1`` /
``Conv2DRank1``, uncertainty-baselines' CIFAR ``rank1_bnn``); this is an independent
PyTorch implementation:

- **Initialisation** (:func:`init`): the locations are random signs, +1 with probability
  ``sign_probability`` (0.5) and -1 otherwise; the scales are ``softplus(rho)`` with
  ``rho`` drawn from a normal around ``softplus^-1(init_std)`` of standard deviation 0.1
  cut at two standard deviations (Gaussian; a Cauchy's ``rho`` is that constant), with
  ``init_std = sqrt(p / (1 - p))`` for the reference's ``p = 1e-3``, about 0.032.
- **Bias**: ``r`` does not scale it. The reference adds a *per-component* bias after the
  ``r`` product, so each rank-1 layer with a bias keeps ``K`` bias vectors (point
  estimates, all starting at the model's bias) and a sample of component ``k`` carries
  ``b_k`` unchanged. Folding is therefore exact with or without a bias.
- **Draws**: one ``(r, s)`` per example and layer, reparameterised (``loc + scale *
  eps`` with ``eps`` standard normal or standard Cauchy, ``tan(pi (u - 1/2))``), clipped to
  ``[-clip, clip]`` (the reference's 10). :func:`draw_noise` draws, for each layer in
  order, the ``eps`` of ``r`` then those of ``s``.
- **Training batch**: the mini-batch is tiled ``K`` times, component ``k`` seeing every
  example (component-major: the first ``B`` rows are component 0). The loss per step is

      L = mean CE over the tiled batch + kl_scale * KL / N + l2 * sum(theta^2)

  The mean over the tiled batch is the average of the per-component NLLs; ``N`` is the
  training-set size; ``kl_scale = min(1, (t + 1) / (kl_annealing * T))`` at update ``t`` of
  ``T`` anneals the KL linearly to 1 over the fraction ``kl_annealing`` of training (0.8,
  the reference's 200 of 250 epochs); ``theta`` are all point estimates (weights, the
  per-component biases, BatchNorm's affine parameters), never ``r`` or ``s``, and
  ``l2 * sum(theta^2)`` is the reference's L2 term with ``l2 = 1e-4`` (its gradient is
  ``2 l2 theta``: torch's ``weight_decay`` of ``2 l2``).
- **KL**: summed over every factor entry of every component. Gaussian: the closed form
  ``log(s0 / s) + (s^2 + (m - m0)^2) / (2 s0^2) - 1/2``. Cauchy: edward2 uses a one-draw
  Monte Carlo estimate of ``log q - log p``; here its expectation in closed form,
  ``log(((s + s0)^2 + (m - m0)^2) / (4 s s0))`` (Chyzak & Nielsen 2019), the same
  objective in expectation without the estimator's noise. ``component_kl="sum"`` (the
  reference's: its regulariser sums over the ``K`` components) or ``"mean"`` (``1/K`` of
  that: the KL from the joint ``q(k, r, s)`` to ``Uniform(k) p(r, s)``, an upper bound on
  the mixture's own KL).
- **Optimiser** (:func:`update`, :class:`Rank1Stepper`): SGD with Nesterov momentum 0.9
  on every trainable tensor at the schedule's learning rate, as the reference's CIFAR
  runs (base lr 0.1 per 128 examples, warm-up and step decays: the recipe's schedule here).
- **Evaluation** (:func:`mixture_log_likelihood`): the log-mixture, ``logsumexp`` over
  components (and draws) of the log-likelihood minus ``log K`` (``log(S K)``).
- **Samples** (:func:`sample`): a component ``k`` uniformly, one draw of ``(r, s)`` from
  it, folded exactly into plain weights (:func:`fold`): ``diag(r) W diag(s)`` on the
  output and input axes. Two samples of one trained network differ on every rank-1
  weight tensor by an elementwise rank-1 factor ``(r1 / r2)(s1 / s2)^T``.

**BatchNorm.** BN is shared by the components (the reference's default). In evaluation
mode it applies fixed running statistics, a per-channel affine map, so a conv followed by
BN folds exactly: the folded conv's output is the rank-1 layer's output, example by
example. In training mode BN normalises with the statistics of the whole tiled batch
(every component and draw together), so a folded sample run in training mode on its own
examples sees other statistics and is not equal, except for a batch of one example. The
running statistics a sample carries are those accumulated under the mixture, not
recomputed for the sample (checkpoints are evaluated in evaluation mode).

The forward pass (:func:`forward`) evaluates the base architecture with
``torch.func.functional_call`` and, for the duration of the call only, a forward pre-hook
(``x * s``) and a forward hook (``y * r + b_k``) on each rank-1 layer, whose own bias is
replaced by zeros. Options: :class:`Rank1Options` (:data:`OPTION_HELP`,
:func:`resolve_options`).

The pieces, each in a module of its own and every public name re-exported here:

- :mod:`~train_zoo.methods.rank1_options`: the options and their checks
  (:class:`Rank1Options`, :data:`OPTION_HELP`, :func:`resolve_options`);
- :mod:`~train_zoo.methods.rank1_factors`: the rank-1 layers, the state and :func:`init`,
  the draws, the forward pass, :func:`fold` and :func:`sample`;
- :mod:`~train_zoo.methods.rank1_training`: the KL and its annealing,
  :func:`loss_and_grad`, :func:`update` and :func:`step`.

This module holds the method itself: the torch engine's stepper (:class:`Rank1Run`,
:class:`Rank1Log`, :class:`Rank1Stepper`, which calls :func:`loss_and_grad` through this
module) and :class:`Rank1` with its phase.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import Tensor, nn

from posteriorzoo.errors import InvalidOptionError
from posteriorzoo.options import check_bool, check_integer, check_number
from train_zoo.methods.base import (
    Method,
    ModeRun,
    Posterior,
    declared_options,
    generator_for,
)
from train_zoo.methods.rank1_factors import (
    RANK1_TYPES,
    RHO_SPREAD,
    Draw,
    Rank1State,
    component_params,
    draw,
    draw_noise,
    fold,
    forward,
    init,
    logits,
    mixture_log_likelihood,
    point_estimates,
    rank1_layers,
    sample,
)
from train_zoo.methods.rank1_factors import (
    _factors as _factors,  # the tests'
)
from train_zoo.methods.rank1_factors import (
    _forward as _forward,  # the tests'
)
from train_zoo.methods.rank1_options import (
    COMPONENT_KL,
    DISTRIBUTIONS,
    INIT_STD,
    OPTION_HELP,
    Rank1Options,
    resolve_options,
)
from train_zoo.methods.rank1_training import (
    MOMENTUM,
    NESTEROV,
    Rank1Terms,
    kl_divergence,
    kl_scale,
    loss_and_grad,
    step,
    update,
)
from train_zoo.methods.rank1_training import (
    _loss as _loss,  # the tests'
)

if TYPE_CHECKING:
    from train_zoo.fast.rank1 import Rank1Network

__all__ = [
    "COMPONENT_KL",
    "METHOD",
    "DISTRIBUTIONS",
    "INIT_STD",
    "MOMENTUM",
    "NESTEROV",
    "OPTION_HELP",
    "RANK1_TYPES",
    "RHO_SPREAD",
    "Draw",
    "Rank1",
    "Rank1Log",
    "Rank1Options",
    "Rank1Posterior",
    "Rank1Run",
    "Rank1State",
    "Rank1Stepper",
    "Rank1Terms",
    "component_params",
    "draw",
    "draw_noise",
    "fold",
    "forward",
    "init",
    "kl_divergence",
    "kl_scale",
    "logits",
    "loss_and_grad",
    "mixture_log_likelihood",
    "point_estimates",
    "rank1_layers",
    "resolve_options",
    "sample",
    "scale_record",
    "step",
    "update",
]


# ----------------------------------------------------------------------- stepper
@dataclass(frozen=True)
class Rank1Run:
    """What every step takes besides the batch: the draws' generator, the training-set size
    ``N``, the updates of the whole training (the KL annealing's length), and SGD's
    momentum and Nesterov flag (the reference's 0.9 and Nesterov by default)."""

    generator: torch.Generator
    num_data: int
    total_steps: int
    momentum: float = MOMENTUM
    nesterov: bool = NESTEROV

    def __post_init__(self) -> None:
        check_integer("num_data", self.num_data, 1)
        check_integer("total_steps", self.total_steps, 1)
        check_number("momentum", self.momentum, 0, maximum=1, strict_maximum=True)
        if check_bool("nesterov", self.nesterov) and self.momentum == 0:
            raise InvalidOptionError("nesterov needs momentum > 0")


class Rank1Log:
    """The loss terms averaged over each epoch, kept for the first and the last; a
    callback of :func:`train_zoo.loop.fit` (closes an epoch at ``on_epoch_end``)."""

    def __init__(self) -> None:
        self._sums = {"loss": 0.0, "nll": 0.0, "kl": 0.0, "kl_scale": 0.0}
        self._steps = 0
        self.first: dict[str, float] | None = None
        self.last: dict[str, float] | None = None

    def add(self, terms: Rank1Terms) -> None:
        for name in self._sums:
            self._sums[name] += float(getattr(terms, name))
        self._steps += 1

    def on_epoch_end(self, info, weights) -> None:
        if not self._steps:
            return
        epoch = {"epoch": info.epoch, "steps": self._steps,
                 **{name: total / self._steps for name, total in self._sums.items()}}
        if self.first is None:
            self.first = epoch
        self.last = epoch
        self._sums = dict.fromkeys(self._sums, 0.0)
        self._steps = 0

    def record(self) -> dict[str, dict[str, float] | None]:
        """``{"first_epoch": ..., "last_epoch": ...}``: the epoch (0-based), its steps and
        the mean ``loss``, ``nll``, ``kl`` (nats) and ``kl_scale``; None before an epoch
        has ended."""
        return {"first_epoch": self.first, "last_epoch": self.last}


class Rank1Stepper:
    """Rank-1 training for :func:`train_zoo.loop.fit` on the torch engine: SGD on
    :func:`loss_and_grad` at the schedule's learning rate, the model in training mode.

    ``arrays()`` are :func:`point_estimates` (state_dict layout, numpy); ``buffers`` the
    BatchNorm statistics it trains; ``stopped`` once the loss is not finite.
    """

    def __init__(self, state: Rank1State, model: nn.Module, run: Rank1Run,
                 network: Rank1Network | None = None) -> None:
        self.state = state
        self.model = model
        self.network = network
        self.buffers = {name: value.detach().clone() for name, value in model.named_buffers()}
        self.run = run
        self.stopped = False
        self.log = Rank1Log()

    def step(self, batch: tuple, lr: float) -> float:
        self.model.train()
        terms, grads = loss_and_grad(self.state, self.model, self.buffers, batch,
                                     self.run.generator, self.run.num_data,
                                     self.run.total_steps, network=self.network)
        self.state = update(self.state, grads, lr, momentum=self.run.momentum,
                            nesterov=self.run.nesterov)
        self.log.add(terms)
        value = float(terms.loss)
        self.stopped = not math.isfinite(value)
        return value

    def arrays(self) -> dict[str, np.ndarray]:
        return {name: value.detach().cpu().numpy()
                for name, value in point_estimates(self.state).items()}

    def rank1_state(self) -> Rank1State:
        return self.state



# ------------------------------------------------------------------------ the method
def scale_record(start: Rank1State, end: Rank1State) -> dict[str, dict[str, float]]:
    """How the factors' scales moved between two states of one run, per layer and factor.

    Returns
    -------
    dict
        ``{"conv1.r": {"scale_median_start", "scale_median_end", "rho_max_change"}, ...}``
        for each rank-1 layer's ``r`` then ``s``: the median ``softplus(rho)`` over the
        components and entries in each state and the largest ``|rho_end - rho_start|``
        (plain floats, JSON-able; the scale is the standard deviation of a Gaussian, the
        scale of a Cauchy).
    """
    def median(rho: Tensor) -> float:  # the midpoint for an even count, as numpy's
        return float(torch.quantile(nn.functional.softplus(rho.detach()).reshape(-1).double(),
                                    0.5))

    record = {}
    for layer in start.layers:
        for factor, first, last in (("r", start.r_rho, end.r_rho), ("s", start.s_rho, end.s_rho)):
            record[f"{layer}.{factor}"] = {
                "scale_median_start": median(first[layer]),
                "scale_median_end": median(last[layer]),
                "rho_max_change": float((last[layer] - first[layer]).abs().max()),
            }
    return record


@dataclass(frozen=True)
class Rank1Posterior:
    """The trained mixture, the base architecture it folds into and its BatchNorm
    statistics."""

    model: nn.Module
    state: Rank1State
    buffers: dict[str, Tensor]


class Rank1(Method):
    """Rank-1 BNNs: each mode trains the mixture from the mode's initial weights by SGD
    with Nesterov momentum 0.9 on the recipe's learning-rate schedule
    (:class:`Rank1Stepper`: the batch tiled ``K`` times, the KL divided by N and annealed);
    a sample is a component and one draw of ``(r, s)`` folded into a checkpoint of the
    base architecture (:func:`sample`)."""

    name = "rank-1"
    summary = ("Rank-1 BNN: a mixture of K factorised posteriors over rank-1 factors of "
               "every layer, one folded draw a sample")
    options = declared_options("rank-1")  # the vocabulary's RANK1_OPTIONS
    trains_base = False

    def fit(self, run: ModeRun) -> Posterior:
        from train_zoo.loop import fit

        spec, seeds = run.spec, run.seeds
        recipe = spec.recipe
        options = dict(spec.method_options)
        components = options.pop("components", Rank1Options.components)
        model = run.engine.initial_model()
        params = {name: value.detach() for name, value in model.named_parameters()}
        start = init(model, params, components, generator_for(seeds.init), **options)
        # The engine's kernel for the network part where it covers the network and the
        # rank-1 layers (all of OptuNet's); torch autograd otherwise.
        network = run.engine.rank1_network(model, rank1_layers(model, start.options.layers))
        batches = run.engine.batches(model, seeds.data, torch_only=network is None)
        per_epoch = math.ceil(run.num_data / recipe.batch_size)
        # SGD with the reference's Nesterov momentum 0.9 (Rank1Run's defaults), not the
        # recipe's: plain SGD (OptuNet's recipe) never moves the -1 locations (digits, 10
        # epochs: the KL stays at 11,000 nats and the accuracy at chance).
        stepper = Rank1Stepper(start, model, Rank1Run(generator_for(seeds.noise), run.num_data,
                                                      per_epoch * recipe.epochs), network)
        result = fit(stepper, batches, recipe.learning_rate, recipe.epochs, index=run.index,
                     phase="rank-1", callbacks=[*run.callbacks, stepper.log])
        state = stepper.rank1_state()
        record = {"method": "rank-1", "components": state.components,
                  "layers": state.layers, "scales": scale_record(start, state),
                  "loss": stepper.log.record()}
        return Posterior(Rank1Posterior(model, state, stepper.buffers), result.steps,
                         run.engine.name, record)

    def sample(self, state: Rank1Posterior, generator: torch.Generator, count: int
               ) -> list[dict[str, Tensor]]:
        return sample(state.model, state.state, generator, count, buffers=state.buffers)


METHOD = Rank1()
