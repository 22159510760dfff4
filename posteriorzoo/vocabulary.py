"""The project's words, as data: every method, every named choice, one word per concept.

An import-light module at the bottom of the package (the standard library only), so that
``--help``, labels and styles read it without importing torch or numpy, and the library's
checks, the command line, ``diagnose``, the report and the figures read the same source:

- :data:`METHODS`: each posterior approximation as a :class:`MethodInfo`: its name (as
  specs, files and the command line spell it), display label, :data:`FAMILIES` entry,
  what it records while training, its figure colour, and where the trainer's object
  lives. A new method is one entry here (its registry line) plus its module.
- :data:`SYMMETRIES`: the one concept "are the weight-space symmetries kept or removed"
  with its one word per setting (``keep`` / ``remove``) and what each is called where a
  word would not read (the MMD table's ``MMD`` / ``NS-MMD``, a collection ``raw`` /
  ``canonical``).
- The named choices of the options (:data:`PERMUTATION_KEYS`, :data:`SCALINGS`, ...):
  defined here once, read by the command line's ``choices`` and by the checks.
- Each method's options (``MethodInfo.options``): :class:`OptionInfo` records whose
  constraints are data (:class:`Interval`, :class:`Choices`, :data:`BOOLEAN`,
  :data:`NAMES`, in the spirit of scikit-learn's ``_param_validation``), with their
  bounds and literal defaults declared once here as constants. The library's check
  (``posteriorzoo.options.check_constraints``), the trainer's option records
  (``train_zoo.methods.base.declared_options``), ``posteriorzoo train --list-options``
  (:func:`describe_options`, without torch) and the generated tests read them.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = [
    "ADAPTED_BATCH", "ADAPTED_BURN_IN", "ADAPTED_CHAINS", "ADAPTED_THIN", "ADAPT_ALPHA",
    "ADAPT_BATCH", "ADAPT_LR", "ADAPT_ROUNDS", "ADAPT_ROUND_STEPS", "ADAPT_STEPS",
    "ADAPT_THIN", "AUTO_FULL_LAPLACE_PARAMETERS", "BBB_ADAM_LR", "BBB_MEAN_INITS",
    "BBB_OPTIMIZERS", "BBB_PRESETS", "BOOLEAN", "CSGHMC_ALPHA", "CSGMCMC_CYCLES",
    "CSGMCMC_KEEP_FRACTION", "CSGMCMC_SAMPLING_FRACTION", "DERIVED", "EMP_COMPONENTS",
    "EMP_INIT_NOISE", "EMP_LR", "EMP_PATCHES", "EMP_SAMPLES", "EMP_WEIGHT_DECAY",
    "FRACTION", "HMC_BURN_IN", "HMC_MAP_ITERATIONS", "HMC_MASSES", "HMC_MAX_LEAPFROG_STEPS",
    "HMC_STARTS",
    "HMC_TARGET_ACCEPT", "HMC_THIN",
    "IVON_BETA1", "IVON_BETA2", "IVON_HESS_INIT", "IVON_LR",
    "LAPLACE_STRUCTURES", "MAX_ADAPT_ROUNDS", "MAX_BATCH_SIZE", "MAX_CHAINS", "MAX_CYCLES",
    "MAX_EMP_COMPONENTS", "MAX_EMP_SAMPLES", "MAX_EPOCHS", "MAX_NOISE_DECAY",
    "MAX_SGHMC_STEPS", "MAX_SWAG_RANK", "MAX_SWAG_SCALE", "NAMES", "NON_NEGATIVE",
    "POSITIVE", "PRIOR_PRECISION_RANGE", "RANK1_COMPONENT_KL", "RANK1_DISTRIBUTIONS",
    "RANK1_INIT_STD", "ROUND_DRAWS", "SETTLE_STEPS", "SGHMC_ALPHA", "SGHMC_BURN_IN",
    "SGHMC_LR", "SGHMC_MINIBATCHES", "SGHMC_NOISE_DECAY", "SGHMC_PRECONDITIONERS",
    "SGHMC_THIN", "SGHMC_WHITENED_BATCH", "SGHMC_WHITENED_LR", "STRUCTURES",
    "SVGD_BANDWIDTH", "SWAG_ITERATES", "SWAG_LENGTH_FACTOR", "SWAG_RAMP_EPOCHS",
    "SWAG_RANK", "SWAG_REFERENCE_EPOCHS", "SWAG_SCALE", "Boolean", "Choices", "Constraint",
    "Interval", "Names", "OptionInfo", "describe_options", "options_of",
    "BACKENDS", "DISTANCE_PRECISIONS", "ENGINES", "FAMILIES", "KERNEL_STATISTICS",
    "LAYER_GROUPS", "METHODS", "MINMASS_SOLVERS", "OOD_SCORES", "PERMUTATION_KEYS",
    "POSTERIOR_GROUPS", "RECORDS",
    "SCALINGS", "SORT_KEYS", "STORAGE_DTYPES", "SYMMETRIES", "SYMMETRY_CHOICES", "MethodInfo",
    "SymmetrySetting",
    "method_info", "methods_in",
]

#: What a method's samples are, which decides what ``diagnose`` computes on them, how the
#: report groups them and which statistics a new method gets without further code:
FAMILIES: dict[str, str] = {
    "ensemble": "independently trained networks (no within-mode spread)",
    "chain": "Markov-chain draws: ESS, R-hat, autocorrelation and drift per chain",
    "variational": "draws of a learned distribution: its scales must move from their start",
    "gaussian": "draws of a Gaussian fitted around a trained network (Laplace, SWAG)",
    "patch": "draws of a small stochastic part patched into a trained network",
}

#: What a method may record while training (``Zoo.training_records``), each read by
#: ``diagnose``: ``chains`` (per chain: SG-MCMC's kinetic temperature; a Metropolis
#: chain's acceptance rate, E-BFMI, step size and leapfrog steps), ``sigma`` (the learned
#: standard deviations and ELBO terms), ``scales`` (per factor: the median scale at the
#: start and the end), ``moments`` (SWAG's rank and iterates), ``curvature`` (Laplace's
#: structure, prior precision and evidence), ``patch`` (the patched part's training).
RECORDS = ("chains", "sigma", "scales", "moments", "curvature", "patch")


# ------------------------------------------------------------ option constraints
@dataclass(frozen=True)
class Interval:
    """Numbers from ``low`` to ``high`` (sklearn's ``Interval``): ``kind`` is
    ``"integer"`` (never a bool) or ``"real"`` (finite); ``closed`` says which ends belong
    (``"both"``, ``"left"``, ``"right"``, ``"neither"``). ``high`` None: no upper bound.
    A bound may name an option resolved before this one (``"epochs"``): the check reads
    its value, so "0 to epochs" is data too."""

    kind: str
    low: float | str
    high: float | str | None = None
    closed: str = "both"

    def __post_init__(self) -> None:
        if self.kind not in ("integer", "real"):
            raise ValueError(f"unknown interval kind {self.kind!r}")
        if self.closed not in ("both", "left", "right", "neither"):
            raise ValueError(f"unknown interval closure {self.closed!r}")

    @property
    def closed_low(self) -> bool:
        return self.closed in ("both", "left")

    @property
    def closed_high(self) -> bool:
        return self.closed in ("both", "right")

    def bounds(self, resolved: Mapping[str, object] | None = None
               ) -> tuple[float, float | None]:
        """``(low, high)`` with a named bound replaced by that option's resolved value
        (KeyError when it is not resolved yet: the options are declared out of order)."""
        def value(bound: float | str | None) -> float | None:
            if isinstance(bound, str):
                found = (resolved or {})[bound]
                if not isinstance(found, int | float):
                    raise TypeError(f"bound {bound!r} is {found!r}, not a number")
                return found
            return bound

        low = value(self.low)
        if low is None:  # the declared low is never None
            raise ValueError("an interval needs a lower bound")
        return low, value(self.high)

    def text(self) -> str:
        """The range as the listing shows it: ``1 to 100``, ``in (0, 1]``, ``> 0``."""
        def shown(bound: float | str) -> str:
            return bound if isinstance(bound, str) else f"{bound:,}" if isinstance(
                bound, int) else f"{bound:g}"

        if self.high is None:
            return f"{'>=' if self.closed_low else '>'} {shown(self.low)}"
        if self.kind == "integer" and self.closed == "both":
            return f"{shown(self.low)} to {shown(self.high)}"
        return (f"in {'[' if self.closed_low else '('}{shown(self.low)}, {shown(self.high)}"
                f"{']' if self.closed_high else ')'}")


@dataclass(frozen=True)
class Choices:
    """One of the named string ``values`` (sklearn's ``StrOptions``)."""

    values: tuple[str, ...]

    def text(self) -> str:
        return ", ".join(self.values)


@dataclass(frozen=True)
class Boolean:
    """``true`` or ``false`` (never 0 or 1)."""

    def text(self) -> str:
        return "true or false"


@dataclass(frozen=True)
class Names:
    """A non-empty list of distinct non-empty names (layers of a model)."""

    def text(self) -> str:
        return "a list of names"


#: The one :class:`Boolean` constraint.
BOOLEAN = Boolean()
#: The one :class:`Names` constraint.
NAMES = Names()
#: What an option's constraints may be; an option with several accepts a value that any
#: of them accepts (Laplace's ``prior_precision``: a word or a number).
Constraint = Interval | Choices | Boolean | Names


class _Derived:
    """The type of :data:`DERIVED`."""

    def __repr__(self) -> str:
        return "DERIVED"


#: An option's default that depends on the recipe, the model or another option: the
#: trainer's module gives the rule, the option's ``default_text`` says it in words.
DERIVED: Any = _Derived()


def _default_text(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)


@dataclass(frozen=True)
class OptionInfo:
    """One option of a method (a spec's ``[method_options]`` entry), as data.

    Attributes
    ----------
    name : str
        As a spec spells it.
    constraints : tuple of Constraint
        What a value must be: a value is accepted when one of them accepts it
        (``posteriorzoo.options.check_constraints``).
    default : object
        The literal default, None for "unset" (the trainer fills it in), or
        :data:`DERIVED` (the trainer's module has the rule; ``default_text`` says it).
    default_text : str
        The default as ``--list-options`` shows it (the literal's text when empty).
    help : str
        One line: what the option does.
    """

    name: str
    constraints: tuple[Constraint, ...]
    default: object
    default_text: str
    help: str

    def __post_init__(self) -> None:
        if not self.constraints:
            raise ValueError(f"option {self.name!r} has no constraint")
        if not self.default_text:
            if self.default is DERIVED or self.default is None:
                raise ValueError(f"option {self.name!r}: a derived or unset default needs "
                                 "its default_text")
            object.__setattr__(self, "default_text", _default_text(self.default))


def _option(name: str, constraints: Constraint | tuple[Constraint, ...], default: object,
            help: str, default_text: str = "") -> OptionInfo:
    return OptionInfo(name, constraints if isinstance(constraints, tuple) else (constraints,),
                      default, default_text, help)


def _integer(low: int | str, high: int | str | None = None, closed: str = "both") -> Interval:
    return Interval("integer", low, high, closed)


def _real(low: float, high: float | None = None, closed: str = "both") -> Interval:
    return Interval("real", low, high, closed)


#: A number that must be above 0, with no upper bound (learning rates, scales).
POSITIVE = _real(0, None, "neither")
#: A number that must be at least 0 (weight decays, spreads).
NON_NEGATIVE = _real(0)
#: A share of something: in (0, 1].
FRACTION = _real(0, 1, "right")

# ------------------------------------------------------------ shared bounds and defaults
#: Epochs (of a recipe, or a method's phase in epochs): time; the paper's longest recipe
#: has 200.
MAX_EPOCHS = 10_000
#: Examples per step: one batch's activations are held at once (65,536 CIFAR images are
#: already 0.8 GB of pixels before the first layer).
MAX_BATCH_SIZE = 65_536
#: A prior precision delta (Laplace, SGHMC, cSG-MCMC): the prior N(0, 1/delta) gives the
#: directions the data do not constrain a standard deviation of delta^-1/2, 10^4 at the
#: lower bound (below, Laplace's G + delta I stops being positive definite in float64);
#: above the upper bound the prior alone fixes every weight to within 1e-4 of zero.
PRIOR_PRECISION_RANGE = (1e-8, 1e8)
#: ``auto`` (Laplace's structure, SGHMC's preconditioner) takes a dense D x D matrix up to
#: this many parameters (the reasons at ``train_zoo.methods.laplace``).
AUTO_FULL_LAPLACE_PARAMETERS = 5_000
#: Laplace's curvature structures (``train_zoo.methods.laplace.STRUCTURES``).
STRUCTURES = ("full", "kfac", "diag", "last-layer-kfac")
#: The values of Laplace's ``structure``.
LAPLACE_STRUCTURES = ("auto", *STRUCTURES)


def _prior_precision(*words: str) -> tuple[Constraint, ...]:
    low, high = PRIOR_PRECISION_RANGE
    return Choices(words), _real(low, high)


def _prior_precision_help(*words: str) -> str:
    low, high = PRIOR_PRECISION_RANGE
    meanings = {"marglik": "marglik (maximises the evidence)",
                "training": "training (N x weight decay)"}
    return (f"{', '.join(meanings[word] for word in words)} or a number in "
            f"[{low:g}, {high:g}]")


# ------------------------------------------------------------ mc-dropout
DROPOUT_OPTIONS = (
    _option("p", _real(0, 1, "left"), DERIVED,
            "dropout probability before the last layer while the base network trains, in "
            "[0, 1)", "0.5 for ResNets, else 0.2"),
)

# ------------------------------------------------------------ swag
#: SWAG's defaults for a phase of SWAG_REFERENCE_EPOCHS epochs: the ramp to the high
#: learning rate (as ``torch.optim.swa_utils.SWALR``'s default ``anneal_epochs``; the
#: paper does not give one), the iterates collected (the paper's 20 models), the rank
#: (the paper's 20 deviation columns) and the sampling scale (the paper's 0.1).
SWAG_RAMP_EPOCHS, SWAG_ITERATES, SWAG_RANK, SWAG_SCALE = 10, 20, 20, 0.1
#: The SWAG phase lasts this many times the recipe's epochs ("twice the usual length").
SWAG_LENGTH_FACTOR = 2
#: The phase length the defaults above are for: twice the paper's 60-epoch recipe.
SWAG_REFERENCE_EPOCHS = SWAG_LENGTH_FACTOR * 60
#: SWAG's deviation columns: each is one more copy of the parameters in memory (ResNet-18:
#: 45 MB), and the paper uses 20.
MAX_SWAG_RANK = 100
#: SWAG's covariance multiplier: 1 is SWAG's own covariance (the paper draws with 0.1);
#: far above, draws leave the basin and overflow float32.
MAX_SWAG_SCALE = 100.0

SWAG_OPTIONS = (
    _option("lr", POSITIVE, DERIVED, "the high learning rate of the SWAG phase, > 0",
            "the recipe's lr"),
    _option("epochs", _integer(1, MAX_EPOCHS), DERIVED,
            f"length of the SWAG phase in epochs, 1 to {MAX_EPOCHS:,}",
            f"twice the recipe's epochs: {SWAG_REFERENCE_EPOCHS} at 60"),
    _option("ramp_epochs", _integer(0, "epochs"), DERIVED,
            "epochs of the linear ramp to lr, 0 to epochs",
            f"{SWAG_RAMP_EPOCHS} at {SWAG_REFERENCE_EPOCHS} epochs, fewer in proportion "
            "below, at least 1"),
    _option("collect_from", _integer(0, "epochs", "left"), 0,
            "first epoch of the window whose iterates are collected, below epochs"),
    _option("iterates", _integer(2, MAX_EPOCHS), DERIVED,
            "iterates collected at equal intervals of the window, 2 to its epochs",
            f"{SWAG_ITERATES} at {SWAG_REFERENCE_EPOCHS} epochs, fewer in proportion below: "
            "at least 2, at most the window's epochs"),
    _option("rank", _integer(1, MAX_SWAG_RANK), DERIVED,
            f"deviation columns of the low-rank covariance, 1 to {MAX_SWAG_RANK}",
            f"{SWAG_RANK}, at most iterates"),
    _option("scale", _real(0, MAX_SWAG_SCALE), SWAG_SCALE,
            f"multiplier of the covariance of a draw, 0 to {MAX_SWAG_SCALE:g}"),
)

# ------------------------------------------------------------ laplace
LAPLACE_OPTIONS = (
    _option("structure", Choices(LAPLACE_STRUCTURES), "auto",
            f"auto (full up to {AUTO_FULL_LAPLACE_PARAMETERS:,} parameters, else "
            "last-layer-kfac), full (the GGN of every weight), kfac (Kronecker-factored GGN "
            "of every Linear and Conv2d layer), diag (the GGN's diagonal) or last-layer-kfac"),
    _option("prior_precision", _prior_precision("marglik", "training"), "marglik",
            _prior_precision_help("marglik", "training")),
)

# ------------------------------------------------------------ sghmc, sgld
#: SGHMC's defaults, measured on OptuNet / Fashion-MNIST from a trained network (batch 64,
#: N = 60,000): at lr 2e-4 per example (eta = lr / N) and friction 0.1 the corrected chain's
#: kinetic temperature is 1.07 against the exact chain's 1.05, with beta_hat capped on 4%
#: of the coordinates; at 4e-4 it is 1.21 (28% capped), at the former 4e-3 without the
#: correction 7.6. Thinning and burn-in are long because such a small step moves slowly.
SGHMC_LR, SGHMC_ALPHA, SGHMC_BURN_IN, SGHMC_THIN = 2e-4, 0.1, 20_000, 4_000
#: The running noise estimate's weight of the past (its bound: at 1 it never updates).
SGHMC_NOISE_DECAY, MAX_NOISE_DECAY = 0.99, 0.9999
#: A preconditioned chain's defaults (``preconditioner = "laplace"``), measured on OptuNet /
#: Fashion-MNIST: in whitened coordinates the minibatch gradient noise has eigenvalues up
#: to about 24,000 at batch 64 (median 865), so Chen et al.'s correction holds in every
#: direction only while whitened_lr * V / 2 < alpha; batch 512 divides V by 8.
SGHMC_WHITENED_LR, SGHMC_WHITENED_BATCH = 1e-4, 512
SGHMC_PRECONDITIONERS = ("auto", "laplace", "adapted", "none")
#: Where a chain's minibatches come from (the reasons at ``train_zoo.methods.sghmc``).
SGHMC_MINIBATCHES = ("epochs", "independent")
#: SGHMC chains per mode: each repeats the whole chain (burn-in included).
MAX_CHAINS = 64
#: SGHMC steps (burn-in, thinning, warm-up, rounds, settling): time, one gradient step
#: each.
MAX_SGHMC_STEPS = 100_000_000
#: The warm-up of ``preconditioner = "adapted"``: each chain runs ``adapt_steps`` steps in
#: the Laplace metric at a cheap, hot setting (step 1e-4, friction 0.05, batches of 256:
#: kinetic temperature about 2.2 on OptuNet, fast to spread), and every ADAPT_THIN-th
#: state of its second half is kept for the covariance.
ADAPT_LR, ADAPT_ALPHA, ADAPT_BATCH, ADAPT_THIN = 1e-4, 0.05, 256, 100
ADAPT_STEPS = 40_000
#: The cold rounds after the warm-up and their steps (measured at
#: ``train_zoo.methods.sghmc``), at most MAX_ADAPT_ROUNDS of them.
ADAPT_ROUNDS, ADAPT_ROUND_STEPS, ADAPTED_BATCH = 3, 29_000, 1024
MAX_ADAPT_ROUNDS = 100
#: Draws per chain and round that widen the metric (a round's least steps).
ROUND_DRAWS = 25
#: The settling that follows the rounds (``settle_steps``, at most).
SETTLE_STEPS = 290_000
#: An adapted chain's defaults: 4 chains, 4,000 burn-in steps, every 1,000th step kept
#: (measured at ``train_zoo.methods.sghmc``).
ADAPTED_CHAINS, ADAPTED_BURN_IN, ADAPTED_THIN = 4, 4_000, 1_000
_DERIVED_FRICTION = ("an adapted chain's cold rounds and samples derive theirs from the "
                     "noise: the mode's record has it")

SGHMC_OPTIONS = (
    _option("preconditioner", Choices(SGHMC_PRECONDITIONERS), "auto",
            f"auto (adapted up to {AUTO_FULL_LAPLACE_PARAMETERS:,} parameters, else none), "
            "none (plain SGHMC at lr), laplace (a constant mass matrix: the base network's "
            "full Laplace precision; each chain starts from a draw of that Laplace "
            "approximation), adapted (laplace, widened where warm-up chains spread wider, "
            "then cold rounds and settling; every chain samples from where the lowest-loss "
            "one settled)"),
    _option("lr", POSITIVE, SGHMC_LR, "step size per example (the chain's is lr / N), > 0"),
    _option("alpha", FRACTION, SGHMC_ALPHA, f"friction, in (0, 1] ({_DERIVED_FRICTION})"),
    _option("burn_in", _integer(0, MAX_SGHMC_STEPS), DERIVED,
            "steps discarded at the start of each chain (of an adapted one: after its "
            "settling)", f"{ADAPTED_BURN_IN:,} with an adapted chain, else {SGHMC_BURN_IN:,}"),
    _option("thin", _integer(1, MAX_SGHMC_STEPS), DERIVED, "steps between kept samples",
            f"{ADAPTED_THIN:,} with an adapted chain, else {SGHMC_THIN:,}"),
    _option("prior_precision", _prior_precision("training"), "training",
            _prior_precision_help("training")),
    _option("chains", _integer(1, MAX_CHAINS), DERIVED,
            f"independent chains per mode, 1 to {MAX_CHAINS}, each keeping samples_per_mode "
            "/ chains samples",
            f"{ADAPTED_CHAINS} with an adapted chain (the largest count up to "
            f"{ADAPTED_CHAINS} dividing samples_per_mode), else 1"),
    _option("noise_correction", BOOLEAN, True,
            "subtract Chen et al.'s beta_hat estimated from the minibatch gradients"),
    _option("noise_decay", _real(0, MAX_NOISE_DECAY, "right"), SGHMC_NOISE_DECAY,
            f"weight of the past in the running noise estimate, in (0, {MAX_NOISE_DECAY:g}]"),
    _option("adapt_steps", _integer(2 * ADAPT_THIN, MAX_SGHMC_STEPS), ADAPT_STEPS,
            f"warm-up steps of each chain before an adapted mass matrix (at step "
            f"{ADAPT_LR:g}, friction {ADAPT_ALPHA:g}, batches of {ADAPT_BATCH})"),
    _option("adapt_rounds", _integer(0, MAX_ADAPT_ROUNDS), ADAPT_ROUNDS,
            "cold rounds after the warm-up (temperature 1, noise-equalized metric, widened "
            "after each but the last); sampling then starts every chain from the end of the "
            "round's lowest-loss chain; 0: from each warm-up's end, at whitened_lr and "
            "alpha"),
    _option("adapt_round_steps", _integer(ROUND_DRAWS, MAX_SGHMC_STEPS), ADAPT_ROUND_STEPS,
            "steps of each chain in each cold round"),
    _option("settle_steps", _integer(0, MAX_SGHMC_STEPS), SETTLE_STEPS,
            "at most this many steps after the cold rounds in which their lowest-loss chain "
            "continues alone, adapt_round_steps at a time, until its mean loss stops falling "
            "(by less than the posterior's energy fluctuation, sqrt(d / 2) / N per example); "
            "0: none"),
    _option("whitened_lr", FRACTION, SGHMC_WHITENED_LR,
            "step size of a preconditioned chain (in whitened coordinates, where the "
            "posterior's curvature is about 1), in (0, 1]; lr is unused there "
            f"({_DERIVED_FRICTION})"),
    _option("batch_size", _integer(1, MAX_BATCH_SIZE), DERIVED,
            "minibatch size of the chains (the gradient noise falls as 1 / batch_size), 1 to "
            "the training set",
            f"{SGHMC_WHITENED_BATCH} with a preconditioner, else the recipe's"),
    _option("minibatches", Choices(SGHMC_MINIBATCHES), DERIVED,
            "epochs (the recipe's shuffled epochs) or independent (drawn with replacement: "
            "the independent noise the correction assumes, needed when 1 / alpha steps "
            "outlast an epoch)", "independent with a preconditioner, else epochs"),
)
#: SGLD is SGHMC's chain at friction 1: its options without ``alpha``.
SGLD_OPTIONS = tuple(option for option in SGHMC_OPTIONS if option.name != "alpha")

# ------------------------------------------------------------ csgld, csghmc
#: Cycles of a run by default (100 samples are 10 of each of 10 modes visited), and at
#: most.
CSGMCMC_CYCLES, MAX_CYCLES = 10, 10_000
#: The share of each cycle with noise (the authors': the last 5 of 50 epochs) and the
#: share over which its samples are kept (the authors': 3 of 50 epochs).
CSGMCMC_SAMPLING_FRACTION, CSGMCMC_KEEP_FRACTION = 0.1, 0.06
#: cSGHMC's friction (the authors' code: momentum 1 - 0.9).
CSGHMC_ALPHA = 0.9

CSGLD_OPTIONS = (
    _option("lr", POSITIVE, DERIVED,
            "step size at each cycle's start, on the mean loss (the chain's step on the "
            "full-data posterior is lr_k / N)", "alpha x the recipe's lr / (1 - its momentum)"),
    _option("epochs", _integer(1, MAX_EPOCHS), DERIVED,
            "the run's budget in epochs of the recipe's batches", "the recipe's epochs"),
    _option("cycles", _integer(1, MAX_CYCLES), DERIVED,
            "cycles of the cosine step size; samples_per_mode / cycles samples are kept at "
            "the end of each",
            f"{CSGMCMC_CYCLES} (the largest count up to {CSGMCMC_CYCLES} dividing "
            "samples_per_mode)"),
    _option("sampling_fraction", FRACTION, CSGMCMC_SAMPLING_FRACTION,
            "share of each cycle with noise (the sampling stage), in (0, 1]"),
    _option("keep_fraction", FRACTION, CSGMCMC_KEEP_FRACTION,
            "share of each cycle, at its end, over which its samples are kept, in (0, 1]"),
    _option("prior_precision", _prior_precision("training"), "training",
            _prior_precision_help("training")),
)
CSGHMC_OPTIONS = (
    _option("alpha", FRACTION, CSGHMC_ALPHA,
            "friction in (0, 1]: 1 - the momentum of the exploration stage"),
    *CSGLD_OPTIONS,
)

# ------------------------------------------------------------ bbb
#: The optimisers of BBB's ``mu`` and ``rho``, and where its means start.
BBB_OPTIMIZERS, BBB_MEAN_INITS = ("sgd", "adam"), ("random", "model")
#: Adam's initial learning rate when neither the options nor the preset give one (BLiTZ's
#: examples train with 1e-3).
BBB_ADAM_LR = 1e-3
#: BBB's named settings: the options each one sets before the spec's own are applied
#: (``paper``: the paper's Table 1; ``trained-variance``: Adam for rho, whose sigma then
#: trains; the measurements at ``train_zoo.methods.bbb_options``).
BBB_PRESETS: dict[str, dict[str, object]] = {
    "paper": {},
    "trained-variance": {"rho_optimizer": "adam", "rho_lr": 1e-2},
}
# Ranges: each ELBO sample is one more forward and backward pass per step (time); sigma =
# softplus(rho) spans 1e-13 to 10 for rho in [-30, 10]; initial spreads above 10 put
# weights far beyond any trained network's.
BBB_OPTIONS = (
    _option("preset", Choices(tuple(BBB_PRESETS)), "paper",
            f"named defaults for the options below: {', '.join(BBB_PRESETS)}"),
    _option("optimizer", Choices(BBB_OPTIMIZERS), DERIVED,
            "optimiser of the means: sgd (with the recipe's momentum) or adam",
            "the preset's, else sgd"),
    _option("lr", POSITIVE, DERIVED,
            "initial learning rate of the means, on the recipe's schedule",
            f"the preset's, else sgd: the recipe's, adam: {BBB_ADAM_LR:g}"),
    _option("rho_optimizer", Choices(BBB_OPTIMIZERS), DERIVED, "optimiser of rho: sgd or adam",
            "the preset's, else optimizer"),
    _option("rho_lr", POSITIVE, DERIVED, "initial learning rate of rho, on the same schedule",
            "the preset's, else lr, or rho_optimizer's default if it differs"),
    _option("prior_sigma", POSITIVE, 0.1, "standard deviation of the prior's first component"),
    _option("prior_sigma2", POSITIVE, 0.4,
            "standard deviation of the prior's second component"),
    _option("prior_pi", FRACTION, 1.0, "weight of the prior's first component, in (0, 1]"),
    _option("elbo_samples", _integer(1, 1_000), 3,
            "weight samples per step for the expected NLL"),
    _option("kl_weight", NON_NEGATIVE, None, "factor of the KL term",
            "1 / number of training examples"),
    _option("mean_init", Choices(BBB_MEAN_INITS), "random",
            "initial means: random N(0, mean_std^2) draws or the model's weights"),
    _option("mean_std", _real(0, 10), 0.1, "standard deviation of the random initial means"),
    _option("rho_linear", _real(-30, 10), -7.0, "mean of the initial rho of Linear layers"),
    _option("rho_conv", _real(-30, 10), -6.0, "mean of the initial rho of Conv layers"),
    _option("rho_std", _real(0, 10), 0.1, "standard deviation of the initial rho"),
)

# ------------------------------------------------------------ ivon
#: IVON's learning rate on the reference recipe (the ivon-opt README's 0.1), and the
#: package's defaults where the paper gives no other: hess_init, beta1, beta2.
IVON_LR, IVON_HESS_INIT, IVON_BETA1, IVON_BETA2 = 0.1, 1.0, 0.9, 0.99999

IVON_OPTIONS = (
    _option("lr", POSITIVE, IVON_LR,
            "IVON's learning rate at the start (the recipe's schedule scales it), > 0"),
    _option("epochs", _integer(1, MAX_EPOCHS), DERIVED, "epochs of the recipe's batches",
            "the recipe's epochs"),
    _option("hess_init", POSITIVE, IVON_HESS_INIT,
            "initial Hessian estimate h (the initial posterior std is "
            "1 / sqrt(N (h + weight_decay))), > 0"),
    _option("weight_decay", NON_NEGATIVE, DERIVED,
            "delta: the Gaussian prior's precision per example, >= 0",
            "the recipe's weight_decay"),
    _option("beta1", _real(0, 1, "left"), IVON_BETA1, "momentum of the gradient, in [0, 1)"),
    _option("beta2", FRACTION, IVON_BETA2, "momentum of the Hessian estimate, in (0, 1]"),
)

# ------------------------------------------------------------ emp, ecmp
#: Components per patched layer (the paper's K = 5); past 100 the paper's point (a small
#: overhead) is lost, K copies of the patched layers being K times their memory.
EMP_COMPONENTS, MAX_EMP_COMPONENTS = 5, 100
#: Forward passes averaged by the prediction (appendix D.6: S = 100 is as good as 200);
#: S passes cost S forward passes per batch.
EMP_SAMPLES, MAX_EMP_SAMPLES = 100, 100_000
#: The L2 factor is ``EMP_WEIGHT_DECAY / batch size`` (appendix C.1); Adam's default
#: learning rate (the paper trains with Adam's defaults); the components' initial spread
#: relative to each tensor's RMS.
EMP_WEIGHT_DECAY, EMP_LR, EMP_INIT_NOISE = 1e-3, 1e-3, 0.1
#: The patch layer choices.
EMP_PATCHES = ("auto", "bn", "bn+out", "in+out")

EMP_OPTIONS = (
    _option("components", _integer(1, MAX_EMP_COMPONENTS), EMP_COMPONENTS,
            "components K per patched layer, uniform mixing"),
    _option("patch", Choices(EMP_PATCHES), "auto",
            "patched layers: bn (BatchNorm affine), bn+out (and the output layer), in+out "
            "(first and output layers), auto (bn+out with BatchNorm, else in+out)"),
    _option("samples", _integer(1, MAX_EMP_SAMPLES), EMP_SAMPLES,
            "forward passes averaged by the prediction"),
    _option("weight_decay", NON_NEGATIVE, EMP_WEIGHT_DECAY,
            "L2 factor times the batch size, on every parameter and component"),
    _option("lr", POSITIVE, EMP_LR, "Adam's learning rate"),
    _option("init_noise", _real(0, 10), EMP_INIT_NOISE,
            "initial spread of components 1..K-1 around the base network, relative to each "
            "tensor's RMS"),
)

# ------------------------------------------------------------ rank-1
#: The families of the posterior's components (and of the prior), and how the components'
#: KL terms are combined.
RANK1_DISTRIBUTIONS, RANK1_COMPONENT_KL = ("gaussian", "cauchy"), ("sum", "mean")
#: The reference's initial scale: ``sqrt(p / (1 - p))`` for its dropout-rate flag
#: ``p = 1e-3`` (about 0.0316).
RANK1_INIT_STD = math.sqrt(1e-3 / (1 - 1e-3))
# Ranges: the training batch is K times the mini-batch (memory, time; the paper found no
# gain past 8 components); a factor scales a whole channel.
RANK1_OPTIONS = (
    _option("components", _integer(1, 64), 4,
            "mixture components K; the batch is tiled K times"),
    _option("distribution", Choices(RANK1_DISTRIBUTIONS), "gaussian",
            "family of the components and the prior: gaussian or cauchy"),
    _option("prior_mean", _real(-100, 100), 1.0,
            "location of the prior on every factor of r and s", "1"),
    _option("prior_scale", _real(0, 10, "right"), 0.1,
            "scale of the prior: its standard deviation, or the Cauchy's scale"),
    _option("init_std", _real(0, 10, "right"), RANK1_INIT_STD,
            "initial scale softplus(rho) of every factor", f"{RANK1_INIT_STD:.4g}"),
    _option("sign_probability", _real(0, 1), 0.5,
            "probability that an initial location is +1 rather than -1"),
    _option("kl_annealing", _real(0, 1), 0.8,
            "fraction of training over which the KL's factor rises linearly to 1"),
    _option("l2", _real(0, 1), 1e-4, "L2 penalty l2 * sum(theta^2) on the point estimates"),
    _option("component_kl", Choices(RANK1_COMPONENT_KL), "sum",
            "KL over the components: sum (the reference's) or mean"),
    _option("clip", _real(0, 1e6, "right"), 10.0,
            "draws of r and s are clipped to [-clip, clip]", "10"),
    _option("layers", NAMES, None,
            "names of the Conv2d and Linear layers that get r and s",
            "all Conv2d and Linear layers"),
)

# ------------------------------------------------------------ svgd
#: The RBF kernel's bandwidth rule (the only one: named so a collection records which it
#: used).
SVGD_BANDWIDTH = "median-blackjax"
SVGD_OPTIONS = (
    _option("bandwidth", Choices((SVGD_BANDWIDTH,)), SVGD_BANDWIDTH,
            f"the RBF kernel's bandwidth rule: {SVGD_BANDWIDTH} (median squared distance / "
            "log n, every step)"),
)

# ------------------------------------------------------------ hmc
#: Full-batch HMC (issue 33): burn-in iterations (adapting the step size; Izmailov et al.
#: 2021 burn in for 50), iterations between kept samples, the acceptance the adaptation
#: aims at (Hoffman & Gelman 2014) and the cap on leapfrog steps per iteration (the
#: bnn_hmc code's max_num_leapfrog_steps).
HMC_BURN_IN, HMC_THIN, HMC_TARGET_ACCEPT, HMC_MAX_LEAPFROG_STEPS = 50, 1, 0.8, 10_000
#: Where a chain starts: at the nearest posterior mode of its trained base network
#: (full-batch L-BFGS on the potential), or at the base network itself; and the most
#: L-BFGS iterations of the former (one or two full-data gradients each; the reference
#: target's checkpoint 0 converged, by scipy's relative-reduction test, after 6,500
#: evaluations: U 43,396 -> 30,211, where 2,000 left it at 30,531 and still falling).
HMC_STARTS, HMC_MAP_ITERATIONS = ("map", "base"), 10_000
#: The mass matrix: the diagonal Laplace precision at the start, or the identity
#: (Izmailov et al.'s).
HMC_MASSES = ("laplace-diag", "identity")
#: HMC iterations (burn-in, thinning): time, one trajectory of full-data gradients each.
MAX_HMC_ITERATIONS = 10_000_000
HMC_OPTIONS = (
    _option("burn_in", _integer(0, MAX_HMC_ITERATIONS), HMC_BURN_IN,
            "iterations that adapt the step size (dual averaging); none is kept"),
    _option("thin", _integer(1, MAX_HMC_ITERATIONS), HMC_THIN,
            "iterations between kept samples after burn-in"),
    _option("trajectory_length", POSITIVE, None,
            "integration time per iteration (step_size x leapfrog steps), > 0",
            "a quarter period of the prior's own dynamics (Izmailov et al. 2021): pi/2 "
            "with mass laplace-diag, pi/2 x the prior's sd 1/sqrt(N x weight_decay) with "
            "the identity"),
    _option("step_size", POSITIVE, None, "the leapfrog step size the adaptation starts "
            "from, > 0", "Hoffman & Gelman's heuristic (one step's acceptance near 1/2)"),
    _option("target_accept", _real(0, 1, "neither"), HMC_TARGET_ACCEPT,
            "the mean acceptance probability the burn-in adapts the step size to, in (0, 1)"),
    _option("max_leapfrog_steps", _integer(1, MAX_HMC_ITERATIONS), HMC_MAX_LEAPFROG_STEPS,
            "the most leapfrog steps per iteration (a shorter trajectory past it)"),
    _option("start", Choices(HMC_STARTS), "map",
            "map: burn-in starts at the posterior mode nearest the trained base network "
            "(full-batch L-BFGS on the potential; the base network, trained on augmented "
            "minibatches and stopped early, lies far above the posterior's typical set); "
            "base: at the base network itself"),
    _option("map_iterations", _integer(1, MAX_HMC_ITERATIONS), HMC_MAP_ITERATIONS,
            "the most L-BFGS iterations of start = map"),
    _option("mass", Choices(HMC_MASSES), "laplace-diag",
            "laplace-diag: a diagonal mass matrix, the diagonal GGN of the whole training "
            "set at the start plus the prior precision (every weight's posterior scale "
            "about 1 in the chain's coordinates); identity: Izmailov et al.'s"),
)


@dataclass(frozen=True)
class MethodInfo:
    """One posterior approximation, as data.

    Attributes
    ----------
    name : str
        As specs, collection files (the ``method`` attribute) and commands spell it.
    label : str
        Display name in tables and figures (a multi-mode posterior gets ``MM-``).
    family : str
        A key of :data:`FAMILIES`.
    records : tuple of str
        What its training records (entries of :data:`RECORDS`); empty for none.
    sample_sigma : bool
        Its samples are ``mu + sigma * eps`` around their mode (a mean-field Gaussian):
        ``diagnose`` reads the learned sigma from the samples' spread.
    colour : str
        Its colour in every figure (matplotlib).
    trainer : str
        ``"module:attribute"`` of its :class:`train_zoo.methods.base.Method` object.
    summary : str
        One line: what it is.
    options : tuple of OptionInfo
        Its options (a spec's ``[method_options]``), in the order they are resolved and
        listed; empty for none.
    variant : tuple of (str, str), optional
        The option whose value names a version of the method, and the paper's value of it
        (BBB's ``("preset", "paper")``, Laplace's ``("structure", "full")``): a collection
        recorded with another value is labelled ``"<label> (<value>)"``, so the versions
        get rows of their own in Table 1 and styles of their own in the figures.
    exact : bool
        Its sampler is asymptotically exact for the recipe's posterior (full-batch HMC with
        a Metropolis correction): the report takes its collection as the gold standard
        (:mod:`analysis.report.reference`).
    one_sample_per_mode : bool
        A mode is one independently trained network (DE's members; the trainer's
        ``Method.one_sample_per_mode``): its collections are multi-mode by construction,
        so their :data:`POSTERIOR_GROUPS` entry is never measured or changed
        (``posteriorzoo annotate`` refuses them). SVGD, of the same family, trains its
        particles together as one mode: its group is measured.
    """

    name: str
    label: str
    family: str
    records: tuple[str, ...]
    colour: str
    trainer: str
    summary: str
    sample_sigma: bool = False
    options: tuple[OptionInfo, ...] = ()
    variant: tuple[str, str] | None = None
    exact: bool = False
    one_sample_per_mode: bool = False

    def __post_init__(self) -> None:
        names = [option.name for option in self.options]
        if len(set(names)) != len(names):
            raise ValueError(f"method {self.name!r}: an option is declared twice")
        if self.variant is not None and self.variant[0] not in names:
            raise ValueError(f"method {self.name!r}: its variant option {self.variant[0]!r} "
                             "is not one of its options")
        if self.family not in FAMILIES:
            raise ValueError(f"method {self.name!r}: unknown family {self.family!r}")
        unknown = set(self.records) - set(RECORDS)
        if unknown:
            raise ValueError(f"method {self.name!r}: unknown records {sorted(unknown)}")


#: Every method, in the order of the paper's Table 1 and the listings.
METHODS: dict[str, MethodInfo] = {info.name: info for info in (
    MethodInfo("de", "DE", "ensemble", (), "#1f77b4", "train_zoo.methods.de:METHOD",
               "Deep Ensemble: independently trained networks", one_sample_per_mode=True),
    MethodInfo("mc-dropout", "Dropout", "variational", (), "#ff7f0e",
               "train_zoo.methods.dropout:METHOD",
               "MC Dropout: dropout kept on at sampling time", options=DROPOUT_OPTIONS),
    MethodInfo("swag", "SWAG", "gaussian", ("moments",), "#d62728",
               "train_zoo.methods.swag:METHOD",
               "SWAG: a Gaussian from the moments of SGD iterates", options=SWAG_OPTIONS),
    MethodInfo("laplace", "Laplace", "gaussian", ("curvature",), "#9467bd",
               "train_zoo.methods.laplace:METHOD",
               "Laplace: a Gaussian from the curvature at a trained network",
               options=LAPLACE_OPTIONS, variant=("structure", "full")),
    MethodInfo("sghmc", "SGHMC", "chain", ("chains",), "#8c564b",
               "train_zoo.methods.sghmc:METHOD",
               "SGHMC: stochastic-gradient Hamiltonian Monte Carlo chains", options=SGHMC_OPTIONS),
    MethodInfo("sgld", "SGLD", "chain", ("chains",), "#e7969c",
               "train_zoo.methods.sgld:METHOD",
               "SGLD: stochastic-gradient Langevin dynamics chains", options=SGLD_OPTIONS),
    MethodInfo("csgld", "cSGLD", "chain", (), "#c49c94", "train_zoo.methods.csgmcmc:CSGLD",
               "cyclical SGLD: one run through several modes by a cosine step size",
               options=CSGLD_OPTIONS),
    MethodInfo("csghmc", "cSGHMC", "chain", (), "#9edae5",
               "train_zoo.methods.csgmcmc:CSGHMC",
               "cyclical SGHMC: one run through several modes by a cosine step size",
               options=CSGHMC_OPTIONS),
    MethodInfo("bbb", "BBB", "variational", ("sigma",), "#2ca02c",
               "train_zoo.methods.bbb:METHOD",
               "Bayes by Backprop: a mean-field Gaussian trained by its ELBO",
               sample_sigma=True, options=BBB_OPTIONS, variant=("preset", "paper")),
    MethodInfo("ivon", "IVON", "variational", ("scales",), "#dbdb8d",
               "train_zoo.methods.ivon:METHOD",
               "IVON: a diagonal Gaussian learnt at Adam's cost (the ivon-opt optimizer)",
               options=IVON_OPTIONS),
    MethodInfo("emp", "EMP", "patch", ("patch",), "#bcbd22", "train_zoo.methods.emp:METHOD",
               "Ensemble Model Patching: a stochastic patch per layer", options=EMP_OPTIONS),
    MethodInfo("ecmp", "ECMP", "patch", ("patch",), "#17becf", "train_zoo.methods.emp:ECMP",
               "Ensemble Model Patching per element", options=EMP_OPTIONS),
    MethodInfo("rank-1", "Rank-1", "variational", ("scales",), "#393b79",
               "train_zoo.methods.rank1:METHOD",
               "Rank-1 BNN: rank-1 multiplicative factors of a shared network",
               options=RANK1_OPTIONS),
    MethodInfo("svgd", "SVGD", "ensemble", (), "#aec7e8", "train_zoo.methods.svgd:METHOD",
               "SVGD: samples_per_mode particles that repel (Stein variational gradient "
               "descent)", options=SVGD_OPTIONS),
    MethodInfo("hmc", "HMC", "chain", ("chains",), "#637939", "train_zoo.methods.hmc:METHOD",
               "full-batch HMC: one Metropolis-corrected chain from each trained base "
               "network", options=HMC_OPTIONS, exact=True),
)}


def method_info(name: str) -> MethodInfo | None:
    """The :class:`MethodInfo` of ``name``, or None for a name no method has (a file made
    elsewhere may record any method)."""
    return METHODS.get(name)


def methods_in(family: str) -> tuple[str, ...]:
    """The names of the methods of ``family``, in :data:`METHODS` order."""
    return tuple(name for name, info in METHODS.items() if info.family == family)


def options_of(method: str) -> tuple[OptionInfo, ...]:
    """The declared options of ``method`` (KeyError for a name no method has)."""
    return METHODS[method].options


def describe_options(method: str | None = None) -> list[dict[str, str]]:
    """The listing of ``posteriorzoo train --list-options``: one row per option of
    ``method`` (every method when None) with ``method``, ``option``, ``default``,
    ``allowed`` (its constraints in words) and ``help``, read from the declarations
    alone, so the listing needs no trainer (and no torch)."""
    names = tuple(METHODS) if method is None else (method,)
    return [{"method": name, "option": option.name, "default": option.default_text,
             "allowed": " or ".join(constraint.text() for constraint in option.constraints),
             "help": option.help}
            for name in names for option in options_of(name)]


# ----------------------------------------------------------------------- symmetries
@dataclass(frozen=True)
class SymmetrySetting:
    """One setting of the one concept: whether weight-space symmetries are kept or
    removed before comparing. ``word`` is the option's value and the key in every file;
    ``statistic`` names the MMD so computed; ``collection`` a collection so read."""

    word: str
    statistic: str
    collection: str


#: ``keep``: the weights as trained (MMD of raw collections); ``remove``: canonicalized
#: first (NS-MMD, of canonical collections).
SYMMETRIES: dict[str, SymmetrySetting] = {
    "keep": SymmetrySetting("keep", "MMD", "raw"),
    "remove": SymmetrySetting("remove", "NS-MMD", "canonical"),
}
#: The ``--symmetries`` choices: either setting or both.
SYMMETRY_CHOICES = (*SYMMETRIES, "both")

# ---------------------------------------------------------------- posterior groups
#: Where a collection's samples lie, the ``posterior`` entry of its ``annotations`` (by
#: which the report groups Table 1): around one network (``single-mode``) or around
#: several (``multi-mode``). The trainer writes it from the spec; ``posteriorzoo
#: annotate`` sets it afterwards from a measurement of the samples.
POSTERIOR_GROUPS = ("single-mode", "multi-mode")

# ---------------------------------------------------------------- named option choices
#: Canonicalization's permutation key (``first``: the first weight, ``max``: the largest
#: magnitude, ``none``: no permutation).
PERMUTATION_KEYS = ("first", "max", "none")
#: The permutation keys that sort the units (the permutation-stability study's ``--key``).
SORT_KEYS = tuple(key for key in PERMUTATION_KEYS if key != "none")
#: Canonicalization's scaling rule (ReLU rescalings and the softmax shift).
SCALINGS = ("norm", "std", "minmass", "none")
#: The min-mass solver: the project's batched Newton solver, or cvxpy (the reference).
MINMASS_SOLVERS = ("fast", "cvxpy")
#: Distance engines: ``exact`` (float64, the shipped numbers' bits) or ``fast``.
DISTANCE_PRECISIONS = ("exact", "fast")
#: What one MMD compares: a parameter tensor, or a module's parameters together.
LAYER_GROUPS = ("tensor", "module")
#: What summarises a layer's MMDs over the kernels (the tables' columns, ``plot mmd``).
KERNEL_STATISTICS = ("median", "mean", "max")
#: The out-of-distribution score of the metrics.
OOD_SCORES = ("max-probability", "mutual-information")
#: Floating dtypes a collection may store.
STORAGE_DTYPES = ("float16", "float32", "float64")
#: Where the trainer runs its jobs.
BACKENDS = ("local", "serial", "ray")
#: The trainer's engines (``auto`` picks the fastest that has the piece).
ENGINES = ("auto", "torch", "fast", "vectorised")
