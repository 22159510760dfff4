"""The options of each method in a spec's ``[method_options]`` table, checked and completed.

Every option is one declared record, :class:`~train_zoo.methods.base.MethodOption` (name,
check, default, help), held by its method's object in the registry
(:mod:`train_zoo.methods.registry`; :func:`option_table`). Validation
(:func:`resolve_method_options`) and the listing (:func:`describe_options`,
``posteriorzoo train --list-options``) read the same records, so an option is accepted
exactly when it is listed.

:func:`resolve_method_options` returns every option with its default filled in, so a
collection records exactly what produced it; :func:`explain_method_options` also says
where each value came from (given, default, or derived from the recipe or the model) and
gives one line per default that differs from its usual value because the recipe is
shorter or the model larger. Defaults follow PAPER_NOTES; each number has a range, with
its reason at the constants of the method's module (re-exported here):

``de``
    No options: a mode is one independently trained network, stored as it is.
``mc-dropout``
    ``p``: dropout probability before the last layer during training (ResNets 0.5,
    other architectures 0.2).
``swag``
    ``lr`` (the recipe's initial lr), ``epochs`` (twice the recipe's; 1 to the recipe's
    ``MAX_EPOCHS``), ``ramp_epochs``, ``collect_from`` (0: the first epoch of the window
    whose iterates are collected; below ``epochs``), ``iterates`` (2 up to the window),
    ``rank`` (1 to :data:`MAX_SWAG_RANK`) and ``scale`` (0.1; 0 to
    :data:`MAX_SWAG_SCALE`). The defaults of ``ramp_epochs`` (10), ``iterates`` (20) and
    ``rank`` (20) are those of a SWAG phase of :data:`SWAG_REFERENCE_EPOCHS` = 120 epochs
    (the paper's 60-epoch recipe); a shorter phase scales them down in proportion
    (:func:`~train_zoo.methods.swag.scaled_default`): at least 1 ramp epoch and 2
    iterates, never more iterates than the window's epochs, and the rank at most the
    iterates (a rank above them adds no deviation column).
``laplace``
    ``structure`` (``"auto"``: ``"full"`` for a network of at most
    :data:`AUTO_FULL_LAPLACE_PARAMETERS` parameters, else ``"last-layer-kfac"``; a
    collection records the structure ``auto`` chose) and ``prior_precision``
    (``"marglik"``, ``"training"`` for N x weight decay, or a number in
    :data:`PRIOR_PRECISION_RANGE`).
``sghmc``
    ``preconditioner`` (``"auto"``: ``"adapted"`` up to :data:`AUTO_FULL_LAPLACE_PARAMETERS`
    parameters, as OptuNet, else ``"none"``; ``"laplace"`` runs each chain with a
    constant mass matrix, the base network's full Laplace precision, from its own draw of
    that Laplace approximation; ``"adapted"`` first runs each chain ``adapt_steps``
    (40,000) steps in that metric and widens it where the chains spread wider, then runs
    ``adapt_rounds`` (3) cold rounds of ``adapt_round_steps`` (29,000) in the
    noise-equalized metric, widened between rounds, lets the last round's lowest-loss
    chain continue until its loss stops falling (at most ``settle_steps``, 290,000) and
    samples every chain from where it settled; with ``adapt_rounds = 0`` each chain
    samples from where its warm-up ended), ``lr`` (2e-4, per example: the step size of a
    ``"none"`` chain on the full-data log posterior is ``lr / N``), ``alpha`` (friction
    0.1, in (0, 1]), ``burn_in`` and ``thin`` (4,000 and 1,000 for an adapted chain, the
    setting measured to mix on OptuNet; else 20,000 and 4,000), each at most
    :data:`MAX_SGHMC_STEPS`, ``prior_precision`` (``"training"`` for N x weight decay, or
    a number in :data:`PRIOR_PRECISION_RANGE`), ``chains`` (independent chains per mode
    from its base network, each keeping ``samples_per_mode / chains`` samples: 4 for an
    adapted chain, or the largest count below it that divides ``samples_per_mode``; else
    1), ``noise_correction`` (true: subtract Chen et al.'s ``beta_hat`` estimated from the
    minibatch gradients) and ``noise_decay`` (0.99, the running estimate's weight of the
    past), ``whitened_lr`` (1e-4, the step of a ``"laplace"`` chain and of an
    ``"adapted"`` one without cold rounds; the cold rounds derive theirs from the noise),
    ``batch_size`` (1,024 with ``"adapted"``, 512 with ``"laplace"``, else the recipe's)
    and ``minibatches`` (``"independent"`` with a preconditioner, else ``"epochs"``). A
    collection made before ``"auto"`` was the default records no ``preconditioner``: it
    was ``"none"``. See :data:`SGHMC_LR` and :data:`SGHMC_WHITENED_LR`.
``bbb``
    ``preset`` (``"paper"``: SGD at the recipe's learning rate, the paper's Table 1, or
    ``"trained-variance"``: Adam for ``rho``, whose ``sigma`` then trains), ``optimizer``,
    ``lr``, ``rho_optimizer`` and ``rho_lr`` (:class:`train_zoo.methods.bbb.BBBTraining`),
    and the fields of
    :class:`train_zoo.methods.bbb.BBBOptions` (prior N(0, 0.1^2), rho init -7 / -6, 3 ELBO
    samples, ``kl_weight`` 1/N when unset); one line of help each in
    :data:`train_zoo.methods.bbb.OPTION_HELP`, from which its records are made. Their values
    are checked by :func:`train_zoo.methods.bbb.resolve_options`. The paper's training
    records only the latter, as collections made before the others existed.
``emp``
    The fields of :class:`train_zoo.methods.emp.EmpOptions` (``components`` 5, ``patch``
    ``"auto"``, ``variant`` ``"emp"``, ``samples`` 100, ``weight_decay`` 1e-3, ``lr``
    1e-3, ``init_noise`` 0.1), each checked by that class, with the help of
    :data:`train_zoo.methods.emp.OPTION_HELP`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from posteriorzoo.errors import UnknownNameError
from train_zoo.methods.base import Context, MethodOption, Resolved, ResolvedOptions
from train_zoo.methods.bbb import resolve_kl_weight
from train_zoo.methods.laplace import (
    AUTO_FULL_LAPLACE_PARAMETERS,
    LAPLACE_STRUCTURES,
    PRIOR_PRECISION_RANGE,
)
from train_zoo.methods.registry import METHODS, get_method
from train_zoo.methods.sghmc import (
    MAX_CHAINS,
    MAX_SGHMC_STEPS,
    SGHMC_BURN_IN,
    SGHMC_LR,
    SGHMC_PRECONDITIONERS,
    SGHMC_THIN,
    SGHMC_WHITENED_BATCH,
    SGHMC_WHITENED_LR,
)
from train_zoo.methods.swag import (
    ITERATES,
    MAX_SWAG_RANK,
    MAX_SWAG_SCALE,
    RAMP_EPOCHS,
    RANK,
    SCALE,
    SWAG_REFERENCE_EPOCHS,
    scaled_default,
)
from train_zoo.recipes import Recipe

#: SWAG's defaults for a phase of SWAG_REFERENCE_EPOCHS epochs (train_zoo.methods.swag's).
SWAG_RAMP_EPOCHS, SWAG_ITERATES, SWAG_RANK, SWAG_SCALE = RAMP_EPOCHS, ITERATES, RANK, SCALE

__all__ = [
    "AUTO_FULL_LAPLACE_PARAMETERS", "LAPLACE_STRUCTURES", "MAX_CHAINS", "MAX_SGHMC_STEPS",
    "MAX_SWAG_RANK", "MAX_SWAG_SCALE", "METHODS", "PRIOR_PRECISION_RANGE", "SGHMC_BURN_IN",
    "SGHMC_LR", "SGHMC_PRECONDITIONERS", "SGHMC_THIN", "SGHMC_WHITENED_BATCH",
    "SGHMC_WHITENED_LR", "SWAG_ITERATES", "SWAG_RAMP_EPOCHS", "SWAG_RANK",
    "SWAG_REFERENCE_EPOCHS", "SWAG_SCALE", "Context", "MethodOption", "Resolved",
    "ResolvedOptions", "describe_options", "explain_method_options", "option_table",
    "resolve_kl_weight", "resolve_method_options", "scaled_default",
]


def option_table(method: str) -> tuple[MethodOption, ...]:
    """The declared options of ``method``, in the order they are resolved and listed.

    Raises
    ------
    UnknownNameError
        ``method`` is not one of :data:`METHODS`.
    """
    return get_method(method).option_table()


def explain_method_options(method: str, options: Mapping[str, Any], architecture: str,
                           recipe: Recipe, *, model_options: Mapping[str, Any] | None = None,
                           num_classes: int | None = None,
                           samples_per_mode: int | None = None) -> ResolvedOptions:
    """Every option of ``method`` for this model and recipe, with where each came from.

    Raises
    ------
    UnknownNameError
        An option ``method`` does not have (the message lists those it has).
    InvalidOptionError
        A value of the wrong type or out of range (one line naming the option).
    """
    declared = get_method(method)
    names = [option.name for option in declared.option_table()]
    unknown = sorted(set(options) - set(names))
    if unknown:
        raise UnknownNameError(f"unknown {method} option(s) {unknown}; options: "
                               f"{', '.join(names) or 'none'}")
    context = Context(method, architecture, recipe, dict(model_options or {}), num_classes,
                      samples_per_mode=samples_per_mode)
    return declared.explain(options, context)


def resolve_method_options(method: str, options: Mapping[str, Any], architecture: str,
                           recipe: Recipe, *, model_options: Mapping[str, Any] | None = None,
                           num_classes: int | None = None,
                           samples_per_mode: int | None = None) -> dict[str, Any]:
    """Every option of ``method`` for this architecture and recipe, defaults filled in
    (:func:`explain_method_options`'s ``values``).

    Raises
    ------
    UnknownNameError
        An option ``method`` does not have.
    InvalidOptionError
        A value of the wrong type or out of range (one line naming the option).
    """
    return explain_method_options(method, options, architecture, recipe,
                                  model_options=model_options, num_classes=num_classes,
                                  samples_per_mode=samples_per_mode).values


def describe_options(method: str | None = None) -> list[dict[str, str]]:
    """The listing of ``posteriorzoo train --list-options``: one row per option of
    ``method`` (every method when None) with ``method``, ``name``, ``default`` and
    ``help``, read from the same records as the validation."""
    methods = METHODS if method is None else (method,)
    return [{"method": name, "option": option.name, "default": option.default_text,
             "help": option.help}
            for name in methods for option in option_table(name)]
