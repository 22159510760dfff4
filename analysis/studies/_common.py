"""What the studies share: a result that writes its JSON, CSV tables and figure.

A study result is a :class:`posteriorzoo.results.CollectionResult` (``to_dict()``,
``write(out)``, ``provenance``) that also draws a figure. :meth:`StudyResult.write_into`
writes ``<kind>.json``, the CSV tables and the figure as PNG and PDF, each under a
temporary name in the folder and moved into place with ``os.replace``; the JSON lists
every other file with its SHA-256.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import secrets
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from posteriorzoo.results import CollectionResult

#: Resolution of the PNG figures (dots per inch).
PNG_DPI = 150


def _atomic_write(path: Path, data: bytes) -> None:
    """Write ``data`` to a temporary name next to ``path``, then rename it into place."""
    temporary = path.with_name(f".{path.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}")
    try:
        temporary.write_bytes(data)
        os.replace(temporary, path)
    finally:
        if temporary.exists():
            temporary.unlink()


@dataclass
class StudyResult(CollectionResult):
    """Base class of the study results: subclasses set :attr:`kind` and :attr:`figure_name`
    and implement :meth:`payload`, :meth:`tables` and :meth:`figure`."""

    kind: ClassVar[str] = "study"
    figure_name: ClassVar[str] = "figure"

    def figure(self) -> Any:
        """The study's figure, a :class:`matplotlib.figure.Figure` (no pyplot state)."""
        raise NotImplementedError

    def figure_files(self) -> dict[str, bytes]:
        """The figure rendered as ``<figure_name>.png`` and ``<figure_name>.pdf``."""
        figure = self.figure()
        files = {}
        for extension, options in (("png", {"dpi": PNG_DPI, "metadata": {"Software": None}}),
                                   ("pdf", {"metadata": {"CreationDate": None}})):
            buffer = io.BytesIO()
            figure.savefig(buffer, format=extension, **options)
            files[f"{self.figure_name}.{extension}"] = buffer.getvalue()
        return files

    def write_into(self, folder: str | os.PathLike) -> dict[str, Path]:
        """Write the JSON, the tables and the figure into an existing folder."""
        folder = Path(folder)
        files: dict[str, bytes] = {name: text.encode("utf-8")
                                   for name, text in self.tables().items()}
        files.update(self.figure_files())
        data = {**self.to_dict(),
                "files": {name: hashlib.sha256(blob).hexdigest()
                          for name, blob in files.items()}}
        files = {f"{self.kind}.json": (json.dumps(data, indent=1, default=str)
                                       + "\n").encode("utf-8"), **files}
        paths = {}
        for name, blob in files.items():
            paths[name] = folder / name
            _atomic_write(paths[name], blob)
        return paths


def summary_stats(values: Any) -> Mapping[str, float | None]:
    """min, median, mean, max of an array (floats); None each (unavailable) when it is
    empty."""
    import numpy as np

    values = np.asarray(values, dtype=np.float64)
    if values.size == 0:
        return {"min": None, "median": None, "mean": None, "max": None}
    return {"min": float(values.min()), "median": float(np.median(values)),
            "mean": float(values.mean()), "max": float(values.max())}
