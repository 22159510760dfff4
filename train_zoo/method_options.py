"""The options of each method in a spec's ``[method_options]`` table, checked and completed.

Every option is one declared record, :class:`MethodOption` (name, check, default, help), in
the method's table (:func:`option_table`). Validation (:func:`resolve_method_options`) and
the listing (:func:`describe_options`, ``posteriorzoo train --list-options``) read the same
table, so an option is accepted exactly when it is listed.

:func:`resolve_method_options` returns every option with its default filled in, so a
collection records exactly what produced it; :func:`explain_method_options` also says
where each value came from (given, default, or derived from the recipe or the model) and
gives one line per default that differs from its usual value because the recipe is
shorter or the model larger. Defaults follow PAPER_NOTES and the method modules; each
number has a range, with its reason at the constants below:

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
    (:func:`scaled_default`): at least 1 ramp epoch and 2 iterates, never more iterates
    than the window's epochs, and the rank at most the iterates (a rank above them adds no
    deviation column).
``laplace``
    ``structure`` (``"auto"``: ``"full"`` for a network of at most
    :data:`AUTO_FULL_LAPLACE_PARAMETERS` parameters, else ``"last-layer-kfac"``; a
    collection records the structure ``auto`` chose) and ``prior_precision``
    (``"marglik"``, ``"training"`` for N x weight decay, or a number in
    :data:`PRIOR_PRECISION_RANGE`).
``sghmc``
    ``lr`` (2e-4, per example: the step size on the full-data log posterior is
    ``lr / N``), ``alpha`` (friction 0.1, in (0, 1]), ``burn_in`` (10,000 steps) and
    ``thin`` (2,000 steps), each at most :data:`MAX_SGHMC_STEPS`, ``prior_precision``
    (``"training"`` for N x weight decay, or a number in :data:`PRIOR_PRECISION_RANGE`),
    ``chains`` (1: independent chains per mode from its base network, each keeping
    ``samples_per_mode / chains`` samples), ``noise_correction`` (true: subtract Chen et
    al.'s ``beta_hat`` estimated from the minibatch gradients) and ``noise_decay`` (0.99,
    the running estimate's weight of the past), ``preconditioner`` (``"none"``; ``"auto"``:
    ``"laplace"`` up to :data:`AUTO_FULL_LAPLACE_PARAMETERS` parameters, else ``"none"``;
    ``"laplace"`` runs each chain with a constant mass matrix, the base network's full
    Laplace precision, from its own draw of that Laplace approximation), ``whitened_lr``
    (1e-4, the preconditioned chain's step) and ``batch_size`` (512 with a
    preconditioner, else the recipe's). See :data:`SGHMC_LR` and
    :data:`SGHMC_WHITENED_LR`.
``bbb``
    ``preset`` (``"paper"``: SGD at the recipe's learning rate, the paper's Table 1, or
    ``"trained-variance"``: Adam for ``rho``, whose ``sigma`` then trains), ``optimizer``,
    ``lr``, ``rho_optimizer`` and ``rho_lr`` (:class:`train_zoo.methods.bbb.BBBTraining`),
    and the fields of
    :class:`train_zoo.methods.bbb.BBBOptions` (prior N(0, 0.1^2), rho init -7 / -6, 3 ELBO
    samples, ``kl_weight`` 1/N when unset); one line of help each in
    :data:`train_zoo.methods.bbb.OPTION_HELP`, from which its table is made. Their values
    are checked by :func:`train_zoo.methods.bbb.resolve_options`. The paper's training
    records only the latter, as collections made before the others existed.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from posteriorzoo.errors import InvalidOptionError, UnknownNameError
from posteriorzoo.options import (
    check_bool,
    check_integer,
    check_name,
    check_number,
    show,
)
from train_zoo.recipes import MAX_BATCH_SIZE, MAX_EPOCHS, Recipe

METHODS = ("de", "mc-dropout", "swag", "laplace", "sghmc", "bbb")

# The ranges of the numeric options (learning rates are any finite number > 0, as the
# recipe's: divergence is detected and reported).
#: SWAG's deviation columns: each is one more copy of the parameters in memory (ResNet-18:
#: 45 MB), and the paper uses 20.
MAX_SWAG_RANK = 100
#: SWAG's covariance multiplier: 1 is SWAG's own covariance (the paper draws with 0.1);
#: far above, draws leave the basin and overflow float32.
MAX_SWAG_SCALE = 100.0
#: SWAG's defaults for a phase of SWAG_REFERENCE_EPOCHS epochs: twice the paper's 60-epoch
#: recipe (train_zoo.methods.swag's LENGTH_FACTOR, RAMP_EPOCHS, ITERATES and RANK, kept
#: here as numbers so that reading a spec does not import torch; a test checks they agree).
SWAG_REFERENCE_EPOCHS = 120
SWAG_RAMP_EPOCHS, SWAG_ITERATES, SWAG_RANK, SWAG_SCALE = 10, 20, 20, 0.1
#: A prior precision delta (Laplace, SGHMC): the prior N(0, 1/delta) gives the directions
#: the data do not constrain a standard deviation of delta^-1/2, 10^4 at the lower bound
#: (below, Laplace's G + delta I stops being positive definite in float64); above the
#: upper bound the prior alone fixes every weight to within 1e-4 of zero.
PRIOR_PRECISION_RANGE = (1e-8, 1e8)
#: SGHMC chains per mode: each repeats the whole chain (burn-in included).
MAX_CHAINS = 64
#: SGHMC's defaults, measured on OptuNet / Fashion-MNIST from a trained network (batch 64,
#: N = 60,000): at lr 2e-4 per example (eta = lr / N) and friction 0.1 the corrected chain's
#: kinetic temperature is 1.07 against the exact chain's 1.05, with beta_hat capped on 4%
#: of the coordinates; at 4e-4 it is 1.21 (28% capped), at the former 4e-3 without the
#: correction 7.6. Thinning and burn-in are long because such a small step moves slowly.
SGHMC_LR, SGHMC_BURN_IN, SGHMC_THIN = 2e-4, 20_000, 4_000
#: A preconditioned chain's defaults (``preconditioner = "laplace"``), measured on OptuNet /
#: Fashion-MNIST: in whitened coordinates the minibatch gradient noise has eigenvalues up
#: to about 24,000 at batch 64 (median 865), so Chen et al.'s correction holds in every
#: direction only while whitened_lr * V / 2 < alpha; batch 512 divides V by 8.
SGHMC_WHITENED_LR, SGHMC_WHITENED_BATCH = 1e-4, 512
SGHMC_PRECONDITIONERS = ("auto", "laplace", "none")
#: SGHMC steps (burn-in, thinning): time, one gradient step each.
MAX_SGHMC_STEPS = 100_000_000

#: Laplace's ``structure = "auto"`` takes the full GGN up to this many parameters and
#: last-layer KFAC above. The full GGN is a dense D x D float64 matrix (5,000: 200 MB; the
#: method's hard limit of 20,000, train_zoo.methods.laplace.MAX_FULL_PARAMETERS, is 3.2 GB)
#: built from N x (K - 1) Jacobian rows, N (K - 1) D^2 multiply-adds, so its time grows as
#: D^2: on Fashion-MNIST, one torch thread of these CPUs, about 24 s for OptuNet's 392
#: parameters and 27 min for an MLP 784-6-10 of 4,780 (``posteriorzoo train --dry-run``'s
#: measured estimate), 7 h at the hard limit. OptuNet and its v1 (355) are far below,
#: ResNets (millions) and an MNIST MLP of width 32 (25,450) above.
AUTO_FULL_LAPLACE_PARAMETERS = 5_000
LAPLACE_STRUCTURES = ("auto", "full", "last-layer-kfac")


# ---------------------------------------------------------------- the declared records
@dataclass(frozen=True)
class Context:
    """What a default or a check may depend on: the spec's architecture, model options,
    output count and recipe, and the options of the method resolved before this one (in
    table order)."""

    method: str
    architecture: str
    recipe: Recipe
    model_options: Mapping[str, Any] = field(default_factory=dict)
    num_classes: int | None = None
    resolved: dict[str, Any] = field(default_factory=dict)

    def parameter_count(self) -> int:
        """Trainable parameters of the spec's model (built on the meta device)."""
        from posteriorzoo.models import parameter_count

        return parameter_count(self.architecture, self.num_classes, **self.model_options)


