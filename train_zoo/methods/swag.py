"""SWAG (Maddox et al. 2019): a Gaussian fitted to the iterates of continued SGD.

Pieces, in the order the trainer uses them:

1. Schedule. The SWAG phase continues training a trained base network with a high
   learning rate for twice the recipe's length (:data:`LENGTH_FACTOR`), reached by a linear
   ramp (:func:`swag_learning_rate`), and collects :data:`ITERATES` = 20 iterates at equal
   intervals (:func:`collection_epochs`). The trainer runs the SGD steps (the recipe's
   optimiser, momentum and weight decay) and calls :func:`update` at the end of every
   collection epoch.
2. Fit. :func:`init` and :func:`update` keep, as flat vectors over all parameters in
   ``named_parameters()`` order, the running first and second moments and the last
   ``K`` <= :data:`RANK` = 20 deviation columns.
3. Sample. :func:`sample` draws
   ``theta = mean + sqrt(scale) * (sqrt(var) * z1 + D^T z2 / sqrt(K - 1))`` with
   ``z1 ~ N(0, I_P)`` and ``z2 ~ N(0, I_K)`` drawn once per sample over the whole network,
   so the covariance is ``scale * (diag(var) + D^T D / (K - 1))`` and the correlations
   between layers are kept (a per-tensor ``z2``, as torch-uncertainty 0.13 draws it, would
   destroy them). ``var = max(E[theta^2] - E[theta]^2, 0)`` is the population variance of
   the collected iterates. ``scale`` defaults to the paper's 0.1 (:data:`SCALE`).
4. BatchNorm. A sampled parameter vector needs its own BatchNorm statistics:
   :func:`recompute_batchnorm` recomputes them with a pass over training batches; the
   trainer calls it for every sample of a network with BatchNorm.

Conventions: the deviation appended by :func:`update` is ``theta - mean`` with the mean
*after* including ``theta`` (as Maddox et al.'s reference implementation and their
Algorithm 1). The moments are accumulated in float64 (a float32 ``E[theta^2] -
E[theta]^2`` loses the small variances to cancellation); the deviation columns are kept in
the parameters' dtype; samples come back in the parameters' dtypes.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from posteriorzoo.errors import InvalidOptionError
from posteriorzoo.options import check_integer, check_number
from posteriorzoo.vocabulary import (
    SWAG_ITERATES,
    SWAG_LENGTH_FACTOR,
    SWAG_RAMP_EPOCHS,
    SWAG_RANK,
    SWAG_REFERENCE_EPOCHS,
    SWAG_SCALE,
)
from train_zoo.loop import fit
from train_zoo.methods.base import (
    Collector,
    Context,
    DefaultRule,
    Method,
    ModeRun,
    Posterior,
    Resolved,
    declared_options,
    recipe_lr,
)
from train_zoo.methods.common import Params, flatten, logits, parameters_of, unflatten

__all__ = [
    "ITERATES",
    "LENGTH_FACTOR",
    "RAMP_EPOCHS",
    "RANK",
    "SCALE",
    "SwagState",
    "collection_epochs",
    "covariance",
    "init",
    "recompute_batchnorm",
    "sample",
    "sample_vector",
    "swag_learning_rate",
    "update",
    "variance",
]

# The numbers of SWAG's options, declared once in the vocabulary: the rank K of the
# deviation columns (the paper's 20), the iterates collected (the paper's 20 models), the
# sampling scale that multiplies the covariance (the paper's 0.1), the phase length in
# recipes (twice the usual length) and the ramp to the high learning rate.
RANK, ITERATES, SCALE = SWAG_RANK, SWAG_ITERATES, SWAG_SCALE
LENGTH_FACTOR, RAMP_EPOCHS = SWAG_LENGTH_FACTOR, SWAG_RAMP_EPOCHS


# ---------------------------------------------------------------- option checks
def _integer(name: str, value: object, minimum: int) -> int:
    return check_integer(f"swag option {name!r}", value, minimum)


def _number(name: str, value: object, minimum: float, *, strict: bool = False) -> float:
    return float(check_number(f"swag option {name!r}", value, minimum, strict=strict))


# ---------------------------------------------------------------- schedule
def collection_epochs(epochs: int, iterates: int = ITERATES, start: int = 0) -> list[int]:
    """The (0-based) epochs of the SWAG phase at whose end an iterate is collected.

    The epochs ``start .. epochs - 1`` are cut into ``iterates`` segments of equal length
    (lengths differ by at most one when ``iterates`` does not divide them) and the last
    epoch of each segment collects, so the final epoch always collects.

    Parameters
    ----------
    epochs : int
        Length of the SWAG phase in epochs (the trainer uses ``LENGTH_FACTOR *
        recipe.epochs``).
    iterates : int, default 20
        Number of iterates to collect.
    start : int, default 0
        First epoch of the collection window (e.g. ``ramp_epochs`` to collect only at the
        high learning rate; the default spreads the collections over the whole phase).

    Returns
    -------
    list of int
        ``iterates`` strictly increasing epoch indices; the last is ``epochs - 1``.

    Examples
    --------
    >>> collection_epochs(120)[:3], collection_epochs(120)[-1]
    ([5, 11, 17], 119)
    """
    epochs = _integer("epochs", epochs, 1)
    iterates = _integer("iterates", iterates, 1)
    start = _integer("start", start, 0)
    window = epochs - start
    if window < iterates:
        raise InvalidOptionError(f"swag option 'iterates' ({iterates}) exceeds the "
                                 f"{window} epochs of the collection window")
    return [start + (i + 1) * window // iterates - 1 for i in range(iterates)]


def swag_learning_rate(epoch: int, swag_lr: float, ramp_epochs: int = RAMP_EPOCHS,
                       start_lr: float = 0.0) -> float:
    """Learning rate during ``epoch`` (0-based) of the SWAG phase.

    A linear ramp from ``start_lr`` to ``swag_lr`` over the first ``ramp_epochs`` epochs,
    then constant::

        lr(e) = start_lr + (swag_lr - start_lr) * min(1, (e + 1) / ramp_epochs)

    Parameters
    ----------
    epoch : int
        Epoch of the SWAG phase, from 0.
    swag_lr : float
        The high learning rate (option ``swag_lr``; the trainer's default is the recipe's
        initial ``lr``, e.g. 0.04 for OptuNet/MNIST, 0.1 for ResNet-18/CIFAR-100).
    ramp_epochs : int, default 10
        Length of the ramp (option ``ramp_epochs``; 0 starts directly at ``swag_lr``).
    start_lr : float, default 0.0
        Where the ramp starts; the trainer passes the base network's last learning rate
        (``recipe.learning_rate(recipe.epochs - 1)``) so the schedule continues smoothly.

    Returns
    -------
    float

    Examples
    --------
    >>> [round(swag_learning_rate(e, 0.04, 4, 0.01), 4) for e in range(6)]
    [0.0175, 0.025, 0.0325, 0.04, 0.04, 0.04]
    """
    epoch = _integer("epoch", epoch, 0)
    swag_lr = _number("swag_lr", swag_lr, 0, strict=True)
    ramp_epochs = _integer("ramp_epochs", ramp_epochs, 0)
    start_lr = _number("start_lr", start_lr, 0)
    if ramp_epochs == 0:
        return swag_lr
    return start_lr + (swag_lr - start_lr) * min(1.0, (epoch + 1) / ramp_epochs)


# ---------------------------------------------------------------- the fit
@dataclass(frozen=True)
class SwagState:
    """The SWAG statistics of the iterates collected so far.

    Attributes
    ----------
    mean : torch.Tensor
        Float64 ``(P,)`` running mean of the flattened parameters.
    sq_mean : torch.Tensor
        Float64 ``(P,)`` running mean of their squares.
    deviations : torch.Tensor
        ``(K, P)`` in the parameters' dtype: row ``i`` is ``theta_i - mean_i`` of one of
        the last ``K <= max_rank`` iterates (oldest first), ``mean_i`` the mean after
        including ``theta_i``.
    count : int
        Iterates collected.
    max_rank : int
        Deviation columns kept.
    like : dict[str, torch.Tensor]
        Meta tensors with the parameters' names, shapes and dtypes (no data).
    """

    mean: torch.Tensor
    sq_mean: torch.Tensor
    deviations: torch.Tensor
    count: int
    max_rank: int
    like: Params


def _flat(params: Mapping[str, torch.Tensor], like: Params | None = None) -> torch.Tensor:
    if like is not None:
        shapes = {name: tuple(value.shape) for name, value in params.items()}
        expected = {name: tuple(value.shape) for name, value in like.items()}
        if list(shapes) != list(expected) or shapes != expected:
            raise InvalidOptionError("swag option 'params' must have the names, order and "
                                     "shapes of the parameters given to init")
    return flatten({name: value.detach() for name, value in params.items()})


def init(params: Mapping[str, torch.Tensor], max_rank: int = RANK) -> SwagState:
    """An empty SWAG state for parameters shaped like ``params``.

    Parameters
    ----------
    params : Mapping[str, torch.Tensor]
        Parameters keyed like ``model.named_parameters()`` (values are not collected;
        call :func:`update` for every iterate, the base network's included if wanted).
    max_rank : int, default 20
        Deviation columns kept (``K``).

    Returns
    -------
    SwagState
        ``count == 0``, zero moments, no deviation columns.
    """
    max_rank = _integer("max_rank", max_rank, 1)
    if not params:
        raise InvalidOptionError("swag option 'params' must hold at least one tensor")
    vector = _flat(params)
    like = {name: torch.empty(value.shape, dtype=value.dtype, device="meta")
            for name, value in params.items()}
    zeros = torch.zeros(vector.numel(), dtype=torch.float64, device=vector.device)
    return SwagState(mean=zeros, sq_mean=zeros.clone(),
                     deviations=vector.new_zeros((0, vector.numel())), count=0,
                     max_rank=max_rank, like=like)


def update(state: SwagState, params: Mapping[str, torch.Tensor]) -> SwagState:
    """Collect one iterate.

    Parameters
    ----------
    state : SwagState
    params : Mapping[str, torch.Tensor]
        The iterate, with the names, order and shapes given to :func:`init`.

    Returns
    -------
    SwagState
        Moments including the iterate (``mean_n = mean_{n-1} + (theta - mean_{n-1}) / n``,
        likewise for the squares) and the deviation ``theta - mean_n`` appended, the
        oldest column dropped beyond ``max_rank``.
    """
    theta = _flat(params, state.like).to(torch.float64)
    count = state.count + 1
    mean = state.mean + (theta - state.mean) / count
    sq_mean = state.sq_mean + (theta * theta - state.sq_mean) / count
    column = (theta - mean).to(state.deviations.dtype)[None, :]
    deviations = torch.cat([state.deviations, column])[-state.max_rank:]
    return dataclasses.replace(state, mean=mean, sq_mean=sq_mean, deviations=deviations,
                               count=count)


def variance(state: SwagState) -> torch.Tensor:
    """Float64 ``(P,)`` diagonal variance ``max(E[theta^2] - E[theta]^2, 0)``."""
    return (state.sq_mean - state.mean * state.mean).clamp_min(0.0)


def covariance(state: SwagState, scale: float = SCALE) -> torch.Tensor:
    """The dense ``(P, P)`` float64 covariance of :func:`sample` (for small networks/tests).

    ``scale * (diag(var) + D^T D / (K - 1))``.
    """
    scale = _number("scale", scale, 0)
    deviations = _deviations_for_sampling(state)
    low_rank = deviations.T @ deviations / (deviations.shape[0] - 1)
    return scale * (torch.diag(variance(state)) + low_rank)


def _deviations_for_sampling(state: SwagState) -> torch.Tensor:
    if state.count < 2:
        raise InvalidOptionError(f"swag option 'state' needs at least 2 collected iterates "
                                 f"to sample, has {state.count}")
    return state.deviations.to(torch.float64)


def sample_vector(state: SwagState, generator: torch.Generator, scale: float = SCALE
                  ) -> torch.Tensor:
    """One float64 ``(P,)`` SWAG draw over the whole network.

    Draws ``z1 ~ N(0, I_P)`` then ``z2 ~ N(0, I_K)`` from ``generator`` (in that order) and
    returns ``mean + sqrt(scale) * (sqrt(var) * z1 + D^T z2 / sqrt(K - 1))``, ``K`` the
    number of deviation columns held.
    """
    scale = _number("scale", scale, 0)
    deviations = _deviations_for_sampling(state)
    rank = deviations.shape[0]
    device = state.mean.device
    z1 = torch.randn(state.mean.shape, generator=generator, dtype=torch.float64,
                     device=device)
    z2 = torch.randn((rank,), generator=generator, dtype=torch.float64, device=device)
    spread = variance(state).sqrt() * z1 + deviations.T @ z2 / math.sqrt(rank - 1)
    return state.mean + math.sqrt(scale) * spread


def sample(state: SwagState, generator: torch.Generator, count: int, scale: float = SCALE,
           buffers: Mapping[str, torch.Tensor] | None = None) -> list[dict[str, torch.Tensor]]:
    """``count`` SWAG samples as state_dicts of the base architecture.

    Parameters
    ----------
    state : SwagState
        At least 2 collected iterates.
    generator : torch.Generator
        The only source of randomness (on the state's device); sample ``s`` is the
        ``s``-th call of :func:`sample_vector`.
    count : int
        Number of samples ``S`` (>= 1).
    scale : float, default 0.1
        Multiplies the covariance.
    buffers : Mapping[str, torch.Tensor], optional
        Buffers to complete each state_dict with (cloned), e.g. the base network's
        BatchNorm statistics as placeholders: for a network with BatchNorm the trainer
        replaces them with ``recompute_batchnorm(model, params, buffers, batches)`` for
        every sample.

    Returns
    -------
    list of dict[str, torch.Tensor]
        ``S`` dicts: the parameters (names, shapes and dtypes of the ``params`` given to
        :func:`init`), then the buffers. Load with ``model.load_state_dict``.
    """
    count = _integer("count", count, 1)
    scale = _number("scale", scale, 0)
    result = []
    for _ in range(int(count)):
        params = unflatten(sample_vector(state, generator, scale), state.like)
        extra = {name: value.detach().clone() for name, value in (buffers or {}).items()}
        result.append({**params, **extra})
    return result


# ---------------------------------------------------------------- BatchNorm
def recompute_batchnorm(model: nn.Module, params: Mapping[str, torch.Tensor],
                        buffers: Mapping[str, torch.Tensor],
                        batches: Iterable[tuple[torch.Tensor, torch.Tensor] | torch.Tensor]
                        ) -> dict[str, torch.Tensor]:
    """BatchNorm running statistics recomputed for the parameters ``params``.

    Every BatchNorm layer's statistics are reset (mean 0, variance 1, ``num_batches_tracked``
    0) and re-estimated by forward passes over ``batches`` with the BatchNorm layers in
    training mode and ``momentum=None``: the cumulative average over batches of each
    batch's mean and unbiased variance (every batch weighs the same, a smaller last batch
    included; Maddox et al.'s ``bn_update`` weighs batches by their size instead). Every
    other module runs in evaluation mode (no dropout). No gradients are taken.

    Parameters
    ----------
    model : torch.nn.Module
        The base architecture; its own weights, buffers, modes and momenta are left as they
        were.
    params : Mapping[str, torch.Tensor]
        The sampled parameters, keyed like ``model.named_parameters()``.
    buffers : Mapping[str, torch.Tensor]
        All of the model's buffers (e.g. the base network's); the BatchNorm ones are
        replaced, any other is returned unchanged (cloned).
    batches : iterable of (images, labels) or of images
        Training batches ``(B, C, H, W)`` (the trainer's seeded order; with or without
        augmentation as the trainer chooses).

    Returns
    -------
    dict[str, torch.Tensor]
        New buffers with the keys of ``buffers``.

    Raises
    ------
    InvalidOptionError
        If ``batches`` is empty while the model has BatchNorm layers.
    """
    new = {name: value.detach().clone() for name, value in buffers.items()}
    norms = {name: module for name, module in model.named_modules()
             if isinstance(module, nn.modules.batchnorm._BatchNorm)}
    if not norms:
        return new
    for name, module in norms.items():
        prefix = f"{name}." if name else ""
        if module.track_running_stats:
            new[f"{prefix}running_mean"].zero_()
            new[f"{prefix}running_var"].fill_(1.0)
            new[f"{prefix}num_batches_tracked"].zero_()
    training = {name: module.training for name, module in model.named_modules()}
    momenta = {name: module.momentum for name, module in norms.items()}
    seen = 0
    try:
        model.eval()
        for module in norms.values():
            module.train()
            module.momentum = None
        with torch.no_grad():
            for batch in batches:
                images = batch[0] if isinstance(batch, tuple | list) else batch
                logits(model, params, new, images)  # updates ``new`` in place
                seen += 1
    finally:
        for name, module in model.named_modules():
            module.train(training[name])
        for name, module in norms.items():
            module.momentum = momenta[name]
    if seen == 0:
        raise InvalidOptionError("swag option 'batches' is empty: BatchNorm statistics need "
                                 "at least one batch")
    return new


# ---------------------------------------------------------------- the method
# MAX_SWAG_RANK, MAX_SWAG_SCALE and SWAG_REFERENCE_EPOCHS (the phase length the defaults
# are for) are the vocabulary's, with their reasons.


def scaled_default(usual: int, epochs: int, reference: int, minimum: int) -> int:
    """``usual`` scaled to a phase of ``epochs`` instead of ``reference`` epochs, rounded,
    at least ``minimum`` and at most ``usual`` (a longer phase keeps the usual value)."""
    return min(usual, max(minimum, round(usual * epochs / reference)))


def _epochs_default(context: Context) -> Resolved:
    epochs = context.recipe.epochs
    value = LENGTH_FACTOR * epochs
    usual = SWAG_REFERENCE_EPOCHS
    note = (None if value == usual else
            f"swag: epochs {value} (derived: twice the recipe's {epochs} epochs; "
            f"{usual} at 60 epochs)")
    return Resolved(value, f"derived from the recipe (twice its {epochs} epochs)", note)


def _scaled(name: str, usual: int, minimum: int) -> DefaultRule:
    """A default that scales with the phase's epochs (:func:`scaled_default`); the
    iterates also fit the collection window."""
    def rule(context: Context) -> Resolved:
        epochs = context.resolved["epochs"]
        value = scaled_default(usual, epochs, SWAG_REFERENCE_EPOCHS, minimum)
        because = f"epochs={epochs}"
        if name == "iterates":
            window = epochs - context.resolved["collect_from"]
            if window < value:
                value = max(minimum, window)
                because = (f"the {window} epochs from collect_from="
                           f"{context.resolved['collect_from']} to epochs={epochs}")
        if value == usual:
            return Resolved(value, f"default ({usual} for {SWAG_REFERENCE_EPOCHS} or more "
                                   "epochs)")
        return Resolved(value, f"derived from {because}",
                        f"swag: {name} {value} (derived from {because}; default {usual} at "
                        f"60 epochs)")
    return rule


def _rank_default(context: Context) -> Resolved:
    iterates = context.resolved["iterates"]
    if iterates >= RANK:
        return Resolved(RANK)
    return Resolved(iterates, f"derived from iterates={iterates}",
                    f"swag: rank {iterates} (derived from iterates={iterates}: one deviation "
                    f"column per iterate; default {RANK} with {ITERATES} iterates)")


def _iterates(what: str, value: int, context: Context) -> int:
    window = context.resolved["epochs"] - context.resolved["collect_from"]
    if value > window:
        raise InvalidOptionError(
            f"swag option 'iterates' ({value}) exceeds the {window} epochs from "
            "'collect_from' to 'epochs'")
    return value


#: The options (posteriorzoo.vocabulary.SWAG_OPTIONS: ramp_epochs is at most epochs and
#: collect_from below it, there) with the rules of their derived defaults and the window
#: the iterates must fit.
OPTIONS = declared_options(
    "swag", checks={"iterates": _iterates},
    defaults={"lr": recipe_lr, "epochs": _epochs_default,
              "ramp_epochs": _scaled("ramp_epochs", RAMP_EPOCHS, 1),
              "iterates": _scaled("iterates", ITERATES, 2), "rank": _rank_default})


@dataclass(frozen=True)
class SwagPosterior:
    """A mode's SWAG posterior: the collected moments (None when the phase stopped early
    with fewer than 2 iterates: then every sample is the last weights), the scale of a
    draw, the base network and where BatchNorm statistics are re-estimated from."""

    swag: SwagState | None
    scale: float
    model: nn.Module
    buffers: dict[str, torch.Tensor]
    read_batches: Callable[[], Iterable]


class Swag(Method):
    """SWAG: the base network's SGD continued on SWAG's schedule; iterates collected at
    equal intervals of the window give a Gaussian with a diagonal plus low-rank
    covariance, sampled at ``scale`` (BatchNorm statistics recomputed per sample)."""

    name = "swag"
    summary = "SWA-Gaussian: moments of SGD iterates around each trained base network"

    options = OPTIONS

    def phase_steps(self, spec: Any, steps_per_epoch: int) -> int:
        return spec.method_options["epochs"] * steps_per_epoch

    def fit(self, run: ModeRun) -> Posterior:
        spec, engine, seeds = run.spec, run.engine, run.seeds
        model, steps = engine.train_base()
        opts = spec.method_options
        recipe = spec.recipe
        stepper = engine.sgd_stepper(model)
        start_lr = recipe.learning_rate(max(0, recipe.epochs - 1))

        def schedule(epoch: int) -> float:
            return swag_learning_rate(epoch, opts["lr"], opts["ramp_epochs"], start_lr)

        names = [name for name, _ in model.named_parameters()]
        collector = Collector(names, epochs=set(collection_epochs(
            opts["epochs"], opts["iterates"], opts["collect_from"])))
        result = fit(stepper, engine.batches(model, seeds.method), schedule, opts["epochs"],
                     index=run.index, phase="swag", callbacks=[*run.callbacks, collector])
        engine.load_stepper_weights(model, stepper)
        params, buffers = parameters_of(model)
        state = init(params, max_rank=opts["rank"])
        for iterate in collector.kept:
            state = update(state, iterate)
        record = {"method": "swag", "iterates": state.count,
                  "rank": int(state.deviations.shape[0]), "scale": opts["scale"],
                  "epochs": opts["epochs"]}
        posterior = SwagPosterior(
            state if state.count >= 2 else None, opts["scale"], model, buffers,
            lambda: engine.read_batches(seeds.method))
        return Posterior(posterior, steps + result.steps, engine.name, record)

    def sample(self, state: SwagPosterior, generator: torch.Generator, count: int
               ) -> list[dict[str, torch.Tensor]]:
        if state.swag is None:  # the phase stopped early (diverged): the last weights
            return [state.model.state_dict()] * count
        samples = sample(state.swag, generator, count, state.scale, buffers=state.buffers)
        if state.buffers:  # BatchNorm statistics of every sample, from the training data
            names = [name for name, _ in state.model.named_parameters()]
            for drawn in samples:
                params = {name: drawn[name] for name in names}
                drawn.update(recompute_batchnorm(state.model, params, state.buffers,
                                                 state.read_batches()))
        return samples


METHOD = Swag()
