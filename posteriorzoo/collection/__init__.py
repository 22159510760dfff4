"""The collection layer: every operation on collection files, in one place.

Each function takes a path or an open :class:`~posteriorzoo.zoo.Zoo`, validates its
options once, and returns a :class:`~posteriorzoo.collection.results.CollectionResult`
(``to_dict()``, ``write(out)``, ``provenance``). The numerical work is done by the pure
cores (:mod:`posteriorzoo.symmetry`, :mod:`posteriorzoo.mmd`, :mod:`posteriorzoo.metrics`),
which never open files; the CLI only parses arguments, calls these and prints.

>>> from posteriorzoo.collection import describe
>>> info = describe("target.h5")
>>> info.checkpoints, info.attributes["method"]
"""

from posteriorzoo.collection.compare import CompatibilityWarning, compare
from posteriorzoo.collection.comparison_report import ComparisonReport
from posteriorzoo.collection.describe import Description, describe
from posteriorzoo.collection.results import CollectionResult

__all__ = ["CollectionResult", "CompatibilityWarning", "ComparisonReport", "Description",
           "compare", "describe"]