@dataclass(frozen=True)
class Resolved:
    """A value with where it came from: ``source`` is ``"given"``, ``"default"`` or
    ``"derived from ..."``; ``note`` is one line saying why the value differs from the
    option's usual default (None when it does not)."""

    value: Any
    source: str = "default"
    note: str | None = None


#: ``check(what, value, context)``: the value checked (or a :class:`Resolved`, when the
#: check completes it, as Laplace's ``structure = "auto"``); raises InvalidOptionError.
Check = Callable[[str, Any, Context], Any]
#: ``default(context)``: the value when the spec does not give one.
DefaultRule = Callable[[Context], Resolved]


@dataclass(frozen=True)
class MethodOption:
    """One option of a method: its name, its check, its default and one line of help.

    ``default_text`` is the default as the listing shows it (a rule, where the default
    depends on the recipe or the model).
    """

    name: str
    check: Check
    default: DefaultRule
    default_text: str
    help: str
    #: Whether a collection records the resolved value (None: always). An option added
    #: after collections were made is recorded only where it shapes the weights, so their
    #: specs still resolve to the recipe they record and can be resumed.
    recorded: Callable[[Context], bool] | None = None


def _constant(value: Any) -> DefaultRule:
    return lambda context: Resolved(value)


def _with_context(check: Callable[..., Any], *args: Any, **kwargs: Any) -> Check:
    """A check of :mod:`posteriorzoo.options` with fixed bounds, as a :data:`Check`."""
    return lambda what, value, context: check(what, value, *args, **kwargs)


