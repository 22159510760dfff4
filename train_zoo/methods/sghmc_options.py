"""SGHMC's (and SGLD's) options: the rules of their derived defaults and checks.

:func:`method_options` completes the vocabulary's declaration of the options
(``posteriorzoo.vocabulary``: their names, constraints, defaults and help) with what needs
a model or the other options: the preconditioner's ``auto`` and its dense-matrix limit,
the defaults that depend on the preconditioner (``burn_in``, ``thin``, ``chains``,
``batch_size``, ``minibatches``) and what a collection records. It is apart from the
method (:class:`train_zoo.methods.sghmc.Sghmc`, whose ``options`` it builds, as it does
:class:`train_zoo.methods.sgld.Sgld`'s) because it needs no tensor.
"""

from __future__ import annotations

from collections.abc import Callable

from posteriorzoo.vocabulary import (
    ADAPTED_BATCH,
    ADAPTED_BURN_IN,
    ADAPTED_CHAINS,
    ADAPTED_THIN,
    AUTO_FULL_LAPLACE_PARAMETERS,
    SGHMC_BURN_IN,
    SGHMC_LR,
    SGHMC_THIN,
    SGHMC_WHITENED_BATCH,
)
from train_zoo.methods import laplace
from train_zoo.methods.base import Context, MethodOption, Resolved, declared_options

__all__ = ["method_options"]

# The numbers of SGHMC's (and SGLD's) options are the vocabulary's, declared once with
# their reasons: MAX_CHAINS, MAX_SGHMC_STEPS; SGHMC_LR, SGHMC_BURN_IN, SGHMC_THIN (measured
# on OptuNet / Fashion-MNIST); SGHMC_WHITENED_LR, SGHMC_WHITENED_BATCH (a preconditioned
# chain's); ADAPT_LR, ADAPT_ALPHA, ADAPT_BATCH, ADAPT_THIN and ADAPT_STEPS (the warm-up of
# preconditioner = "adapted"); ADAPT_ROUNDS, ADAPT_ROUND_STEPS, ADAPTED_BATCH, ROUND_DRAWS,
# SETTLE_STEPS (its cold rounds and settling); ADAPTED_CHAINS, ADAPTED_BURN_IN,
# ADAPTED_THIN (an adapted chain's defaults).
#
# Where a chain's minibatches come from (SGHMC_MINIBATCHES): the recipe's shuffled epochs,
# or independent draws with replacement. Chen et al.'s correction assumes independent
# minibatch noise; within an epoch the batches add up to the whole dataset, so their noise
# cancels over the epoch. A chain whose momentum lasts longer than an epoch (1 / alpha
# steps against N / batch_size) then feels less noise than the estimate subtracts and runs
# cold: four chains at 0.91-0.96 against 1.02 from the same start on OptuNet /
# Fashion-MNIST (batch 1024, alpha 2e-3, 59 batches an epoch), and in
# ``tests/test_sghmc_minibatches.py`` on a Gaussian.
#
# An adapted chain's defaults (what "auto" takes for OptuNet): its cold rounds and
# settling already bring each chain to the posterior, and in the noise-equalized metric
# 1,000 steps decorrelate a sample (lag-1 autocorrelation 0.04): the shipped collection,
# median ESS 64 of 100 and R-hat 1.045. The plain chain's 20,000 and 4,000
# (SGHMC_BURN_IN) gave ESS 8 and R-hat 1.96 on the same posterior.


def _preconditioner(what: str, value: object, context: Context) -> object:
    if value == "auto":
        return _preconditioner_auto(context)
    if value in ("laplace", "adapted"):
        laplace.check_dense(what, value, context, "a dense mass matrix", "'none'")
    return value


