"""Rank-1 BNNs' options: their names, help, defaults and checks.

:class:`Rank1Options` (validated on construction by the constraints the vocabulary
declares, ``posteriorzoo.vocabulary.RANK1_OPTIONS``), :data:`OPTION_HELP`,
:func:`resolve_options` (what a collection records) and the choices and defaults they
name (:data:`DISTRIBUTIONS`, :data:`COMPONENT_KL`, :data:`INIT_STD`). The method and the
model these options configure are described in :mod:`train_zoo.methods.rank1`; this
module is apart because it needs no network and no tensor: the option table and the
numerical pieces (:mod:`~train_zoo.methods.rank1_factors`,
:mod:`~train_zoo.methods.rank1_training`) read it. Every name is re-exported by
:mod:`train_zoo.methods.rank1`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from posteriorzoo.errors import UnknownNameError
from posteriorzoo.options import check_constraints
from posteriorzoo.vocabulary import (
    RANK1_COMPONENT_KL,
    RANK1_DISTRIBUTIONS,
    RANK1_INIT_STD,
    options_of,
)

__all__ = [
    "COMPONENT_KL",
    "DISTRIBUTIONS",
    "INIT_STD",
    "OPTION_HELP",
    "Rank1Options",
    "resolve_options",
]

#: The families of the posterior's components (and of the prior), how the components' KL
#: terms are combined (:mod:`train_zoo.methods.rank1`'s docstring), and the reference's
#: initial scale ``sqrt(p / (1 - p))`` for its dropout-rate flag ``p = 1e-3`` (about
#: 0.0316): the vocabulary's, as every option's name, constraints, default and help.
DISTRIBUTIONS, COMPONENT_KL, INIT_STD = RANK1_DISTRIBUTIONS, RANK1_COMPONENT_KL, RANK1_INIT_STD

_DECLARED = {option.name: option for option in options_of("rank-1")}
#: One line of help per option of the method (``[method_options]`` of a spec), from the
#: vocabulary's declarations.
OPTION_HELP: dict[str, str] = {name: option.help for name, option in _DECLARED.items()}


def _default(name: str) -> Any:
    """The vocabulary's default of the option ``name``."""
    return _DECLARED[name].default


@dataclass(frozen=True)
class Rank1Options:
    """The method's options, validated on construction (:class:`InvalidOptionError`) by
    the constraints the vocabulary declares (``posteriorzoo.vocabulary.RANK1_OPTIONS``:
    ranges, defaults and help).

    Attributes
    ----------
    components : int
        Mixture components ``K``: the training batch is ``K`` times the mini-batch
        (memory and time); the paper found no gain past 8.
    distribution : {"gaussian", "cauchy"}
    prior_mean : float
        A factor scales a whole channel.
    prior_scale : float
    init_std : float
        Initial ``softplus(rho)`` (default :data:`INIT_STD`).
    sign_probability : float
        ``P(+1)`` of the initial locations.
    kl_annealing : float
        0 gives the whole KL from the first step.
    l2 : float
    component_kl : {"sum", "mean"}
    clip : float
    layers : tuple of str or None
        Module names (``model.named_modules()``) of the rank-1 layers; None: every
        Conv2d and Linear layer.
    """

    components: int = _default("components")
    distribution: str = _default("distribution")
    prior_mean: float = _default("prior_mean")
    prior_scale: float = _default("prior_scale")
    init_std: float = _default("init_std")
    sign_probability: float = _default("sign_probability")
    kl_annealing: float = _default("kl_annealing")
    l2: float = _default("l2")
    component_kl: str = _default("component_kl")
    clip: float = _default("clip")
    layers: tuple[str, ...] | None = field(default=_default("layers"))

    def __post_init__(self) -> None:
        # The vocabulary's constraints (their reasons there); layers None: every layer.
        for name, option in _DECLARED.items():
            value = getattr(self, name)
            if name == "layers" and value is None:
                continue
            checked = check_constraints(name, value, option.constraints)
            if name == "layers":
                object.__setattr__(self, "layers", tuple(checked))

    def record(self) -> dict[str, object]:
        """Every option as plain JSON-able values (what a run records)."""
        values = asdict(self)
        values["layers"] = None if self.layers is None else list(self.layers)
        return values


def resolve_options(options: Mapping[str, Any]) -> dict[str, object]:
    """A spec's ``[method_options]`` for Rank-1, checked and completed with the defaults:
    what a collection records (:meth:`Rank1Options.record`).

    Raises
    ------
    UnknownNameError
        An option Rank-1 does not have (:data:`OPTION_HELP` lists them).
    InvalidOptionError
        A bad value; the message starts with the option's name.
    """
    unknown = sorted(set(options) - set(OPTION_HELP))
    if unknown:
        raise UnknownNameError(f"unknown rank1 option(s) {unknown}; options: "
                               f"{', '.join(OPTION_HELP)}")
    return Rank1Options(**options).record()