def scaled_default(usual: int, epochs: int, reference: int, minimum: int) -> int:
    """``usual`` scaled to a phase of ``epochs`` instead of ``reference`` epochs, rounded,
    at least ``minimum`` and at most ``usual`` (a longer phase keeps the usual value)."""
    return min(usual, max(minimum, round(usual * epochs / reference)))


# ---------------------------------------------------------------- mc-dropout
def _dropout_p(what: str, value: Any, context: Context) -> Any:
    check_number(what, value, 0)
    if value >= 1:
        raise InvalidOptionError(f"{what} must be below 1, not {show(value)}")
    return value


def _dropout_default(context: Context) -> Resolved:
    resnet = context.architecture.startswith("resnet")
    return Resolved(0.5 if resnet else 0.2, "derived from the architecture (ResNets 0.5, "
                                            "others 0.2)")


# ---------------------------------------------------------------- swag
def _swag_epochs_default(context: Context) -> Resolved:
    epochs = context.recipe.epochs
    value = 2 * epochs
    usual = SWAG_REFERENCE_EPOCHS
    note = (None if value == usual else
            f"swag: epochs {value} (derived: twice the recipe's {epochs} epochs; "
            f"{usual} at 60 epochs)")
    return Resolved(value, f"derived from the recipe (twice its {epochs} epochs)", note)


