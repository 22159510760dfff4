"""Parameter overhead of variational methods, counted on any network (a pure core).

Three methods, each counted by walking a network's modules (BatchNorm, Conv, Linear), so
the counts hold for every registered architecture and for any ``nn.Module``; the EMP and
Rank-1 trainers reuse the layer selections (:func:`patch_layers`, :func:`weighted_layers`):

- **EMP / ECMP** (Ensemble Model Patching, seed 001): ``K`` copies of the *patch* layers,
  so ``(K - 1) x`` their parameters are added. Patches (:data:`PATCHES`): ``bn`` the
  BatchNorm affine ``gamma``/``beta``; ``bn+out`` BN plus the output layer; ``in+out`` the
  input and output layers (for networks without BN, such as OptuNet). The input and
  output layers are the first and last Conv/Linear layers in the order the network
  registers its modules (weights and biases).
- **Rank-1 BNN** (seed 002): every Conv/Linear weight ``W`` (``out x in``) gets rank-1
  factors ``r`` (``out``) and ``s`` (``in``) per mixture component, each with a mean and a
  scale: ``2 x K x sum over layers (in + out)`` added; BatchNorm and biases are shared.
- **Mean-field BBB**: every Conv/Linear weight and bias gets a ``rho`` next to its mean (its
  count is added); BatchNorm's affine parameters stay point estimates, as in
  posteriorzoo's BBB (``train_zoo.methods.bbb``).

:func:`architecture_overhead` counts a registered architecture (built on the ``meta``
device: nothing allocated), :func:`overhead_report` several, and :func:`seed_figures`
reproduces the seeds' published figures at their printed precision, saying for each one
it cannot match what it would take.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from posteriorzoo._api import public
from posteriorzoo.errors import InvalidOptionError
from posteriorzoo.options import check_choice, check_integer
from posteriorzoo.vocabulary import EMP_COMPONENTS, EMP_PATCHES, options_of

__all__ = [
    "BBB",
    "EMP",
    "COUNTED_METHODS",
    "PATCHES",
    "RANK1",
    "ArchitectureOverhead",
    "MethodOverhead",
    "OverheadReport",
    "SeedFigure",
    "architecture_overhead",
    "batchnorm_layers",
    "bbb_overhead",
    "emp_overhead",
    "overhead_report",
    "patch_layers",
    "rank1_factor_size",
    "rank1_overhead",
    "seed_figures",
    "weighted_layers",
]

#: The methods counted, in the order they are reported (the vocabulary's names).
COUNTED_METHODS = (EMP, RANK1, BBB) = ("emp", "rank-1", "bbb")
#: EMP/ECMP patches: BatchNorm affine; BN and the output layer; the input and output layers
#: (the vocabulary's choices of the ``patch`` option but ``auto``, which picks one of them).
PATCHES = tuple(patch for patch in EMP_PATCHES if patch != "auto")


def _declared_components(method: str) -> int:
    """The default of ``method``'s ``components`` option as the vocabulary declares it, so
    that the counts and the trainer cannot disagree on ``K``."""
    default = next(option.default for option in options_of(method)
                   if option.name == "components")
    if not isinstance(default, int):
        raise TypeError(f"{method}'s declared components default is not an integer: "
                        f"{default!r}")
    return default


#: The seeds' numbers of components, the trainers' defaults (EMP_COMPONENTS, imported
#: from the vocabulary): EMP/ECMP K = 5 (seed 001), Rank-1 K = 4 (seed 002).
RANK1_COMPONENTS = _declared_components("rank-1")
#: More components than this is no parameter-efficient method; the bound keeps a typo
#: (an extra digit) from printing a meaningless table.
MAX_COMPONENTS = 1_000

Layer = tuple[str, nn.Module]


def _parameters(module: nn.Module) -> int:
    """The module's own trainable parameters (not its children's)."""
    return sum(p.numel() for p in module.parameters(recurse=False) if p.requires_grad)


@public
def weighted_layers(model: nn.Module) -> list[Layer]:
    """The Conv and Linear layers of ``model`` as ``(name, module)``, in the order the
    network registers them (for the networks here, the forward order)."""
    return [(name, module) for name, module in model.named_modules()
            if isinstance(module, (nn.modules.conv._ConvNd, nn.Linear))]


@public
def batchnorm_layers(model: nn.Module) -> list[Layer]:
    """The BatchNorm layers of ``model`` that have affine parameters (``gamma``/``beta``)."""
    return [(name, module) for name, module in model.named_modules()
            if isinstance(module, nn.modules.batchnorm._BatchNorm) and module.affine]


def _in_out(module: nn.Module) -> tuple[int, int]:
    if isinstance(module, nn.Linear):
        return module.in_features, module.out_features
    return module.in_channels, module.out_channels


@public
def patch_layers(model: nn.Module, patch: str) -> list[Layer]:
    """The layers EMP/ECMP copies ``K`` times for ``patch`` (one of :data:`PATCHES`).

    Raises
    ------
    InvalidOptionError
        An unknown patch, or one that selects nothing (``bn`` in a network without
        BatchNorm, ``in+out`` in one without Conv/Linear layers).
    """
    check_choice("patch", patch, PATCHES)
    weighted = weighted_layers(model)
    norms = batchnorm_layers(model)
    kind = type(model).__name__
    if patch in ("bn", "bn+out") and not norms:
        raise InvalidOptionError(f"the patch {patch!r} needs BatchNorm layers and {kind} has "
                                 "none; patch its input and output layers (in+out)")
    if patch in ("bn+out", "in+out") and not weighted:
        raise InvalidOptionError(f"the patch {patch!r} needs Conv or Linear layers and "
                                 f"{kind} has none")
    if patch == "bn":
        return norms
    if patch == "bn+out":
        return [*norms, weighted[-1]]
    return weighted[:1] if len(weighted) == 1 else [weighted[0], weighted[-1]]


def _components(what: str, value: object, minimum: int) -> int:
    return check_integer(what, value, minimum, MAX_COMPONENTS)


@public
def emp_overhead(model: nn.Module, patch: str = "bn+out",
                 components: int = EMP_COMPONENTS) -> int:
    """Parameters EMP/ECMP adds to ``model``: ``(K - 1)`` x the patch's parameters.

    ``components`` (``K``) is 2 to 1,000 (5 in seed 001).
    """
    components = _components("EMP components (K)", components, 2)
    return (components - 1) * sum(_parameters(m) for _, m in patch_layers(model, patch))


@public
def rank1_factor_size(model: nn.Module) -> int:
    """``sum over Conv/Linear layers (in + out)``: the length of one component's ``s`` and
    ``r`` vectors together."""
    return sum(sum(_in_out(module)) for _, module in weighted_layers(model))


@public
def rank1_overhead(model: nn.Module, components: int = RANK1_COMPONENTS) -> int:
    """Parameters a Rank-1 BNN adds to ``model``: ``2 x K x sum(in + out)`` (a mean and a
    scale for each entry of every component's ``r`` and ``s``).

    ``components`` (``K``) is 1 to 1,000 (4 in seed 002).
    """
    components = _components("Rank-1 components (K)", components, 1)
    return 2 * components * rank1_factor_size(model)


@public
def bbb_overhead(model: nn.Module) -> int:
    """Parameters mean-field BBB adds to ``model``: a ``rho`` for every Conv/Linear weight
    and bias (BatchNorm stays a point estimate)."""
    return sum(_parameters(module) for _, module in weighted_layers(model))


@dataclass(frozen=True)
class MethodOverhead:
    """One method's overhead on one network.

    Attributes
    ----------
    method : str
        ``emp``, ``rank1`` or ``bbb``.
    patch : str or None
        The EMP patch (None for the other methods).
    components : int or None
        ``K`` (None for BBB).
    added : int
        Parameters the method adds.
    total : int
        The network's parameters plus ``added``.
    fraction : float
        ``added`` over the network's parameters.
    counted : str
        What was counted, in words.
    """

    method: str
    patch: str | None
    components: int | None
    added: int
    total: int
    fraction: float
    counted: str

    @property
    def label(self) -> str:
        """``EMP/ECMP K=5 bn+out``, ``Rank-1 K=4``, ``mean-field BBB``."""
        if self.method == EMP:
            return f"EMP/ECMP K={self.components} {self.patch}"
        if self.method == RANK1:
            return f"Rank-1 K={self.components}"
        return "mean-field BBB"

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: every field, ``percent`` (``100 x fraction``) and ``label``."""
        return {"method": self.method, "patch": self.patch, "components": self.components,
                "label": self.label, "added": self.added, "total": self.total,
                "fraction": self.fraction, "percent": 100 * self.fraction,
                "counted": self.counted}


@dataclass(frozen=True)
class ArchitectureOverhead:
    """The overheads of every method on one architecture.

    Attributes
    ----------
    architecture : str
    num_classes : int or None
        Outputs: as given, else the registry's default, else the last Conv/Linear
        layer's (``mlp``: ``widths[-1]``).
    options : dict
        The architecture's options as built (defaults filled in).
    parameters : int
        Its trainable parameters.
    methods : tuple of MethodOverhead
    skipped : tuple of str
        Patches that select nothing in this network, each with the reason.
    """

    architecture: str
    num_classes: int | None
    options: Mapping[str, Any]
    parameters: int
    methods: tuple[MethodOverhead, ...]
    skipped: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: every field, ``methods`` as a list of :meth:`MethodOverhead.to_dict`."""
        return {"architecture": self.architecture, "num_classes": self.num_classes,
                "options": {k: list(v) if isinstance(v, tuple) else v
                            for k, v in self.options.items()},
                "parameters": self.parameters,
                "methods": [method.to_dict() for method in self.methods],
                "skipped": list(self.skipped)}

    def __repr__(self) -> str:
        return (f"<ArchitectureOverhead: {self.architecture}, {self.parameters:,} parameters, "
                f"{len(self.methods)} methods; .to_dict() for the table>")


def _count(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def _method_rows(model: nn.Module, emp_components: int, rank1_components: int
                 ) -> tuple[list[MethodOverhead], list[str]]:
    base = _count(model)
    rows: list[MethodOverhead] = []
    skipped: list[str] = []

    def add(method: str, patch: str | None, components: int | None, added: int,
            counted: str) -> None:
        rows.append(MethodOverhead(method, patch, components, added, base + added,
                                   added / base if base else 0.0, counted))

    norms = batchnorm_layers(model)
    weighted = weighted_layers(model)
    for patch in PATCHES:
        try:
            layers = patch_layers(model, patch)
        except InvalidOptionError as error:
            skipped.append(f"EMP/ECMP {patch}: {error}")
            continue
        patched = sum(_parameters(m) for _, m in layers)
        in_bn = sum(_parameters(m) for _, m in norms)
        parts = []
        if patch != "in+out":
            parts.append(f"{len(norms)} BatchNorm layers ({in_bn:,} gamma/beta)")
        if patch == "bn+out":
            parts.append(f"the output layer {layers[-1][0]} ({_parameters(layers[-1][1]):,})")
        if patch == "in+out":
            parts.append(" and ".join(f"{name} ({_parameters(m):,})" for name, m in layers))
        add(EMP, patch, emp_components, emp_overhead(model, patch, emp_components),
            f"{emp_components - 1} more {'copy' if emp_components == 2 else 'copies'} of "
            f"{' and '.join(parts)}: "
            f"{emp_components - 1} x {patched:,}")
    if weighted:
        size = rank1_factor_size(model)
        add(RANK1, None, rank1_components, rank1_overhead(model, rank1_components),
            f"r and s of {len(weighted)} Conv/Linear layers, sum(in + out) = {size:,}, a mean "
            f"and a scale each per component: 2 x {rank1_components} x {size:,}")
        point = sum(_parameters(m) for _, m in norms)
        add(BBB, None, None, bbb_overhead(model),
            f"a rho for each Conv/Linear weight and bias ({bbb_overhead(model):,})"
            + (f"; the {point:,} BatchNorm gamma/beta stay point estimates" if point else ""))
    else:
        skipped.append("Rank-1 and BBB: no Conv or Linear layers")
    return rows, skipped


@public
def architecture_overhead(name: str, num_classes: int | None = None, *,
                          emp_components: int = EMP_COMPONENTS,
                          rank1_components: int = RANK1_COMPONENTS,
                          **options: Any) -> ArchitectureOverhead:
    """Every method's overhead on the registered architecture ``name``.

    The network is built on the ``meta`` device (no memory, no random numbers) with
    ``num_classes`` and ``options`` (the registry's defaults otherwise).

    Raises
    ------
    UnknownNameError
        ``name`` or an option is not registered.
    InvalidOptionError
        ``emp_components`` outside 2 to 1,000, ``rank1_components`` outside 1 to 1,000,
        or a bad option value.
    """
    import torch

    from posteriorzoo.models import registry

    emp_components = _components("EMP components (K)", emp_components, 2)
    rank1_components = _components("Rank-1 components (K)", rank1_components, 1)
    if num_classes is not None:
        num_classes = check_integer("num_classes", num_classes, 1)
    _, n_out, merged = registry.resolve(name, num_classes, options)
    with torch.device("meta"):
        model = registry.build(name, n_out, **merged)
    rows, skipped = _method_rows(model, emp_components, rank1_components)
    weighted = weighted_layers(model)
    if n_out is None and weighted:  # set by the options (mlp: widths[-1])
        n_out = _in_out(weighted[-1][1])[1]
    return ArchitectureOverhead(name, n_out, merged, _count(model), tuple(rows), tuple(skipped))


@dataclass(frozen=True)
class SeedFigure:
    """One figure a seed publishes, recomputed.

    Attributes
    ----------
    source : str
        Where it is printed (``seed 001, Table 4``).
    claim : str
        What it is.
    architecture, num_classes, options
        The registered network that reproduces it.
    printed : str
        The figure as the seed prints it (its precision is the one compared).
    computed : str
        Ours at that precision.
    exact : int or float
        Ours unrounded: a parameter count, or a percentage.
    matches : bool
        ``computed == printed``.
    note : str
        What was counted; for a figure that does not match, what it would take.
    """

    source: str
    claim: str
    architecture: str
    num_classes: int | None
    printed: str
    computed: str
    exact: int | float
    matches: bool
    note: str
    options: Mapping[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: every field."""
        return {"source": self.source, "claim": self.claim,
                "architecture": self.architecture, "num_classes": self.num_classes,
                "options": dict(self.options), "printed": self.printed,
                "computed": self.computed, "exact": self.exact, "matches": self.matches,
                "note": self.note}


def _at_precision(value: int | float, printed: str) -> str:
    """``value`` written as ``printed`` is: ``0.328%`` (a percentage, same decimals),
    ``23.4M`` (millions, same decimals) or ``1,129,100`` (an exact count)."""
    def decimals(text: str) -> int:
        return len(text.split(".")[1]) if "." in text else 0

    if printed.endswith("%"):
        return f"{value:.{decimals(printed[:-1])}f}%"
    if printed.endswith("M"):
        return f"{value / 1e6:.{decimals(printed[:-1])}f}M"
    return f"{int(value):,}"


def _factor_size_of(name: str, num_classes: int | None) -> int:
    """:func:`rank1_factor_size` of a registered architecture built on the meta device."""
    import torch

    from posteriorzoo.models import registry

    with torch.device("meta"):
        return rank1_factor_size(registry.build(name, num_classes))


@public
def seed_figures() -> tuple[SeedFigure, ...]:
    """The seeds' parameter figures, recomputed on the registered networks and compared at
    the precision each is printed with (see :class:`SeedFigure`)."""
    figures: list[SeedFigure] = []

    def add(source: str, claim: str, name: str, num_classes: int | None, printed: str,
            exact: int | float, note: str, otherwise: str = "") -> None:
        computed = _at_precision(exact, printed)
        matches = computed == printed
        figures.append(SeedFigure(source, claim, name, num_classes, printed, computed, exact,
                                  matches, note if matches else f"{note}; {otherwise}"))

    def method(overhead: ArchitectureOverhead, kind: str, patch: str | None = None
               ) -> MethodOverhead:
        return next(m for m in overhead.methods if m.method == kind and m.patch == patch)

    imagenet18 = architecture_overhead("resnet18-imagenet", 1000)
    emp_bn, emp_out = method(imagenet18, EMP, "bn"), method(imagenet18, EMP, "bn+out")
    bbb = method(imagenet18, BBB)
    s1 = "seed 001 (Ensemble Model Patching)"
    add(f"{s1}, Table 3", "ResNet-18 (ImageNet), deterministic", "resnet18-imagenet", 1000,
        "11,689,512", imagenet18.parameters, "torchvision's layout")
    add(f"{s1}, Table 4", "EMP/ECMP (BN), ResNet-18 ImageNet, K = 5: overhead",
        "resnet18-imagenet", 1000, "0.328%", 100 * emp_bn.fraction, emp_bn.counted)
    add(f"{s1}, Tables 1, 4", "EMP/ECMP (BN+out), ResNet-18 ImageNet, K = 5: overhead",
        "resnet18-imagenet", 1000, "17.9%", 100 * emp_out.fraction, emp_out.counted)
    add(f"{s1}, Table 3", "EMP/ECMP (BN+out), ResNet-18 ImageNet, K = 5: parameters",
        "resnet18-imagenet", 1000, "13,779,912", emp_out.total, emp_out.counted)
    add(f"{s1}, Table 1", "mean-field Gaussian, ResNet-18 ImageNet: parameters",
        "resnet18-imagenet", 1000, "23.4M", bbb.total, bbb.counted)
    add(f"{s1}, Table 1", "mean-field Gaussian, ResNet-18 ImageNet: overhead",
        "resnet18-imagenet", 1000, "100%", 100 * bbb.fraction,
        f"{bbb.counted}; doubling BatchNorm too (the seed's 'doubles the parameter use') "
        f"gives {2 * imagenet18.parameters:,}, exactly 100%")
    cifar18 = architecture_overhead("resnet18", 100)
    for patch, printed in (("bn", "0.342%"), ("bn+out", "2.171%")):
        row = method(cifar18, EMP, patch)
        add("issue 19", f"EMP/ECMP ({patch}), CIFAR ResNet-18, 100 classes, K = 5: overhead",
            "resnet18", 100, printed, 100 * row.fraction, row.counted)
    mlp = architecture_overhead("mlp-bn", None)
    mlp_emp = method(mlp, EMP, "bn+out")
    mlp_note = ("input 1, 99 hidden Linear(100, no bias) + BatchNorm(100) layers, output "
                "Linear(100 -> 100, no bias)")
    add(f"{s1}, Table 3", "MLP (L = 100, H = 100), deterministic", "mlp-bn", None,
        "1,009,900", mlp.parameters, mlp_note)
    add(f"{s1}, Table 3", "EMP/ECMP (BN+out), MLP (L = 100, H = 100), K = 5: parameters",
        "mlp-bn", None, "1,129,100", mlp_emp.total, mlp_emp.counted)

    s2 = "seed 002 (Rank-1 BNNs)"
    resnet50 = architecture_overhead("resnet50", 1000)
    rank1 = method(resnet50, RANK1)
    add(f"{s2}, Table 1", "ResNet-50 (ImageNet), deterministic", "resnet50", 1000, "25.6M",
        resnet50.parameters, "torchvision's layout")
    add(f"{s2}, Table 1", "Rank-1 BNN, ResNet-50, K = 4: parameters", "resnet50", 1000,
        "26.0M", rank1.total, rank1.counted)
    size = _factor_size_of("resnet50", 1000)
    per_component = 2 * size / resnet50.parameters
    add(f"{s2}, section 3.3", "Rank-1 mixture, ResNet-50, K = 10: increase", "resnet50",
        1000, "0.4%", 10 * 100 * per_component,
        f"2 x 10 x {size:,} = {20 * size:,}",
        f"the seed's 0.4% is one component's share: 2 x {size:,} = {2 * size:,} "
        f"({100 * per_component:.3f}%)")
    for classes, table in ((10, "Table 2 (CIFAR-10)"), (100, "Table 3 (CIFAR-100)")):
        wrn = architecture_overhead("wrn28-10", classes)
        row = method(wrn, RANK1)
        add(f"{s2}, {table}", f"WRN-28-10, {classes} classes, deterministic", "wrn28-10",
            classes, "36.5M", wrn.parameters, "pre-activation, convolutions without bias")
        size = _factor_size_of("wrn28-10", classes)
        limit = 36_650_000 - 1 - wrn.parameters
        add(f"{s2}, {table}", f"Rank-1 BNN, WRN-28-10, {classes} classes, K = 4: parameters",
            "wrn28-10", classes, "36.6M", row.total, row.counted,
            f"36.6M allows at most {limit:,} added parameters, {limit / size:.2f} x "
            f"sum(in + out) rather than 8 x; the seed's CIFAR-10 figure (Table 2) matches, "
            f"so Table 3 likely repeats it; means only (K x sum(in + out), as its "
            f"BatchEnsemble row) would give {wrn.parameters + 4 * size:,}")
    return tuple(figures)


@dataclass(frozen=True)
class OverheadReport:
    """What ``posteriorzoo overhead`` prints.

    Attributes
    ----------
    architectures : tuple of ArchitectureOverhead
    seeds : tuple of SeedFigure
        The seeds' figures (empty unless asked for).
    emp_components, rank1_components : int
    """

    architectures: tuple[ArchitectureOverhead, ...]
    seeds: tuple[SeedFigure, ...]
    emp_components: int
    rank1_components: int

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: ``kind`` ``overhead``, the components, every architecture and seed
        figure."""
        return {"kind": "overhead", "emp_components": self.emp_components,
                "rank1_components": self.rank1_components,
                "architectures": [a.to_dict() for a in self.architectures],
                "seed_figures": [s.to_dict() for s in self.seeds]}

    def __repr__(self) -> str:
        return (f"<OverheadReport: {len(self.architectures)} architectures, "
                f"{len(self.seeds)} seed figures; .to_dict() for the tables>")


@public
def overhead_report(architectures: Sequence[str] | None = None, num_classes: int | None = None,
                    *, emp_components: int = EMP_COMPONENTS,
                    rank1_components: int = RANK1_COMPONENTS,
                    seeds: bool = False) -> OverheadReport:
    """The overheads of ``architectures`` (default: every registered one, each with its
    default options) and, with ``seeds``, the seeds' figures (:func:`seed_figures`)."""
    from posteriorzoo.models import available_models, model_entry

    emp_components = _components("EMP components (K)", emp_components, 2)
    rank1_components = _components("Rank-1 components (K)", rank1_components, 1)
    if num_classes is not None:
        num_classes = check_integer("num_classes", num_classes, 1)
    if architectures is None:
        # Networks whose options set the outputs (mlp: widths) keep them: num_classes is
        # for those that take it.
        names = available_models()
        classes = {name: num_classes if model_entry(name).num_classes is not None else None
                   for name in names}
    else:
        names = list(dict.fromkeys(architectures))
        for name in names:
            model_entry(name)   # an unknown name fails before any counting
        classes = dict.fromkeys(names, num_classes)
    rows = tuple(architecture_overhead(name, classes[name], emp_components=emp_components,
                                       rank1_components=rank1_components) for name in names)
    return OverheadReport(rows, seed_figures() if seeds else (), emp_components,
                          rank1_components)
