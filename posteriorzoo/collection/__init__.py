"""The collection layer: every operation on collection files, in one place.

Describe (:func:`describe`), diagnose (:func:`diagnose`), verify (:func:`verify`),
canonicalize and min-mass
(:func:`canonicalize`, :func:`min_mass`), compare (:func:`compare`; as resumable
tiles, also on Ray: :func:`compare_tiles`), import and export
(:func:`import_checkpoints`, :func:`export_checkpoint`, :func:`export_all`) and evaluate
(:func:`evaluate`, also against reference predictives, such as one read from a
competition-style probability file by :func:`read_reference_predictive`). Each function
takes a path or an open :class:`~posteriorzoo.zoo.Zoo`
(import: the path of the collection to create or append to), validates its options once,
and returns a :class:`~posteriorzoo.results.CollectionResult` (``to_dict()``,
``write(out)``, ``provenance``). The numerical work is done by the pure
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
from posteriorzoo.collection.diagnosis import DiagnoseResult, diagnose
from posteriorzoo.collection.evaluation import EvaluateResult, evaluate
from posteriorzoo.collection.exchange import (
    ExportResult,
    ImportResult,
    export_all,
    export_checkpoint,
    import_checkpoints,
    plan_import,
)
from posteriorzoo.collection.reference_predictive import read_reference_predictive
from posteriorzoo.collection.tiles import compare_tiles
from posteriorzoo.collection.verification import VerifyResult, require_ok, verify
from posteriorzoo.results import CollectionResult

__all__ = ["CanonicalizeResult", "CollectionResult", "CompareResult", "CompatibilityWarning",
           "DescribeResult", "DiagnoseResult", "EvaluateResult", "ExportResult",
           "ImportResult", "MinMassResult", "VerifyResult", "canonicalize", "compare",
           "compare_tiles",
           "describe", "diagnose", "evaluate", "export_all", "export_checkpoint",
           "import_checkpoints", "min_mass", "plan_import", "read_reference_predictive",
           "require_ok", "verify"]