def _scaled_swag(name: str, usual: int, minimum: int) -> DefaultRule:
    """A SWAG default that scales with the phase's epochs (:func:`scaled_default`); the
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


def _swag_rank_default(context: Context) -> Resolved:
    iterates = context.resolved["iterates"]
    if iterates >= SWAG_RANK:
        return Resolved(SWAG_RANK)
    return Resolved(iterates, f"derived from iterates={iterates}",
                    f"swag: rank {iterates} (derived from iterates={iterates}: one deviation "
                    f"column per iterate; default {SWAG_RANK} with {SWAG_ITERATES} iterates)")


def _swag_ramp(what: str, value: Any, context: Context) -> Any:
    return check_integer(what, value, 0, context.resolved["epochs"])


def _swag_collect_from(what: str, value: Any, context: Context) -> Any:
    return check_integer(what, value, 0, context.resolved["epochs"] - 1)


def _swag_iterates(what: str, value: Any, context: Context) -> Any:
    check_integer(what, value, 2, MAX_EPOCHS)
    window = context.resolved["epochs"] - context.resolved["collect_from"]
    if value > window:
        raise InvalidOptionError(
            f"swag option 'iterates' ({value}) exceeds the {window} epochs from "
            "'collect_from' to 'epochs'")
    return int(value)


# ---------------------------------------------------------------- laplace
def _laplace_auto(context: Context) -> Resolved:
    count = context.parameter_count()
    bound = AUTO_FULL_LAPLACE_PARAMETERS
    if count <= bound:
        return Resolved("full", f"auto: {context.architecture} has {count:,} parameters, "
                                f"at most {bound:,}")
    return Resolved("last-layer-kfac",
                    f"auto: {context.architecture} has {count:,} parameters, above {bound:,}",
                    f"laplace: structure last-layer-kfac (auto: {context.architecture} has "
                    f"{count:,} parameters, above the {bound:,} up to which the full GGN "
                    "is used)")


def _laplace_structure(what: str, value: Any, context: Context) -> Any:
    check_name(what, value, LAPLACE_STRUCTURES)
    if value == "auto":
        return _laplace_auto(context)
    if value == "full":
        _check_dense(what, value, context, "a dense GGN", "'last-layer-kfac' or 'auto'")
    return value


def _check_dense(what: str, value: str, context: Context, matrix: str, instead: str) -> None:
    """Refuse a dense D x D matrix of the parameters past the full Laplace's limit."""
    from train_zoo.methods.laplace import MAX_FULL_PARAMETERS

    count = context.parameter_count()
    if count > MAX_FULL_PARAMETERS:
        raise InvalidOptionError(
            f"{what} is {value!r}, but {context.architecture} has {count:,} parameters: "
            f"{matrix} is limited to {MAX_FULL_PARAMETERS:,} (use {instead})")


def _prior(choices: tuple[str, ...]) -> Check:
    def check(what: str, value: Any, context: Context) -> Any:
        if isinstance(value, str):
            return check_name(what, value, choices)
        low, high = PRIOR_PRECISION_RANGE
        return check_number(what, value, low, maximum=high)
    return check


# ---------------------------------------------------------------- sghmc
def _sghmc_alpha(what: str, value: Any, context: Context) -> Any:
    check_number(what, value, 0, strict=True)
    if value > 1:
        raise InvalidOptionError(f"{what} must be at most 1, not {show(value)}")
    return value


def _sghmc_preconditioner(what: str, value: Any, context: Context) -> Any:
    check_name(what, value, SGHMC_PRECONDITIONERS)
    if value == "auto":
        return _sghmc_preconditioner_auto(context)
    if value == "laplace":
        _check_dense(what, value, context, "a dense mass matrix", "'none'")
    return value


def _sghmc_preconditioner_auto(context: Context) -> Resolved:
    count = context.parameter_count()
    if count <= AUTO_FULL_LAPLACE_PARAMETERS:
        return Resolved("laplace", f"derived from the model ({count:,} parameters <= "
                                   f"{AUTO_FULL_LAPLACE_PARAMETERS:,})")
    return Resolved("none", f"derived from the model ({count:,} parameters > "
                            f"{AUTO_FULL_LAPLACE_PARAMETERS:,})",
                    note=f"sghmc: preconditioner none (the model's {count:,} parameters are "
                         f"too many for a dense mass matrix)")


def _sghmc_batch_size(what: str, value: Any, context: Context) -> Any:
    return check_integer(what, value, 1, MAX_BATCH_SIZE)


