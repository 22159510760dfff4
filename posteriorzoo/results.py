"""The one family of results the collection layer returns.

A neutral module (it imports only the standard library and :mod:`posteriorzoo.outputs`),
so every layer may build on it. Every operation on collection files (describe, verify,
canonicalize, min-mass, compare, import, export, evaluate) returns a
:class:`CollectionResult`:

- ``to_dict()``: every number as JSON-serialisable data, with ``kind`` and ``provenance``;
- ``write(out)``: a new folder ``out`` with ``<kind>.json`` and the result's own tables
  (CSV files that pandas reads as they are: provenance is in the JSON, never in ``#``
  lines), built under a temporary name and renamed into place when complete (an existing
  folder is replaced only with ``overwrite=True``);
- ``provenance``: :func:`posteriorzoo.provenance.record` (command, versions, git commit,
  input SHA-256s, seeds, options), the same keys for every kind.
"""

from __future__ import annotations

import csv
import hashlib
import io
import json
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

__all__ = ["CollectionResult", "csv_text"]


def csv_text(header: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    """A CSV table with one header line (floats written with ``repr``: no digits lost).

    Text cells (names, paths) are written as they are: the csv module quotes what needs
    quoting (commas, quotes, newlines), so ``csv.reader`` gives back the exact text. A
    leading ``= + - @`` (a spreadsheet formula) is kept too: these tables are data for
    programs, which must read the names the JSON holds (see :mod:`posteriorzoo.text`).
    """
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow(header)
    for row in rows:
        writer.writerow([repr(value) if isinstance(value, float) else value
                         for value in row])
    return buffer.getvalue()


@dataclass
class CollectionResult:
    """Base class: subclasses set :attr:`kind` and implement :meth:`payload`, and may add
    tables with :meth:`tables`."""

    kind: ClassVar[str] = "result"
    provenance: dict[str, Any] = field(default_factory=dict, kw_only=True)

    def payload(self) -> dict[str, Any]:
        """The result's own data (JSON-serialisable)."""
        raise NotImplementedError

    def tables(self) -> Mapping[str, str]:
        """Extra files: name -> text (CSV or Markdown)."""
        return {}

    def to_dict(self) -> dict[str, Any]:
        """``{"kind", "provenance", **payload}``."""
        return {"kind": self.kind, "provenance": self.provenance, **self.payload()}

    def to_json(self) -> str:
        """:meth:`to_dict` as indented JSON text."""
        return json.dumps(self.to_dict(), indent=1, default=str) + "\n"

    def write_into(self, folder: str | os.PathLike) -> dict[str, Path]:
        """Write the JSON and the tables into an existing folder; returns name -> path.

        The JSON also lists every table with its SHA-256 (``files``), so a table that was
        changed afterwards can be told from the one this result wrote.
        """
        folder = Path(folder)
        tables = dict(self.tables())
        data = {**self.to_dict(), "files": {
            name: hashlib.sha256(text.encode("utf-8")).hexdigest()
            for name, text in tables.items()}}
        files = {f"{self.kind}.json": json.dumps(data, indent=1, default=str) + "\n",
                 **tables}
        paths = {}
        for name, text in files.items():
            paths[name] = folder / name
            paths[name].write_text(text, encoding="utf-8")
        return paths

    def write(self, out: str | os.PathLike, *, overwrite: bool = False) -> dict[str, Path]:
        """Write into a new folder ``out`` (atomic; see the module docstring)."""
        from posteriorzoo.outputs import atomic_directory

        out = Path(out)
        with atomic_directory(out, overwrite=overwrite) as partial:
            names = list(self.write_into(partial))
        return {name: out / name for name in names}
