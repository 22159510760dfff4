"""The options of each method in a spec's ``[method_options]`` table, checked and completed.

:func:`resolve_method_options` returns every option with its default filled in, so a
collection records exactly what produced it. Defaults follow PAPER_NOTES and the method
modules; each number has a range, with its reason at the constants below:

``de``
    No options: a mode is one independently trained network, stored as it is.
``mc-dropout``
    ``p``: dropout probability before the last layer during training (ResNets 0.5,
    other architectures 0.2).
``swag``
    ``lr`` (the recipe's initial lr), ``epochs`` (twice the recipe's; 1 to the recipe's
    ``MAX_EPOCHS``), ``ramp_epochs`` (10, at most ``epochs``), ``iterates`` (20; 2 to
    ``epochs - collect_from``), ``rank`` (20; 1 to :data:`MAX_SWAG_RANK`), ``scale`` (0.1;
    0 to :data:`MAX_SWAG_SCALE`), ``collect_from`` (0: the first epoch of the window whose
    iterates are collected; below ``epochs``).
``laplace``
    ``structure`` (``"full"`` for OptuNet and MLPs, ``"last-layer-kfac"`` otherwise) and
    ``prior_precision`` (``"marglik"``, ``"training"`` for N x weight decay, or a number
    in :data:`PRIOR_PRECISION_RANGE`).
``sghmc``
    ``lr`` (2e-4, per example: the step size on the full-data log posterior is
    ``lr / N``), ``alpha`` (friction 0.1, in (0, 1]), ``burn_in`` (10,000 steps) and
    ``thin`` (2,000 steps), each at most :data:`MAX_SGHMC_STEPS`, ``prior_precision``
    (``"training"`` for N x weight decay, or a number in :data:`PRIOR_PRECISION_RANGE`),
    ``chains`` (1: independent chains per mode from its base network, each keeping
    ``samples_per_mode / chains`` samples), ``noise_correction`` (true: subtract Chen et
    al.'s ``beta_hat`` estimated from the minibatch gradients) and ``noise_decay`` (0.99,
    the running estimate's weight of the past). See :data:`SGHMC_LR`.
``bbb``
    ``preset`` (``"paper"``: SGD at the recipe's learning rate, the paper's Table 1, or
    ``"trained-variance"``: Adam for ``rho``, whose ``sigma`` then trains), ``optimizer``,
    ``lr``, ``rho_optimizer`` and ``rho_lr`` (:class:`train_zoo.methods.bbb.BBBTraining`),
    and the fields of
    :class:`train_zoo.methods.bbb.BBBOptions` (prior N(0, 0.1^2), rho init -7 / -6, 3 ELBO
    samples, ``kl_weight`` 1/N when unset); one line of help each in
    :data:`train_zoo.methods.bbb.OPTION_HELP`. The paper's training records only the
    latter, as collections made before the others existed
    (:func:`train_zoo.methods.bbb.resolve_options`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from posteriorzoo.errors import InvalidOptionError, UnknownNameError
from posteriorzoo.options import check_bool, check_integer, check_name, check_number, show
from train_zoo.recipes import MAX_EPOCHS, Recipe

METHODS = ("de", "mc-dropout", "swag", "laplace", "sghmc", "bbb")

# The ranges of the numeric options (learning rates are any finite number > 0, as the
# recipe's: divergence is detected and reported).
#: SWAG's deviation columns: each is one more copy of the parameters in memory (ResNet-18:
#: 45 MB), and the paper uses 20.
MAX_SWAG_RANK = 100
#: SWAG's covariance multiplier: 1 is SWAG's own covariance (the paper draws with 0.1);
#: far above, draws leave the basin and overflow float32.
MAX_SWAG_SCALE = 100.0
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
SGHMC_LR, SGHMC_BURN_IN, SGHMC_THIN = 2e-4, 10_000, 2_000
#: SGHMC steps (burn-in, thinning): time, one gradient step each.
MAX_SGHMC_STEPS = 100_000_000

#: Architectures whose every parameter fits a dense GGN (full Laplace).
FULL_LAPLACE_ARCHITECTURES = ("optunet", "optunet-v1", "mlp")
LAPLACE_STRUCTURES = ("full", "last-layer-kfac")


def _dropout(options: dict[str, Any], architecture: str, recipe: Recipe) -> dict[str, Any]:
    p = options.pop("p", 0.5 if architecture.startswith("resnet") else 0.2)
    check_number("mc-dropout option 'p'", p, 0)
    if p >= 1:
        raise InvalidOptionError(f"mc-dropout option 'p' must be below 1, not {show(p)}")
    return {"p": p}


def _swag(options: dict[str, Any], architecture: str, recipe: Recipe) -> dict[str, Any]:
    def option(name: str) -> str:
        return f"swag option {name!r}"

    epochs = check_integer(option("epochs"),
                           options.pop("epochs", 2 * recipe.epochs), 1,
                           MAX_EPOCHS)
    resolved = {
        "lr": check_number(option("lr"), options.pop("lr", recipe.lr), 0, strict=True),
        "epochs": epochs,
        "ramp_epochs": check_integer(option("ramp_epochs"),
                                     options.pop("ramp_epochs", min(10, epochs)), 0, epochs),
        "iterates": check_integer(option("iterates"), options.pop("iterates", 20), 2,
                                  MAX_EPOCHS),
        "rank": check_integer(option("rank"), options.pop("rank", 20), 1, MAX_SWAG_RANK),
        "scale": check_number(option("scale"), options.pop("scale", 0.1), 0,
                              maximum=MAX_SWAG_SCALE),
        "collect_from": check_integer(option("collect_from"),
                                      options.pop("collect_from", 0), 0, epochs - 1),
    }
    if resolved["iterates"] > epochs - resolved["collect_from"]:
        raise InvalidOptionError(
            f"swag option 'iterates' ({resolved['iterates']}) exceeds the "
            f"{epochs - resolved['collect_from']} epochs from 'collect_from' to 'epochs'")
    return resolved


def _prior(method: str, value: object, choices: tuple[str, ...]) -> object:
    if isinstance(value, str):
        return check_name(f"{method} option 'prior_precision'", value, choices)
    low, high = PRIOR_PRECISION_RANGE
    return check_number(f"{method} option 'prior_precision'", value, low, maximum=high)


def _laplace(options: dict[str, Any], architecture: str, recipe: Recipe) -> dict[str, Any]:
    default = "full" if architecture in FULL_LAPLACE_ARCHITECTURES else "last-layer-kfac"
    return {
        "structure": check_name("laplace option 'structure'",
                                options.pop("structure", default), LAPLACE_STRUCTURES),
        "prior_precision": _prior("laplace", options.pop("prior_precision", "marglik"),
                                  ("marglik", "training")),
    }


def _sghmc(options: dict[str, Any], architecture: str, recipe: Recipe) -> dict[str, Any]:
    def option(name: str) -> str:
        return f"sghmc option {name!r}"

    alpha = check_number(option("alpha"), options.pop("alpha", 0.1), 0, strict=True)
    if alpha > 1:
        raise InvalidOptionError(f"sghmc option 'alpha' must be at most 1, not {show(alpha)}")
    return {
        "lr": check_number(option("lr"), options.pop("lr", SGHMC_LR), 0, strict=True),
        "alpha": alpha,
        "burn_in": check_integer(option("burn_in"), options.pop("burn_in", SGHMC_BURN_IN), 0,
                                 MAX_SGHMC_STEPS),
        "thin": check_integer(option("thin"), options.pop("thin", SGHMC_THIN), 1,
                              MAX_SGHMC_STEPS),
        "prior_precision": _prior("sghmc", options.pop("prior_precision", "training"),
                                  ("training",)),
        "chains": check_integer(option("chains"), options.pop("chains", 1), 1, MAX_CHAINS),
        "noise_correction": check_bool(option("noise_correction"),
                                       options.pop("noise_correction", True)),
        "noise_decay": check_number(option("noise_decay"), options.pop("noise_decay", 0.99),
                                    0, strict=True, maximum=0.9999),
    }


def _bbb(options: dict[str, Any], architecture: str, recipe: Recipe) -> dict[str, Any]:
    from train_zoo.methods.bbb import resolve_options

    given = dict(options)
    options.clear()  # resolve_options names every unknown option with the full list
    try:
        return resolve_options(given, recipe.lr)
    except InvalidOptionError as error:
        raise InvalidOptionError(f"bbb option {error}") from None


_RESOLVERS = {"mc-dropout": _dropout, "swag": _swag, "laplace": _laplace, "sghmc": _sghmc,
              "bbb": _bbb}


def resolve_method_options(method: str, options: Mapping[str, Any], architecture: str,
                           recipe: Recipe) -> dict[str, Any]:
    """Every option of ``method`` for this architecture and recipe, defaults filled in.

    Raises
    ------
    UnknownNameError
        An option ``method`` does not have.
    InvalidOptionError
        A value of the wrong type or out of range (one line naming the option).
    """
    remaining = dict(options)
    resolved = _RESOLVERS[method](remaining, architecture, recipe) if method in _RESOLVERS \
        else {}
    if remaining:
        known = sorted(resolved) or ["none"]
        raise UnknownNameError(f"unknown {method} option(s) {sorted(remaining)}; options: "
                               f"{', '.join(known)}")
    return resolved


def resolve_kl_weight(options: Mapping[str, Any], num_data: int) -> dict[str, Any]:
    """BBB's options with ``kl_weight`` set to ``1 / num_data`` when it was left unset."""
    if options.get("kl_weight") is not None:
        return dict(options)
    check_integer("the training-set size", num_data, 1)
    return {**options, "kl_weight": 1.0 / num_data}