def _sghmc_batch_size_default(context: Context) -> Resolved:
    # The preconditioner's value is resolved before this one (table order).
    if context.resolved.get("preconditioner") == "laplace":
        return Resolved(SGHMC_WHITENED_BATCH, "default of a preconditioned chain")
    return Resolved(context.recipe.batch_size, "derived from the recipe (its batch_size)")


def _recipe_lr(context: Context) -> Resolved:
    return Resolved(context.recipe.lr, "derived from the recipe (its lr)")


_LOW, _HIGH = PRIOR_PRECISION_RANGE
_TABLES: dict[str, tuple[MethodOption, ...]] = {
    "de": (),
    "mc-dropout": (
        MethodOption("p", _dropout_p, _dropout_default, "0.5 for ResNets, else 0.2",
                     "dropout probability before the last layer while the base network "
                     "trains, in [0, 1)"),
    ),
    "swag": (
        MethodOption("lr", _with_context(check_number, 0, strict=True), _recipe_lr,
                     "the recipe's lr", "the high learning rate of the SWAG phase, > 0"),
        MethodOption("epochs", _with_context(check_integer, 1, MAX_EPOCHS),
                     _swag_epochs_default, "twice the recipe's epochs: 120 at 60",
                     f"length of the SWAG phase in epochs, 1 to {MAX_EPOCHS:,}"),
        MethodOption("ramp_epochs", _swag_ramp,
                     _scaled_swag("ramp_epochs", SWAG_RAMP_EPOCHS, 1),
                     f"{SWAG_RAMP_EPOCHS} at {SWAG_REFERENCE_EPOCHS} epochs, fewer in "
                     "proportion below, at least 1",
                     "epochs of the linear ramp to lr, 0 to epochs"),
        MethodOption("collect_from", _swag_collect_from, _constant(0), "0",
                     "first epoch of the window whose iterates are collected, below epochs"),
        MethodOption("iterates", _swag_iterates,
                     _scaled_swag("iterates", SWAG_ITERATES, 2),
                     f"{SWAG_ITERATES} at {SWAG_REFERENCE_EPOCHS} epochs, fewer in "
                     "proportion below: at least 2, at most the window's epochs",
                     "iterates collected at equal intervals of the window, 2 to its "
                     "epochs"),
        MethodOption("rank", _with_context(check_integer, 1, MAX_SWAG_RANK),
                     _swag_rank_default, f"{SWAG_RANK}, at most iterates",
                     f"deviation columns of the low-rank covariance, 1 to {MAX_SWAG_RANK}"),
        MethodOption("scale", _with_context(check_number, 0, maximum=MAX_SWAG_SCALE),
                     _constant(SWAG_SCALE), f"{SWAG_SCALE:g}",
                     f"multiplier of the covariance of a draw, 0 to {MAX_SWAG_SCALE:g}"),
    ),
    "laplace": (
        MethodOption("structure", _laplace_structure, _laplace_auto, "auto",
                     "auto (full up to "
                     f"{AUTO_FULL_LAPLACE_PARAMETERS:,} parameters, else last-layer-kfac), "
                     "full (the GGN of every weight) or last-layer-kfac"),
        MethodOption("prior_precision", _prior(("marglik", "training")),
                     _constant("marglik"), "marglik",
                     "marglik (maximises the evidence), training (N x weight decay) or a "
                     f"number in [{_LOW:g}, {_HIGH:g}]"),
    ),
    "sghmc": (
        MethodOption("lr", _with_context(check_number, 0, strict=True), _constant(SGHMC_LR),
                     f"{SGHMC_LR:g}", "step size per example (the chain's is lr / N), > 0"),
        MethodOption("alpha", _sghmc_alpha, _constant(0.1), "0.1", "friction, in (0, 1]"),
        MethodOption("burn_in", _with_context(check_integer, 0, MAX_SGHMC_STEPS),
                     _constant(SGHMC_BURN_IN), f"{SGHMC_BURN_IN:,}",
                     "steps discarded at the start of each chain"),
        MethodOption("thin", _with_context(check_integer, 1, MAX_SGHMC_STEPS),
                     _constant(SGHMC_THIN), f"{SGHMC_THIN:,}", "steps between kept samples"),
        MethodOption("prior_precision", _prior(("training",)), _constant("training"),
                     "training", "training (N x weight decay) or a number in "
                                 f"[{_LOW:g}, {_HIGH:g}]"),
        MethodOption("chains", _with_context(check_integer, 1, MAX_CHAINS), _constant(1),
                     "1", f"independent chains per mode, 1 to {MAX_CHAINS}, each keeping "
                          "samples_per_mode / chains samples"),
        MethodOption("noise_correction", _with_context(check_bool), _constant(True), "true",
                     "subtract Chen et al.'s beta_hat estimated from the minibatch "
                     "gradients"),
        MethodOption("noise_decay",
                     _with_context(check_number, 0, strict=True, maximum=0.9999),
                     _constant(0.99), "0.99",
                     "weight of the past in the running noise estimate, in (0, 0.9999]"),
        MethodOption("preconditioner", _sghmc_preconditioner, _constant("none"),
                     "none", "none, auto (laplace up to "
                     f"{AUTO_FULL_LAPLACE_PARAMETERS:,} parameters, else none), laplace (a "
                     "constant mass matrix: the base network's full Laplace precision; "
                     "each chain starts from a draw of that Laplace approximation)",
                     recorded=lambda context: context.resolved["preconditioner"] != "none"),
        MethodOption("whitened_lr", _with_context(check_number, 0, strict=True, maximum=1),
                     _constant(SGHMC_WHITENED_LR), f"{SGHMC_WHITENED_LR:g}",
                     "step size of a preconditioned chain (in whitened coordinates, where "
                     "the posterior's curvature is about 1), in (0, 1]; lr is unused there",
                     recorded=lambda context: context.resolved["preconditioner"] != "none"),
        MethodOption("batch_size", _sghmc_batch_size, _sghmc_batch_size_default,
                     f"{SGHMC_WHITENED_BATCH} with a preconditioner, else the recipe's",
                     "minibatch size of the chains (the gradient noise falls as 1 / "
                     "batch_size), 1 to the training set",
                     recorded=lambda context: (context.resolved["batch_size"]
                                               != context.recipe.batch_size)),
    ),
}


