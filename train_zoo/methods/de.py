"""Deep Ensembles: a mode is one independently trained base network, stored as it is.

The target posterior of the reference zoo is made this way too (many members). There are
no options; each member is its own mode (``samples_per_mode = 1``).
"""

from __future__ import annotations

from typing import Any

from posteriorzoo.options import check_integer
from train_zoo.methods.base import Method, ModeRun, Posterior, StateDict

__all__ = ["METHOD", "DeepEnsemble"]


class DeepEnsemble(Method):
    """Deep Ensembles (module docstring)."""

    name = "de"
    summary = "independently trained networks (deep-ensemble members, the target)"
    one_sample_per_mode = True
    vectorisable = True

    def fit(self, run: ModeRun) -> Posterior:
        model, steps = run.engine.train_base()
        return Posterior(model, steps, run.engine.name)

    def sample(self, state: Any, generator: Any, count: int) -> list[StateDict]:
        """The trained network itself (``count`` is 1; ``generator`` is not used)."""
        check_integer("de option 'count'", count, 1, 1)
        return [state.state_dict()]


METHOD = DeepEnsemble()
