"""The display names of methods: the report's rows and the key of every figure's style.

A light module (no matplotlib), so that the report without figures and the figures' styles
(:mod:`analysis.figures.styles`) name a collection the same way.
"""

from __future__ import annotations

from typing import Any

from posteriorzoo.vocabulary import METHODS

__all__ = ["METHOD_LABELS", "collection_label"]

#: Display names of the methods (multi-mode versions get "MM-"), the vocabulary's.
METHOD_LABELS = {name: info.label for name, info in METHODS.items()}


def collection_label(zoo: Any) -> str:
    """The display name of an open collection's method: ``SWAG``, ``MM-SWAG`` (a
    multi-mode version: several runs), ``BBB (trained-variance)`` or ``Laplace (kfac)`` (a version
    other than the paper's: the method's ``variant`` option in the vocabulary); a method
    without a display name is named as the file records it.

    Parameters
    ----------
    zoo : posteriorzoo.zoo.Zoo
        An open collection (its ``method``, ``annotations`` and ``recipe`` are read).
    """
    label = METHOD_LABELS.get(zoo.method, zoo.method)
    info = METHODS.get(zoo.method)
    if info is not None and info.variant is not None:
        option, usual = info.variant
        value = ((zoo.recipe or {}).get("method_options") or {}).get(option)
        if isinstance(value, str) and value != usual:   # unrecorded: the paper's version
            label = f"{label} ({value})"
    # "MM-" names a multi-mode version, several runs of the method (``modes`` > 1); a
    # collection of one run whose samples were measured to sit in several modes (SVGD's
    # particles, ``posteriorzoo annotate``) keeps the method's name in the multi-mode group
    annotations = zoo.annotations
    several_runs = annotations.get("modes", 2) > 1
    return (f"MM-{label}" if annotations.get("posterior") == "multi-mode" and several_runs
            else label)
