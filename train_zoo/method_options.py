"""The options of each method in a spec's ``[method_options]`` table, checked and completed.

Every option is declared once, as data, in :mod:`posteriorzoo.vocabulary` (each
:class:`~posteriorzoo.vocabulary.MethodInfo`'s ``options``: name, constraints, default,
help); its method's module makes the :class:`~train_zoo.methods.base.MethodOption`
records from them (:func:`~train_zoo.methods.base.declared_options`), adding the rules of
derived defaults and the checks that need the model or the other options. Validation
(:func:`resolve_method_options`) reads those records; the listing
(:func:`describe_options`, ``posteriorzoo train --list-options``, which shows every
method's options, ranges and defaults) reads the declarations alone, so an option is
accepted exactly when it is listed and the listing needs no torch.

:func:`resolve_method_options` returns every option with its default filled in, so a
collection records exactly what produced it; :func:`explain_method_options` also says
where each value came from (given, default, or derived from the recipe or the model) and
gives one line per default that differs from its usual value because the recipe is
shorter or the model larger. The reasons for each default and range are at the constants
of the vocabulary (re-exported here for the methods whose numbers the tests read).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from posteriorzoo.errors import UnknownNameError
from posteriorzoo.vocabulary import (
    AUTO_FULL_LAPLACE_PARAMETERS,
    LAPLACE_STRUCTURES,
    MAX_CHAINS,
    MAX_SGHMC_STEPS,
    MAX_SWAG_RANK,
    MAX_SWAG_SCALE,
    PRIOR_PRECISION_RANGE,
    SGHMC_BURN_IN,
    SGHMC_LR,
    SGHMC_PRECONDITIONERS,
    SGHMC_THIN,
    SGHMC_WHITENED_BATCH,
    SGHMC_WHITENED_LR,
    SWAG_ITERATES,
    SWAG_RAMP_EPOCHS,
    SWAG_RANK,
    SWAG_REFERENCE_EPOCHS,
    SWAG_SCALE,
)
from posteriorzoo.vocabulary import describe_options as _describe_options
from train_zoo.methods.base import Context, MethodOption, Resolved, ResolvedOptions
from train_zoo.methods.bbb_options import resolve_kl_weight
from train_zoo.methods.registry import METHODS, get_method
from train_zoo.methods.swag import scaled_default
from train_zoo.recipes import Recipe

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
    ``method`` (every method when None) with ``method``, ``option``, ``default``,
    ``allowed`` and ``help``, read from the declarations the validation's records are made
    from (:func:`posteriorzoo.vocabulary.describe_options`).

    Raises
    ------
    UnknownNameError
        ``method`` is not one of :data:`METHODS`.
    """
    if method is not None:
        get_method(method)
    return _describe_options(method)
