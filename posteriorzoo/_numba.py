"""Say on stderr, once per process, when numba starts compiling kernels.

The numba kernels (MMD distances and kernel sums, the fast trainer) are compiled on their
first use on a machine and cached on disk (``cache=True``); that first compilation takes
up to a minute, which would otherwise pass in silence. Loading them from the cache
compiles nothing and prints nothing.
"""

from __future__ import annotations

import sys

MESSAGE = ("posteriorzoo: compiling numba kernels (first use on this machine, up to a "
           "minute; cached for later runs)")
_registered = False


#: The packages whose kernels the announcement is about. Libraries that jit-compile
#: without a cache (ArviZ's statistics, compiled in every process) are not announced: the
#: message says "first use on this machine".
OUR_PACKAGES = ("posteriorzoo", "train_zoo", "analysis", "benchmarks")


def _ours(compilation: object) -> bool:
    """Whether a numba compile event is for a function of :data:`OUR_PACKAGES` (or of a
    script run directly, whose module is ``__main__``)."""
    dispatcher = (getattr(compilation, "data", None) or {}).get("dispatcher")
    module = getattr(getattr(dispatcher, "py_func", None), "__module__", None) or ""
    return module == "__main__" or module.split(".")[0] in OUR_PACKAGES


def announce_compilation() -> None:
    """Register the announcement (idempotent); call it where kernels are defined."""
    global _registered
    if _registered:
        return
    from numba.core import event

    class _FirstCompilation(event.Listener):
        said = False

        def on_start(self, compilation: event.Event) -> None:
            if not self.said and _ours(compilation):
                self.said = True
                print(MESSAGE, file=sys.stderr, flush=True)

        def on_end(self, _event: event.Event) -> None:
            pass

    event.register("numba:compile", _FirstCompilation())
    _registered = True
