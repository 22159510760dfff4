"""Describe a collection file: what ``posteriorzoo info`` prints."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from posteriorzoo._api import public
from posteriorzoo.collection._open import (
    Source,
    architecture_fit,
    content_digest,
    opened,
    source_path,
)
from posteriorzoo.provenance import record
from posteriorzoo.results import CollectionResult, csv_text

__all__ = ["DescribeResult", "describe"]


def _summary(values: np.ndarray) -> dict[str, float] | None:
    finite = values[np.isfinite(values)]
    if finite.size == 0:
        return None
    return {"min": float(finite.min()), "median": float(np.median(finite)),
            "max": float(finite.max())}


@dataclass
class DescribeResult(CollectionResult):
    """What a collection holds.

    Attributes
    ----------
    path : str
    attributes : dict
        architecture, dataset, method, num_classes, model_options, recipe, annotations
        (what was derived, e.g. symmetries removed: canonical and raw files differ here),
        created_by.
    checkpoints : int
    tensors : list of dict
        key, shape, dtype, count (values per checkpoint), chunk_rows.
    metadata : dict
        Seeds range, distinct seeds, modes, diverged count and min / median / max of test
        accuracy, test loss (nats) and wall time (seconds). ``seeds`` and ``modes`` are
        None when no checkpoint records one (imports of foreign files).
    fits_architecture : bool or None
        Whether the stored keys, shapes and dtypes fit the registered architecture (a
        collection created with ``validate=False`` is not checked when it opens, and the
        commands that build its network refuse it when they do not); None when the
        architecture is not registered here.
    architecture_problem : str or None
        Why they do not fit, or why it cannot be told.
    """

    kind = "description"
    path: str
    attributes: dict[str, Any]
    checkpoints: int
    tensors: list[dict[str, Any]]
    metadata: dict[str, Any]
    fits_architecture: bool | None = None
    architecture_problem: str | None = None

    @property
    def values_per_checkpoint(self) -> int:
        return sum(t["count"] for t in self.tensors)

    def payload(self) -> dict[str, Any]:
        return {"path": self.path, **self.attributes, "checkpoints": self.checkpoints,
                "values_per_checkpoint": self.values_per_checkpoint,
                "tensors": self.tensors, "metadata": self.metadata,
                "fits_architecture": self.fits_architecture,
                "architecture_problem": self.architecture_problem}

    def tables(self) -> dict[str, str]:
        return {"tensors.csv": csv_text(
            ["key", "shape", "dtype", "count", "chunk_rows"],
            ([t["key"], "x".join(map(str, t["shape"])), t["dtype"], t["count"],
              t["chunk_rows"]] for t in self.tensors))}


@public
def describe(source: Source, *, verify: bool = True, command: str | None = None
             ) -> DescribeResult:
    """Describe a collection.

    Parameters
    ----------
    source : path or Zoo
    verify : bool, default True
        Check every checkpoint against its digests first, so a corrupt collection is
        refused (:class:`~posteriorzoo.errors.PosteriorZooError`) rather than described.
    command : str, optional
        Recorded in the provenance.
    """
    with opened(source, verify=verify) as zoo:
        if verify:
            zoo.verify_all()
        metadata = zoo.metadata
        tensors = [{"key": key, "shape": list(shape), "dtype": str(dtype),
                    "count": int(np.prod(shape, dtype=np.int64)),
                    "chunk_rows": int(zoo.dataset_handle(key).chunks[0])}
                   for key, (shape, dtype) in zoo.tensor_layout.items()]
        seeds = metadata["seed"][metadata["seed"] >= 0]
        modes = metadata["mode_id"][metadata["mode_id"] >= 0]
        attributes = {"architecture": zoo.architecture, "dataset": zoo.dataset,
                      "method": zoo.method, "num_classes": zoo.num_classes,
                      "model_options": zoo.model_options, "recipe": zoo.recipe,
                      "annotations": zoo.annotations, "created_by": zoo.created_by}
        summary = {
            "seeds": None if seeds.size == 0 else [int(seeds.min()), int(seeds.max())],
            "distinct_seeds": int(np.unique(seeds).size),
            "modes": int(np.unique(modes).size) if modes.size else None,  # None: unknown
            "diverged": int(metadata["diverged"].sum()),
            "test_accuracy": _summary(metadata["test_accuracy"]),
            "test_loss": _summary(metadata["test_loss"]),
            "wall_time_seconds": _summary(metadata["wall_time"]),
        }
        path = source_path(source)
        fits, problem = architecture_fit(zoo)
        return DescribeResult(
            str(path), attributes, len(zoo), tensors, summary, fits, problem,
            provenance=record("posteriorzoo info", command=command,
                              inputs={"collection": {"path": str(path),
                                                     "content_sha256": content_digest(zoo)}},
                              options={"verify": verify}))
