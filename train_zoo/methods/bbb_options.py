"""Bayes by Backprop's options: their names, help, presets and checks.

:mod:`train_zoo.methods.bbb` holds the method; this module holds what a spec's
``[method_options]`` may say about it and how those values are checked and completed:
:class:`BBBOptions` (the variational family, prior and initialisation), :class:`BBBTraining`
(the optimisers of ``mu`` and ``rho`` and their learning rates), the named
:data:`PRESETS`, :data:`OPTION_HELP`, :func:`resolve_options` (what a collection records),
:func:`split_options` and :func:`resolve_kl_weight`; the options' names, constraints,
defaults and help are declared in :mod:`posteriorzoo.vocabulary` (``BBB_OPTIONS``). It is
apart because it needs no
network and no tensor: the CLI's option listing and validation read it, and the
numerical pieces (:mod:`~train_zoo.methods.bbb_state`, :mod:`~train_zoo.methods.bbb_elbo`,
:mod:`~train_zoo.methods.bbb_update`) take its checked values. Every name is re-exported
by :mod:`train_zoo.methods.bbb`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any

from posteriorzoo.errors import UnknownNameError
from posteriorzoo.options import check_constraints, check_integer
from posteriorzoo.vocabulary import (
    BBB_ADAM_LR,
    BBB_MEAN_INITS,
    BBB_OPTIMIZERS,
    BBB_PRESETS,
    options_of,
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

#: Where the means start (``N(0, mean_std^2)`` draws, or the model's current weights), the
#: optimisers of ``mu`` and ``rho`` (:class:`BBBTraining`), Adam's initial learning rate
#: when neither the options nor the preset give one (BLiTZ's examples train with 1e-3):
#: the vocabulary's, as every option's name, constraints, default and help.
MEAN_INITS, OPTIMIZERS, ADAM_LR = BBB_MEAN_INITS, BBB_OPTIMIZERS, BBB_ADAM_LR
#: Adam's moment decay rates and denominator term: ``torch.optim.Adam``'s defaults, which
#: BLiTZ's examples use.
ADAM_BETAS = (0.9, 0.999)
ADAM_EPS = 1e-8

#: The named settings (the vocabulary's :data:`~posteriorzoo.vocabulary.BBB_PRESETS`): the
#: options each one sets before the spec's own are applied.
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
PRESETS: dict[str, dict[str, object]] = BBB_PRESETS

_DECLARED = {option.name: option for option in options_of("bbb")}
#: One line of help per option of the method (``[method_options]`` of a spec), from the
#: vocabulary's declarations.
OPTION_HELP: dict[str, str] = {name: option.help for name, option in _DECLARED.items()}


def _default(name: str) -> Any:
    """The vocabulary's literal default of the option ``name``."""
    return _DECLARED[name].default


def _check(name: str, value: object) -> Any:
    """``value`` checked by the vocabulary's constraints of the option ``name``."""
    return check_constraints(name, value, _DECLARED[name].constraints)


@dataclass(frozen=True)
class BBBOptions:
    """The method's options, validated on construction (:class:`InvalidOptionError`) by
    the constraints the vocabulary declares (``posteriorzoo.vocabulary.BBB_OPTIONS``:
    ranges, defaults and help, with the reasons for the ranges).

    Attributes
    ----------
    prior_sigma, prior_sigma2 : float
        ``sigma1``, the standard deviation of the prior's first component (with
        ``prior_pi = 1``, of the prior), and ``sigma2``, the second's (unused when
        ``prior_pi = 1``).
    prior_pi : float
        Weight of the first component.
    elbo_samples : int
        Weight samples per step (Monte Carlo samples of the expected NLL).
    kl_weight : float or None
        Factor of the KL term; None means ``1 / num_data``.
    mean_init : {"random", "model"}
        Means drawn from ``N(0, mean_std^2)``, or the model's current weights.
    mean_std : float
        Standard deviation of the random means.
    rho_linear, rho_conv : float
        Mean of the initial ``rho`` of Linear and of Conv layers.
    rho_std : float
        Standard deviation of the initial ``rho``.
    """

    prior_sigma: float = _default("prior_sigma")
    prior_sigma2: float = _default("prior_sigma2")
    prior_pi: float = _default("prior_pi")
    elbo_samples: int = _default("elbo_samples")
    kl_weight: float | None = _default("kl_weight")
    mean_init: str = _default("mean_init")
    mean_std: float = _default("mean_std")
    rho_linear: float = _default("rho_linear")
    rho_conv: float = _default("rho_conv")
    rho_std: float = _default("rho_std")

    def __post_init__(self) -> None:
        # The vocabulary's constraints (their reasons there); kl_weight None: 1 / N.
        for item in fields(self):
            value = getattr(self, item.name)
            if not (item.name == "kl_weight" and value is None):
                _check(item.name, value)

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
        for item in fields(self):
            _check(item.name, getattr(self, item.name))

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

    optimizer = _check("optimizer", options.get("optimizer", "sgd"))
    rho_optimizer = _check("rho_optimizer", options.get("rho_optimizer", optimizer))
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
    preset = _check("preset", given.pop("preset", _default("preset")))
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
