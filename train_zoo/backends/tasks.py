"""How a list of modes is cut into tasks (shared by every backend)."""

from __future__ import annotations

from collections.abc import Sequence

from posteriorzoo.errors import InvalidOptionError


def groups(indices: Sequence[int], size: int) -> list[list[int]]:
    """``indices`` cut into consecutive groups of at most ``size`` (one task each)."""
    if size < 1:
        raise InvalidOptionError("group size must be at least 1")
    indices = list(indices)
    return [indices[start:start + size] for start in range(0, len(indices), size)]
