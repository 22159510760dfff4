"""Validation of option values: the one helper set every public entry point uses.

Each check raises :class:`~posteriorzoo.errors.InvalidOptionError` with one line that
names the option and shows the bad value, and returns the value unchanged (an integer
learning rate stays an integer, so what a result records is exactly what was asked
for). Option values that name a choice are string enums checked by :func:`check_choice`.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping, Sequence
from typing import Any

from posteriorzoo.errors import InvalidOptionError
from posteriorzoo.vocabulary import Boolean, Choices, Constraint, Interval, Names

__all__ = ["check_bool", "check_choice", "check_constraints", "check_integer", "check_name",
           "check_names", "check_number", "check_probability", "check_table", "is_integer",
           "show"]


def show(value: object, limit: int = 60) -> str:
    """``repr(value)`` on one line, shortened to about ``limit`` characters."""
    text = " ".join(repr(value).split())
    return text if len(text) <= limit else text[:limit - 3] + "..."


def is_integer(value: object) -> bool:
    """An integer that is not a bool (TOML ``true`` is not a count)."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def check_integer(what: str, value: object, minimum: int, maximum: int | None = None) -> int:
    """``value`` if it is an integer >= ``minimum`` (and <= ``maximum`` when given)."""
    if not is_integer(value) or value < minimum or (maximum is not None and value > maximum):
        wanted = f">= {minimum}" if maximum is None else f"in [{minimum}, {maximum}]"
        raise InvalidOptionError(f"{what} must be an integer {wanted}, not {show(value)}")
    return int(value)


def check_number(what: str, value: object, minimum: float, *, strict: bool = False,
                 maximum: float | None = None, strict_maximum: bool = False) -> Any:
    """``value`` if it is a finite real number >= ``minimum`` (> with ``strict``) and, when
    given, <= ``maximum`` (< with ``strict_maximum``)."""
    ok = (isinstance(value, numbers.Real) and not isinstance(value, bool)
          # an integer is finite however large (math.isfinite would overflow on 10**400)
          and (isinstance(value, numbers.Integral) or math.isfinite(value))
          and (value > minimum if strict else value >= minimum)
          and (maximum is None or (value < maximum if strict_maximum else value <= maximum)))
    if not ok:
        low = f"{'(' if strict else '['}{minimum:g}"
        if maximum is None:
            wanted = f"{'>' if strict else '>='} {minimum:g}"
        else:
            wanted = f"in {low}, {maximum:g}{')' if strict_maximum else ']'}"
        raise InvalidOptionError(f"{what} must be a finite number {wanted}, not {show(value)}")
    return value


def check_probability(what: str, value: object) -> float:
    """``value`` as a ``float`` in ``[0, 1)`` (a dropout rate: 1 would zero every unit)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not 0 <= value < 1:
        raise InvalidOptionError(f"{what} must be a number in [0, 1), not {show(value)}")
    return float(value)


def check_bool(what: str, value: object) -> bool:
    """``value`` if it is true or false."""
    if not isinstance(value, bool):
        raise InvalidOptionError(f"{what} must be true or false, not {show(value)}")
    return value


def check_name(what: str, value: object, choices: tuple[str, ...] = ()) -> str:
    """``value`` if it is a non-empty string (one of ``choices`` when given)."""
    if not isinstance(value, str) or not value:
        raise InvalidOptionError(f"{what} must be a non-empty string, not {show(value)}")
    if choices and value not in choices:
        raise InvalidOptionError(f"{what} must be one of {', '.join(choices)}, not {show(value)}")
    return value


def check_table(what: str, value: object) -> dict[str, Any]:
    """``value`` as a dict if it is a mapping with string keys (a TOML table)."""
    if not isinstance(value, Mapping) or not all(isinstance(k, str) for k in value):
        raise InvalidOptionError(f"{what} must be a table of named values, not {show(value)}")
    return dict(value)


def check_choice(what: str, value: object, choices: tuple[str, ...]) -> str:
    """``value`` if it is one of the string enum ``choices``."""
    if not isinstance(value, str) or value not in choices:
        raise InvalidOptionError(f"{what} must be one of {', '.join(choices)}, not {show(value)}")
    return value


def check_num_gpus(value: object) -> float:
    """GPUs per Ray task as Ray can grant them: 0, a fraction in (0, 1), or a whole
    number; else InvalidOptionError (Ray shares a GPU only in fractions below 1)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise InvalidOptionError(f"num_gpus must be a number, not {show(value)}")
    if not math.isfinite(value) or value < 0:
        raise InvalidOptionError(f"num_gpus must be a finite number >= 0, not {value}")
    if value > 1 and value != int(value):
        raise InvalidOptionError(f"num_gpus above 1 must be a whole number of GPUs (Ray "
                                 f"shares a GPU only in fractions below 1), not {value}")
    return float(value)