# ---------------------------------------------------------------- bbb
def _bbb_table() -> tuple[MethodOption, ...]:
    """BBB's records, made from :data:`train_zoo.methods.bbb.OPTION_HELP` and the
    defaults of :class:`~train_zoo.methods.bbb.BBBOptions`; their values are checked
    together by :func:`train_zoo.methods.bbb.resolve_options` (a preset supplies several)."""
    from dataclasses import fields

    from train_zoo.methods import bbb

    defaults = {f.name: f.default for f in fields(bbb.BBBOptions)}
    defaults.update(preset="paper", kl_weight="1 / number of training examples")
    records = []
    for name, text in bbb.OPTION_HELP.items():
        match = re.search(r"\s*\(default:? ([^()]*)\)$", text)
        default_text = str(defaults.get(name, match.group(1) if match else ""))
        help_text = text[:match.start()] if match else text
        records.append(MethodOption(name, lambda what, value, context: value,
                                    _constant(defaults.get(name)), default_text, help_text))
    return tuple(records)


def option_table(method: str) -> tuple[MethodOption, ...]:
    """The declared options of ``method``, in the order they are resolved and listed.

    Raises
    ------
    UnknownNameError
        ``method`` is not one of :data:`METHODS`.
    """
    if not isinstance(method, str) or method not in METHODS:
        raise UnknownNameError(f"unknown method {show(method)}; the trainer implements "
                               f"{', '.join(METHODS)}")
    if method == "bbb" and "bbb" not in _TABLES:  # made on first use: it imports torch
        _TABLES["bbb"] = _bbb_table()
    return _TABLES[method]


