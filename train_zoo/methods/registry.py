"""The methods of the trainer, by name: the one place that lists them.

Specs (:mod:`train_zoo.spec`), option validation and listing
(:mod:`train_zoo.method_options`, ``posteriorzoo train --list-options``), the runs
(:mod:`train_zoo.programs`, :mod:`train_zoo.run`, :mod:`train_zoo.job`) read this table;
nothing else names a method. A new method is one module of :mod:`train_zoo.methods` with
its :class:`~train_zoo.methods.base.Method` object, plus one line here.
"""

from __future__ import annotations

from posteriorzoo.errors import UnknownNameError
from posteriorzoo.options import show
from train_zoo.methods import bbb, de, dropout, emp, laplace, rank1, sghmc, swag
from train_zoo.methods.base import Method

__all__ = ["METHODS", "REGISTRY", "get_method"]

#: Every method by name, in the order they are listed.
REGISTRY: dict[str, Method] = {method.name: method for method in (
    de.METHOD,
    dropout.METHOD,
    swag.METHOD,
    laplace.METHOD,
    sghmc.METHOD,
    bbb.METHOD,
    emp.METHOD,
    emp.ECMP,
    rank1.METHOD,
)}
#: The names, in order.
METHODS: tuple[str, ...] = tuple(REGISTRY)


def get_method(name: object) -> Method:
    """The method called ``name``.

    Raises
    ------
    UnknownNameError
        No method has that name (the message lists them).
    """
    if not isinstance(name, str) or name not in REGISTRY:
        raise UnknownNameError(f"unknown method {show(name)}; the trainer implements "
                               f"{', '.join(METHODS)}")
    return REGISTRY[name]