def check_names(what: str, value: object) -> list[str]:
    """``value`` as a list if it is a non-empty list of distinct non-empty names."""
    if isinstance(value, str) or not isinstance(value, Sequence):
        raise InvalidOptionError(f"{what} must be a list of layer names, not {show(value)}")
    names = [check_name(what, name) for name in value]
    if not names:
        raise InvalidOptionError(f"{what} must name at least one layer")
    if len(set(names)) != len(names):
        raise InvalidOptionError(f"{what} names a layer twice: {show(names)}")
    return names


def _check_one(what: str, value: object, constraint: Constraint,
               resolved: Mapping[str, Any] | None) -> Any:
    if isinstance(constraint, Interval):
        low, high = constraint.bounds(resolved)
        if constraint.kind == "integer":  # closed ends of whole numbers
            low = low if constraint.closed_low else low + 1
            high = high if high is None or constraint.closed_high else high - 1
            return check_integer(what, value, int(low), None if high is None else int(high))
        return check_number(what, value, low, strict=not constraint.closed_low,
                            maximum=high, strict_maximum=not constraint.closed_high)
    if isinstance(constraint, Choices):
        return check_choice(what, value, constraint.values)
    if isinstance(constraint, Boolean):
        return check_bool(what, value)
    if isinstance(constraint, Names):
        return check_names(what, value)
    raise TypeError(f"unknown constraint {constraint!r}")


def _wanted(constraint: Constraint, resolved: Mapping[str, Any] | None) -> str:
    """What ``constraint`` asks for, as the message of an any-of says it."""
    if isinstance(constraint, Choices):
        return ", ".join(repr(value) for value in constraint.values)
    if isinstance(constraint, Interval):
        low, high = constraint.bounds(resolved)
        kind = "an integer" if constraint.kind == "integer" else "a finite number"
        if high is None:
            return f"{kind} {'>=' if constraint.closed_low else '>'} {low:g}"
        return (f"{kind} in {'[' if constraint.closed_low else '('}{low:g}, {high:g}"
                f"{']' if constraint.closed_high else ')'}")
    return constraint.text()


def check_constraints(what: str, value: object, constraints: Sequence[Constraint],
                      resolved: Mapping[str, Any] | None = None) -> Any:
    """``value`` (as the first constraint that accepts it returns it) if one of the
    declared ``constraints`` (:mod:`posteriorzoo.vocabulary`) accepts it.

    One constraint refuses with its own check's message (:func:`check_integer`,
    :func:`check_number`, :func:`check_choice`, :func:`check_bool`, :func:`check_names`);
    several (an any-of) with one line naming them all, e.g. ``... must be 'training' or a
    finite number in [1e-08, 1e+08], not 'x'``. ``resolved`` holds the options resolved
    before this one, read by an :class:`~posteriorzoo.vocabulary.Interval` whose bound
    names one.
    """
    if len(constraints) == 1:
        return _check_one(what, value, constraints[0], resolved)
    for constraint in constraints:
        try:
            return _check_one(what, value, constraint, resolved)
        except InvalidOptionError:
            continue
    wanted = [_wanted(constraint, resolved) for constraint in constraints]
    joined = wanted[0] if len(wanted) == 1 else f"{', '.join(wanted[:-1])} or {wanted[-1]}"
    raise InvalidOptionError(f"{what} must be {joined}, not {show(value)}")
