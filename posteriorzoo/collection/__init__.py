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

from posteriorzoo.collection.canonicalization import (
    CanonicalizeResult,
    MinMassResult,
    canonicalize,
    min_mass,
)
from posteriorzoo.collection.comparison import CompatibilityWarning, compare
from posteriorzoo.collection.comparison_result import CompareResult
from posteriorzoo.collection.description import DescribeResult, describe
from posteriorzoo.collection.evaluation import EvaluateResult, evaluate
from posteriorzoo.collection.results import CollectionResult

__all__ = ["CanonicalizeResult", "CollectionResult", "CompareResult", "CompatibilityWarning",
           "DescribeResult", "EvaluateResult", "MinMassResult", "canonicalize", "compare",
           "describe", "evaluate", "min_mass"]