def _preconditioner_auto(context: Context) -> Resolved:
    # The adapted metric is the one measured to mix on OptuNet (ADAPTED_BURN_IN); it needs
    # a dense d x d matrix, as full Laplace does, so it shares Laplace's size bound.
    bound = AUTO_FULL_LAPLACE_PARAMETERS
    count = context.parameter_count()
    if count <= bound:
        return Resolved("adapted", f"derived from the model ({count:,} parameters <= "
                                   f"{bound:,})")
    return Resolved("none", f"derived from the model ({count:,} parameters > {bound:,})",
                    note=f"{context.method}: preconditioner none (the model's {count:,} "
                         f"parameters are too many for a dense mass matrix; a plain chain at lr "
                         f"{SGHMC_LR:g} mixes slowly: check it with posteriorzoo diagnose)")


def _adapted_default(adapted: int, plain: int) -> Callable[[Context], Resolved]:
    """The default of burn_in or thin: ``adapted`` for an adapted chain, else ``plain``."""
    def default(context: Context) -> Resolved:
        # The preconditioner's value is resolved before this one (table order).
        if context.resolved.get("preconditioner") == "adapted":
            return Resolved(adapted, "default of an adapted chain")
        return Resolved(plain)
    return default


def _chains_default(context: Context) -> Resolved:
    # R-hat compares chains, so an adapted chain defaults to ADAPTED_CHAINS of them; the
    # count must divide samples_per_mode, so it falls to the largest that does.
    if context.resolved.get("preconditioner") != "adapted":
        return Resolved(1)
    per_mode = context.samples_per_mode or ADAPTED_CHAINS
    chains = max(c for c in range(1, ADAPTED_CHAINS + 1) if per_mode % c == 0)
    if chains == ADAPTED_CHAINS:
        return Resolved(chains, "default of an adapted chain")
    return Resolved(chains, f"derived from samples_per_mode={per_mode}",
                    note=f"{context.method}: chains {chains} (derived from "
                         f"samples_per_mode={per_mode}, not a multiple of "
                         f"{ADAPTED_CHAINS}; default {ADAPTED_CHAINS})")


def _batch_size_default(context: Context) -> Resolved:
    # The preconditioner's value is resolved before this one (table order).
    if context.resolved.get("preconditioner") == "adapted":
        return Resolved(ADAPTED_BATCH, "default of an adapted chain")
    if context.resolved.get("preconditioner") == "laplace":
        return Resolved(SGHMC_WHITENED_BATCH, "default of a preconditioned chain")
    return Resolved(context.recipe.batch_size, "derived from the recipe (its batch_size)")


def _minibatches_default(context: Context) -> Resolved:
    # A preconditioned chain runs at a low friction, its momentum outlasting an epoch.
    if context.resolved.get("preconditioner") in ("laplace", "adapted"):
        return Resolved("independent", "default of a preconditioned chain")
    return Resolved("epochs", "default")


def _preconditioned(context: Context) -> bool:
    # A chain without one records none of its options, as collections made before the
    # preconditioner existed (or before "auto" was its default) did.
    return context.resolved["preconditioner"] != "none"


def _adapted(context: Context) -> bool:
    return context.resolved["preconditioner"] == "adapted"


def method_options(method: str) -> tuple[MethodOption, ...]:
    """The options of ``method`` (``sghmc``, or ``sgld``: the same without ``alpha``), with
    the rules of their derived defaults, what a collection records, and ``auto`` and the
    dense-matrix limit of the preconditioner."""
    return declared_options(
        method, checks={"preconditioner": _preconditioner},
        defaults={"burn_in": _adapted_default(ADAPTED_BURN_IN, SGHMC_BURN_IN),
                  "thin": _adapted_default(ADAPTED_THIN, SGHMC_THIN),
                  "chains": _chains_default, "batch_size": _batch_size_default,
                  "minibatches": _minibatches_default},
        recorded={"preconditioner": _preconditioned, "adapt_steps": _adapted,
                  "adapt_rounds": _adapted, "adapt_round_steps": _adapted,
                  "settle_steps": _adapted, "whitened_lr": _preconditioned,
                  "batch_size": lambda context: (context.resolved["batch_size"]
                                                 != context.recipe.batch_size),
                  "minibatches": lambda context: (context.resolved["minibatches"] != "epochs"
                                                  or _preconditioned(context))})