@dataclass(frozen=True)
class ResolvedOptions:
    """A method's options after :func:`explain_method_options`.

    Attributes
    ----------
    values : dict
        Every option, defaults filled in (what a collection records).
    sources : dict
        Per option: ``"given"``, ``"default"``, or ``"derived from ..."`` (and for BBB
        ``"from the preset ..."``).
    notes : tuple of str
        One line per default that differs from its usual value because of the recipe's
        length or the model's size, e.g. ``swag: iterates 2 (derived from epochs=4;
        default 20 at 60 epochs)``.
    """

    values: dict[str, Any]
    sources: dict[str, str]
    notes: tuple[str, ...]


def explain_method_options(method: str, options: Mapping[str, Any], architecture: str,
                           recipe: Recipe, *, model_options: Mapping[str, Any] | None = None,
                           num_classes: int | None = None) -> ResolvedOptions:
    """Every option of ``method`` for this model and recipe, with where each came from.

    Raises
    ------
    UnknownNameError
        An option ``method`` does not have (the message lists those it has).
    InvalidOptionError
        A value of the wrong type or out of range (one line naming the option).
    """
    table = option_table(method)
    names = [option.name for option in table]
    unknown = sorted(set(options) - set(names))
    if unknown:
        raise UnknownNameError(f"unknown {method} option(s) {unknown}; options: "
                               f"{', '.join(names) or 'none'}")
    if method == "bbb":
        return _explain_bbb(options, recipe)
    context = Context(method, architecture, recipe, dict(model_options or {}), num_classes)
    sources: dict[str, str] = {}
    notes: list[str] = []
    for option in table:
        given = option.name in options
        result = Resolved(options[option.name], "given") if given else option.default(context)
        checked = option.check(f"{method} option {option.name!r}", result.value, context)
        if isinstance(checked, Resolved):  # the check completed it ("auto")
            source = f"given ({checked.source})" if given else checked.source
            result = Resolved(checked.value, source, checked.note)
        else:
            result = Resolved(checked, result.source, result.note)
        context.resolved[option.name] = result.value
        sources[option.name] = result.source
        if result.note:
            notes.append(result.note)
    values = {option.name: context.resolved[option.name] for option in table
              if option.recorded is None or option.recorded(context)}
    return ResolvedOptions(values, {name: sources[name] for name in values}, tuple(notes))


def _explain_bbb(options: Mapping[str, Any], recipe: Recipe) -> ResolvedOptions:
    from train_zoo.methods.bbb import PRESETS, resolve_options

    try:
        values = resolve_options(dict(options), recipe.lr)
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
        elif name == "lr" and value == recipe.lr:
            sources[name] = "derived from the recipe (its lr)"
        elif name == "rho_optimizer" and value == values.get("optimizer"):
            sources[name] = "derived from optimizer"
        elif name == "rho_lr" and value == values.get("lr"):
            sources[name] = "derived from lr"
        else:
            sources[name] = "default"
    return ResolvedOptions(values, sources, ())


def resolve_method_options(method: str, options: Mapping[str, Any], architecture: str,
                           recipe: Recipe, *, model_options: Mapping[str, Any] | None = None,
                           num_classes: int | None = None) -> dict[str, Any]:
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
                                  model_options=model_options, num_classes=num_classes).values


def describe_options(method: str | None = None) -> list[dict[str, str]]:
    """The listing of ``posteriorzoo train --list-options``: one row per option of
    ``method`` (every method when None) with ``method``, ``name``, ``default`` and
    ``help``, read from the same table as the validation."""
    methods = METHODS if method is None else (method,)
    return [{"method": name, "option": option.name, "default": option.default_text,
             "help": option.help}
            for name in methods for option in option_table(name)]


def resolve_kl_weight(options: Mapping[str, Any], num_data: int) -> dict[str, Any]:
    """BBB's options with ``kl_weight`` set to ``1 / num_data`` when it was left unset."""
    if options.get("kl_weight") is not None:
        return dict(options)
    check_integer("the training-set size", num_data, 1)
    return {**options, "kl_weight": 1.0 / num_data}
