"""The methods of the trainer, by name: the objects that
:data:`posteriorzoo.vocabulary.METHODS` names (its ``trainer`` field), loaded.

Specs (:mod:`train_zoo.spec`), option validation and listing
(:mod:`train_zoo.method_options`, ``posteriorzoo train --list-options``), the runs
(:mod:`train_zoo.programs`, :mod:`train_zoo.run`, :mod:`train_zoo.job`) read this table;
labels, styles and ``diagnose`` read the vocabulary. A new method is one module of
:mod:`train_zoo.methods` with its :class:`~train_zoo.methods.base.Method` object, plus
its entry in the vocabulary.
"""

from __future__ import annotations

import importlib

from posteriorzoo.errors import UnknownNameError
from posteriorzoo.options import show
from posteriorzoo.vocabulary import METHODS as METHOD_INFO
from train_zoo.methods.base import Method

__all__ = ["METHODS", "REGISTRY", "get_method"]


def _load(name: str, trainer: str) -> Method:
    """The trainer's object ``"module:attribute"`` of the method called ``name``."""
    module, attribute = trainer.split(":")
    method = getattr(importlib.import_module(module), attribute)
    if method.name != name:
        raise RuntimeError(f"{trainer} is method {method.name!r}, the vocabulary says {name!r}")
    return method


#: Every method by name, in the vocabulary's order (posteriorzoo.vocabulary.METHODS).
REGISTRY: dict[str, Method] = {name: _load(name, info.trainer)
                               for name, info in METHOD_INFO.items()}
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
