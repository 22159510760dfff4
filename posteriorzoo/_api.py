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

import contextvars
import functools
import inspect
import typing
from collections.abc import Callable
from typing import Any, TypeVar

import numpy as np

from posteriorzoo.errors import InvalidOptionError, UnknownNameError

F = TypeVar("F", bound=Callable[..., Any])
#: How many public calls are under way in this context (only the outermost explains).
_DEPTH: contextvars.ContextVar[int] = contextvars.ContextVar("posteriorzoo_api_depth",
                                                             default=0)
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

    named = ", ".join(p.name for p in signature.parameters.values()
                      if p.kind is not inspect.Parameter.VAR_KEYWORD)
    takes_any_keyword = any(p.kind is inspect.Parameter.VAR_KEYWORD
                            for p in signature.parameters.values())

    @functools.wraps(function)
    def checked(*args: Any, **kwargs: Any) -> Any:
        unknown = [] if takes_any_keyword else [k for k in kwargs
                                                if k not in signature.parameters]
        if unknown:  # a misspelled keyword is named before anything else is said
            raise InvalidOptionError(f"{name}: unknown argument {unknown[0]!r}; its "
                                     f"parameters: {parameters}")
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
        if not takes_any_keyword:
            return function(*args, **kwargs)
        outermost = _DEPTH.get() == 0
        token = _DEPTH.set(_DEPTH.get() + 1)
        try:
            return function(*args, **kwargs)
        except UnknownNameError as error:
            # Extra keywords are passed on (e.g. as model options); one refused there may
            # be a misspelled argument of the function the user called: say which exist.
            extra = [key for key in kwargs if key not in signature.parameters]
            if outermost and any(repr(key) in str(error) for key in extra):
                raise UnknownNameError(f"{error} (nor an argument of {name}: "
                                       f"{named})") from None
            raise
        finally:
            _DEPTH.reset(token)

    checked.__posteriorzoo_public__ = True  # type: ignore[attr-defined]
    return typing.cast(F, checked)
