"""Bayes by Backprop's options: their names, help, presets and checks.

:mod:`train_zoo.methods.bbb` holds the method; this module holds what a spec's
``[method_options]`` may say about it and how those values are checked and completed:
:class:`BBBOptions` (the variational family, prior and initialisation), :class:`BBBTraining`
(the optimisers of ``mu`` and ``rho`` and their learning rates), the named
:data:`PRESETS`, :data:`OPTION_HELP`, :func:`resolve_options` (what a collection records),
:func:`split_options` and :func:`resolve_kl_weight`. It is apart because it needs no
network and no tensor: the CLI's option listing and validation read it, and the
numerical pieces (:mod:`~train_zoo.methods.bbb_state`, :mod:`~train_zoo.methods.bbb_elbo`,
:mod:`~train_zoo.methods.bbb_update`) take its checked values. Every name is re-exported
by :mod:`train_zoo.methods.bbb`.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any, cast

from posteriorzoo.errors import InvalidOptionError, UnknownNameError
from posteriorzoo.options import (
    check_choice,
    check_integer,
    check_name,
    check_number,
    show,
)

__all__ = [
    "ADAM_BETAS",
    "ADAM_EPS",
    "ADAM_LR",
    "MEAN_INITS",
    "OPTIMIZERS",
    "OPTION_HELP",
    "PRESETS",
    "BBBOptions",
    "BBBTraining",
    "resolve_kl_weight",
    "resolve_options",
    "split_options",
]

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
#:     learning rate on ``mu`` and ``rho``. ``sigma`` stays at its initial value
#:     (:mod:`train_zoo.methods.bbb`'s docstring).
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


def _check_finite(what: str, value: object) -> float:
    if (not isinstance(value, numbers.Real) or isinstance(value, bool)
            or not math.isfinite(value)):
        raise InvalidOptionError(f"{what} must be a finite number, not {show(value)}")
    return cast(float, value)  # any real passes as given (an int stays an int in the record)


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


def _training(options: Mapping[str, Any], recipe_lr: float) -> BBBTraining:
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


def resolve_options(options: Mapping[str, Any], recipe_lr: float) -> dict[str, object]:
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


def split_options(options: Mapping[str, Any], recipe_lr: float
                  ) -> tuple[dict[str, Any], BBBTraining]:
    """Resolved options (:func:`resolve_options`) as the keyword arguments of :func:`init`
    and the :class:`BBBTraining`; training options that are absent are the paper's."""
    names = {field.name for field in fields(BBBOptions)}
    return ({name: value for name, value in options.items() if name in names},
            _training(options, recipe_lr))


def resolve_kl_weight(options: Mapping[str, object], num_data: int) -> dict[str, object]:
    """BBB's options with ``kl_weight`` set to ``1 / num_data`` when it was left unset."""
    if options.get("kl_weight") is not None:
        return dict(options)
    check_integer("the training-set size", num_data, 1)
    return {**options, "kl_weight": 1.0 / num_data}
