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
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "BACKENDS", "DISTANCE_PRECISIONS", "ENGINES", "FAMILIES", "KERNEL_STATISTICS",
    "LAYER_GROUPS", "METHODS", "MINMASS_SOLVERS", "OOD_SCORES", "PERMUTATION_KEYS", "RECORDS",
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
#: ``diagnose``: ``chains`` (per chain: kinetic temperature), ``sigma`` (the learned
#: standard deviations and ELBO terms), ``scales`` (per factor: the median scale at the
#: start and the end), ``moments`` (SWAG's rank and iterates), ``curvature`` (Laplace's
#: structure, prior precision and evidence), ``patch`` (the patched part's training).
RECORDS = ("chains", "sigma", "scales", "moments", "curvature", "patch")


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
    """

    name: str
    label: str
    family: str
    records: tuple[str, ...]
    colour: str
    trainer: str
    summary: str
    sample_sigma: bool = False

    def __post_init__(self) -> None:
        if self.family not in FAMILIES:
            raise ValueError(f"method {self.name!r}: unknown family {self.family!r}")
        unknown = set(self.records) - set(RECORDS)
        if unknown:
            raise ValueError(f"method {self.name!r}: unknown records {sorted(unknown)}")


#: Every method, in the order of the paper's Table 1 and the listings.
METHODS: dict[str, MethodInfo] = {info.name: info for info in (
    MethodInfo("de", "DE", "ensemble", (), "#1f77b4", "train_zoo.methods.de:METHOD",
               "Deep Ensemble: independently trained networks"),
    MethodInfo("mc-dropout", "Dropout", "variational", (), "#ff7f0e",
               "train_zoo.methods.dropout:METHOD",
               "MC Dropout: dropout kept on at sampling time"),
    MethodInfo("swag", "SWAG", "gaussian", ("moments",), "#d62728",
               "train_zoo.methods.swag:METHOD",
               "SWAG: a Gaussian from the moments of SGD iterates"),
    MethodInfo("laplace", "Laplace", "gaussian", ("curvature",), "#9467bd",
               "train_zoo.methods.laplace:METHOD",
               "Laplace: a Gaussian from the curvature at a trained network"),
    MethodInfo("sghmc", "SGHMC", "chain", ("chains",), "#8c564b",
               "train_zoo.methods.sghmc:METHOD",
               "SGHMC: stochastic-gradient Hamiltonian Monte Carlo chains"),
    MethodInfo("sgld", "SGLD", "chain", ("chains",), "#e7969c",
               "train_zoo.methods.sgld:METHOD",
               "SGLD: stochastic-gradient Langevin dynamics chains"),
    MethodInfo("csgld", "cSGLD", "chain", (), "#c49c94", "train_zoo.methods.csgmcmc:CSGLD",
               "cyclical SGLD: one run through several modes by a cosine step size"),
    MethodInfo("csghmc", "cSGHMC", "chain", (), "#9edae5",
               "train_zoo.methods.csgmcmc:CSGHMC",
               "cyclical SGHMC: one run through several modes by a cosine step size"),
    MethodInfo("bbb", "BBB", "variational", ("sigma",), "#2ca02c",
               "train_zoo.methods.bbb:METHOD",
               "Bayes by Backprop: a mean-field Gaussian trained by its ELBO",
               sample_sigma=True),
    MethodInfo("ivon", "IVON", "variational", ("scales",), "#dbdb8d",
               "train_zoo.methods.ivon:METHOD",
               "IVON: a diagonal Gaussian learnt at Adam's cost (the ivon-opt optimizer)"),
    MethodInfo("emp", "EMP", "patch", ("patch",), "#bcbd22", "train_zoo.methods.emp:METHOD",
               "Ensemble Model Patching: a stochastic patch per layer"),
    MethodInfo("ecmp", "ECMP", "patch", ("patch",), "#17becf", "train_zoo.methods.emp:ECMP",
               "Ensemble Model Patching per element"),
    MethodInfo("rank-1", "Rank-1", "variational", ("scales",), "#393b79",
               "train_zoo.methods.rank1:METHOD",
               "Rank-1 BNN: rank-1 multiplicative factors of a shared network"),
    MethodInfo("svgd", "SVGD", "ensemble", (), "#aec7e8", "train_zoo.methods.svgd:METHOD",
               "SVGD: samples_per_mode particles that repel (Stein variational gradient "
               "descent)"),
)}


def method_info(name: str) -> MethodInfo | None:
    """The :class:`MethodInfo` of ``name``, or None for a name no method has (a file made
    elsewhere may record any method)."""
    return METHODS.get(name)


def methods_in(family: str) -> tuple[str, ...]:
    """The names of the methods of ``family``, in :data:`METHODS` order."""
    return tuple(name for name, info in METHODS.items() if info.family == family)


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
