"""Validation of numeric architecture options shared by the model factories."""

from __future__ import annotations

import numbers

from posteriorzoo.errors import InvalidOptionError


def positive_int(value: object, what: str) -> int:
    """``value`` as an ``int`` if it is an integer >= 1, else raise ``InvalidOptionError``."""
    # bool is an int subclass; True silently meaning 1 channel would hide a bug.
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise InvalidOptionError(f"{what} must be a positive integer, got {value!r}")
    return int(value)


def probability(value: object, what: str) -> float:
    """Return ``value`` as a ``float`` in ``[0, 1)``, else raise ``InvalidOptionError``."""
    # p = 1 would zero every activation and make the network constant.
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not 0 <= value < 1:
        raise InvalidOptionError(f"{what} must be a number in [0, 1), got {value!r}")
    return float(value)
