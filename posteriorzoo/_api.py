"""One check of every public entry point's arguments, before the function runs.

:func:`public` wraps a function so that a call with an unknown or missing argument, or a
value whose type does not match the annotation, raises
:class:`~posteriorzoo.errors.InvalidOptionError` with one line naming the function and the
parameter, instead of a ``TypeError`` (or an ``AttributeError`` deep inside). Types are
checked by beartype (``is_bearable``) against the resolved annotations, with the numeric
tower (an int is a float) and numpy scalars taken as the Python numbers they are. Values
are then validated by the function itself (ranges, choices).
"""

from __future__ import annotations

import functools
import inspect
import typing
from collections.abc import Callable
from typing import Any, TypeVar

import numpy as np

from posteriorzoo.errors import InvalidOptionError

F = TypeVar("F", bound=Callable[..., Any])
_SHOW = 60


def _show(value: object) -> str:
    text = " ".join(repr(value).split())
    return text if len(text) <= _SHOW else text[:_SHOW - 3] + "..."


def _hint_text(hint: object) -> str:
    text = getattr(hint, "__name__", None) if isinstance(hint, type) else None
    return text or str(hint).replace("typing.", "").replace("collections.abc.", "")


def public(function: F) -> F:
    """Check the arguments of ``function`` on every call (module docstring)."""
    from beartype import BeartypeConf
    from beartype.door import is_bearable

    signature = inspect.signature(function)
    name = f"{function.__name__}()"
    parameters = ", ".join(signature.parameters)
    conf = BeartypeConf(is_pep484_tower=True)
    hints: dict[str, object] | None = None

    def resolved() -> dict[str, object]:
        nonlocal hints
        if hints is None:
            try:
                hints = typing.get_type_hints(function)
            except Exception:  # an annotation that cannot be resolved is not checked
                hints = {}
            hints.pop("return", None)
        return hints

    @functools.wraps(function)
    def checked(*args: Any, **kwargs: Any) -> Any:
        try:
            bound = signature.bind(*args, **kwargs)
        except TypeError as error:
            raise InvalidOptionError(f"{name}: {error}; its parameters: {parameters}") from None
        for parameter, value in bound.arguments.items():
            hint = resolved().get(parameter)
            kind = signature.parameters[parameter].kind
            if hint is None or kind in (inspect.Parameter.VAR_POSITIONAL,
                                        inspect.Parameter.VAR_KEYWORD):
                continue
            plain = value.item() if isinstance(value, np.generic) else value
            if not is_bearable(plain, hint, conf=conf):
                raise InvalidOptionError(f"{name}: {parameter} must be {_hint_text(hint)}, "
                                         f"not {_show(value)}")
        return function(*args, **kwargs)

    checked.__posteriorzoo_public__ = True  # type: ignore[attr-defined]
    return typing.cast(F, checked)
