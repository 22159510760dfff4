"""Rank-1 BNNs' options: their names, help, defaults and checks.

:class:`Rank1Options` (validated on construction), :data:`OPTION_HELP`,
:func:`resolve_options` (what a collection records) and the choices and defaults they
name (:data:`DISTRIBUTIONS`, :data:`COMPONENT_KL`, :data:`INIT_STD`). The method and the
model these options configure are described in :mod:`train_zoo.methods.rank1`; this
module is apart because it needs no network and no tensor: the option table and the
numerical pieces (:mod:`~train_zoo.methods.rank1_factors`,
:mod:`~train_zoo.methods.rank1_training`) read it. Every name is re-exported by
:mod:`train_zoo.methods.rank1`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from posteriorzoo.errors import InvalidOptionError, UnknownNameError
from posteriorzoo.options import (
    check_choice,
    check_integer,
    check_name,
    check_number,
    show,
)

__all__ = [
    "COMPONENT_KL",
    "DISTRIBUTIONS",
    "INIT_STD",
    "OPTION_HELP",
    "Rank1Options",
    "resolve_options",
]

#: The families of the posterior's components (and of the prior).
DISTRIBUTIONS = ("gaussian", "cauchy")
#: How the components' KL terms are combined (:mod:`train_zoo.methods.rank1`'s
#: docstring).
COMPONENT_KL = ("sum", "mean")
#: The reference's initial scale: ``sqrt(p / (1 - p))`` for its dropout-rate flag
#: ``p = 1e-3`` (about 0.0316).
INIT_STD = math.sqrt(1e-3 / (1 - 1e-3))

#: One line of help per option of the method (``[method_options]`` of a spec).
OPTION_HELP: dict[str, str] = {
    "components": "mixture components K; the batch is tiled K times (default 4)",
    "distribution": "family of the components and the prior: gaussian or cauchy "
                    "(default gaussian)",
    "prior_mean": "location of the prior on every factor of r and s (default 1)",
    "prior_scale": "scale of the prior: its standard deviation, or the Cauchy's scale "
                   "(default 0.1)",
    "init_std": f"initial scale softplus(rho) of every factor (default {INIT_STD:.4g})",
    "sign_probability": "probability that an initial location is +1 rather than -1 "
                        "(default 0.5)",
    "kl_annealing": "fraction of training over which the KL's factor rises linearly to 1 "
                    "(default 0.8)",
    "l2": "L2 penalty l2 * sum(theta^2) on the point estimates (default 1e-4)",
    "component_kl": "KL over the components: sum (the reference's) or mean (default sum)",
    "clip": "draws of r and s are clipped to [-clip, clip] (default 10)",
    "layers": "names of the Conv2d and Linear layers that get r and s (default: all)",
}


@dataclass(frozen=True)
class Rank1Options:
    """The method's options, validated on construction (:class:`InvalidOptionError`).

    Attributes
    ----------
    components : int, default 4
        Mixture components ``K``, 1 to 64: the training batch is ``K`` times the
        mini-batch (memory and time); the paper found no gain past 8.
    distribution : {"gaussian", "cauchy"}, default "gaussian"
    prior_mean : float, default 1.0
        In [-100, 100]: a factor scales a whole channel.
    prior_scale : float, default 0.1
        In (0, 10].
    init_std : float, default :data:`INIT_STD`
        Initial ``softplus(rho)``, in (0, 10].
    sign_probability : float, default 0.5
        ``P(+1)`` of the initial locations, in [0, 1].
    kl_annealing : float, default 0.8
        In [0, 1]; 0 gives the whole KL from the first step.
    l2 : float, default 1e-4
        In [0, 1].
    component_kl : {"sum", "mean"}, default "sum"
    clip : float, default 10.0
        In (0, 1e6].
    layers : tuple of str or None, default None
        Module names (``model.named_modules()``) of the rank-1 layers; None: every
        Conv2d and Linear layer.
    """

    components: int = 4
    distribution: str = "gaussian"
    prior_mean: float = 1.0
    prior_scale: float = 0.1
    init_std: float = INIT_STD
    sign_probability: float = 0.5
    kl_annealing: float = 0.8
    l2: float = 1e-4
    component_kl: str = "sum"
    clip: float = 10.0
    layers: tuple[str, ...] | None = field(default=None)

    def __post_init__(self) -> None:
        check_integer("components", self.components, 1, 64)
        check_choice("distribution", self.distribution, DISTRIBUTIONS)
        check_number("prior_mean", self.prior_mean, -100, maximum=100)
        check_number("prior_scale", self.prior_scale, 0, strict=True, maximum=10)
        check_number("init_std", self.init_std, 0, strict=True, maximum=10)
        check_number("sign_probability", self.sign_probability, 0, maximum=1)
        check_number("kl_annealing", self.kl_annealing, 0, maximum=1)
        check_number("l2", self.l2, 0, maximum=1)
        check_choice("component_kl", self.component_kl, COMPONENT_KL)
        check_number("clip", self.clip, 0, strict=True, maximum=1e6)
        if self.layers is not None:
            if isinstance(self.layers, str) or not isinstance(self.layers, Sequence):
                raise InvalidOptionError(
                    f"layers must be a list of layer names, not {show(self.layers)}")
            names = tuple(check_name("layers", name) for name in self.layers)
            if not names:
                raise InvalidOptionError("layers must name at least one layer")
            if len(set(names)) != len(names):
                raise InvalidOptionError(f"layers names a layer twice: {show(list(names))}")
            object.__setattr__(self, "layers", names)

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
