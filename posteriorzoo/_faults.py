"""Fault injection for the crash tests: die by SIGKILL at a named point of a command.

Writing commands call :func:`fault_point` at their commit points (a checkpoint block
committed, a layer finished, a temporary output about to be published). When the
environment variable ``POSTERIORZOO_KILL_AT`` is ``NAME`` or ``NAME:K``, the process kills
itself with SIGKILL the K-th time (default 1st) it reaches point ``NAME``. The crash
tests use this instead of sleeps, so every kill lands at a chosen moment. Without the
variable a call costs one dictionary lookup.
"""

from __future__ import annotations

import os
import signal

_VARIABLE = "POSTERIORZOO_KILL_AT"
_hits: dict[str, int] = {}


def fault_point(name: str) -> None:
    """Reached point ``name``: SIGKILL this process if the environment asks for it here."""
    wanted = os.environ.get(_VARIABLE)
    if not wanted:
        return
    point, _, count = wanted.partition(":")
    if point != name:
        return
    _hits[name] = _hits.get(name, 0) + 1
    if _hits[name] == int(count or 1):
        os.kill(os.getpid(), signal.SIGKILL)
