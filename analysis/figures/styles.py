"""One colour and one marker per method, wherever a figure shows methods.

:func:`collection_style` gives a collection's style from what the file holds (its method,
its preset, its posterior's modes), whatever it is called: the report and ``posteriorzoo
plot`` draw every collection with it, so a method looks the same in both even when a file
name or a ``NAME=PATH`` name says nothing of it. :func:`method_style` maps a name to its
style where no collection is at hand (and for the target, which is a role, not a method):
the report's labels (``SWAG``, ``MM-SWAG``, ``BBB (trained-variance)``,
:func:`analysis.labels.collection_label`) and the shipped files' stems
(``optunet-fashion-mnist-swag-multi-mode``) get the same style, because the style is read
from the method the name mentions:

- the colour says the method (each method's ``colour`` in
  :data:`posteriorzoo.vocabulary.METHODS`, named by its name or its label; BBB with
  trained variance has its own; the target is black);
- the marker says single-mode (circle), multi-mode (square, ``MM-`` or ``multi-mode``)
  or a Deep Ensemble (diamond), and lines are dashed for multi-mode methods;
- ``plot pca --symmetries both`` names its curves ``NAME (raw)`` and ``NAME (canonical)``:
  the same colour and marker, the canonical one dotted.

A name that mentions no known method gets a colour and marker of its own from a stable
digest of the name, the same in every figure and every run.
"""

from __future__ import annotations

import dataclasses
import hashlib
import re
from dataclasses import dataclass
from typing import Any

from analysis.labels import collection_label
from posteriorzoo.vocabulary import METHODS

__all__ = ["MethodStyle", "collection_style", "method_style"]


@dataclass(frozen=True)
class MethodStyle:
    """How a method is drawn: ``colour`` and ``marker`` (matplotlib), ``linestyle``."""

    colour: str
    marker: str
    linestyle: str


#: Preset (as the name spells it) -> colour, checked before the methods: the
#: trained-variance BBB is told from the paper's (a BBB, so a single- or multi-mode one).
_PRESET_COLOURS = {"trained-variance": "#e377c2"}
#: Other words that name a method in a file name.
_ALIASES = {"ensemble": "de"}
#: (word, method): the words a name may use for a method (its name, its label, an
#: alias), in the order checked: every method, Deep Ensembles last (a name that mentions
#: another method too is that method's).
_WORDS = tuple(
    (word, name)
    for name in sorted(METHODS, key=lambda name: METHODS[name].family == "ensemble")
    for word in dict.fromkeys((name, METHODS[name].label.lower(),
                               *(alias for alias, of in _ALIASES.items() if of == name))))
_TARGET = MethodStyle("#000000", "*", "-")
#: Colours and markers of names that mention no known method (none of the above).
_OTHER_COLOURS = ("#7f7f7f", "#637939", "#843c39", "#e7ba52", "#7b4173", "#ad494a")
_OTHER_MARKERS = ("^", "v", "<", ">", "p", "h")


def _words(name: str) -> list[str]:
    return [word for word in re.split(r"[^a-z0-9]+", name.lower()) if word]


def _name_parts(name: str) -> tuple[list[str], bool]:
    """The words of ``name`` less a last ``raw`` or ``canonical``, and whether it was
    ``canonical`` (``plot pca --symmetries both`` names its curves so)."""
    words = _words(name)
    canonical = words[-1:] == ["canonical"]
    return (words[:-1] if words[-1:] in (["raw"], ["canonical"]) else words), canonical


def _target(canonical: bool) -> MethodStyle:
    return dataclasses.replace(_TARGET, linestyle=":") if canonical else _TARGET


def method_style(name: str) -> MethodStyle:
    """The style of the method called ``name`` (a report label or a file stem).

    >>> method_style("MM-SWAG") == method_style("optunet-fashion-mnist-swag-multi-mode")
    True
    """
    words, canonical = _name_parts(name)
    text = "-".join(words)
    if words[-1:] == ["target"]:
        return _target(canonical)
    multi = (bool(words) and words[0] == "mm") or "multi-mode" in text or "multimode" in text

    def mentions(word: str) -> bool:
        return word in text if "-" in word else word in words

    preset = next((colour for word, colour in _PRESET_COLOURS.items() if mentions(word)), None)
    for word, method in _WORDS:
        if mentions(word):
            deep_ensemble = METHODS[method].family == "ensemble"
            marker = "D" if deep_ensemble else "s" if multi else "o"
            return MethodStyle(preset or METHODS[method].colour, marker,
                               _line(multi and not deep_ensemble, canonical))
    if preset:
        return MethodStyle(preset, "s" if multi else "o", _line(multi, canonical))
    digest = hashlib.sha256(" ".join(words).encode("utf-8")).digest()
    return MethodStyle(_OTHER_COLOURS[digest[0] % len(_OTHER_COLOURS)],
                       _OTHER_MARKERS[digest[1] % len(_OTHER_MARKERS)], _line(multi, canonical))


def _line(multi: bool, canonical: bool) -> str:
    return ":" if canonical else "--" if multi else "-"


def collection_style(zoo: Any, name: str = "") -> MethodStyle:
    """The style of an open collection's method (:func:`analysis.labels.collection_label`),
    whatever the file or its figure label ``name`` is called; dotted for a ``name`` that
    ends in ``canonical``, as :func:`method_style`. Being the target is a role no file
    records (the shipped target is a Deep Ensemble's file): a ``name`` that says
    ``target`` keeps the target's style."""
    words, canonical = _name_parts(name)
    if words[-1:] == ["target"]:
        return _target(canonical)
    style = method_style(collection_label(zoo))
    return dataclasses.replace(style, linestyle=":") if canonical else style
