"""The one family of results the collection layer returns.

A neutral module (it imports only the standard library, :mod:`posteriorzoo.errors`,
:mod:`posteriorzoo.text`, :mod:`posteriorzoo.outputs` and, for
:meth:`~CollectionResult.to_frame`, pandas), so every layer may build on it. Every
operation on collection files (describe, verify, canonicalize, min-mass, compare,
import, export, evaluate) returns a :class:`CollectionResult`:

- ``to_dict()``: every number as JSON-serialisable data, with ``kind`` and ``provenance``;
- ``write(out)``: a new folder ``out`` with ``<kind>.json`` and the result's own tables
  (CSV files that pandas reads as they are: provenance is in the JSON, never in ``#``
  lines), built under a temporary name and renamed into place when complete (an existing
  folder is replaced only with ``overwrite=True``);
- ``provenance``: :func:`posteriorzoo.provenance.record` (command, versions, git commit,
  input SHA-256s, seeds, options), the same keys for every kind;
- ``to_frame()``: the result's table as a pandas DataFrame, read from ``to_dict()``: one row
  per record of its table entry (the first of :attr:`~CollectionResult.frame_tables`, else
  the first entry that is a list of records), else one row of the whole payload; nested
  mappings become ``outer.inner`` columns, lists stay cells;
- ``repr()``: one short line, what it is, its size and where the table is
  (``<CompareResult: 3 methods x 2 symmetry settings x 9 layers; .to_frame() for the
  table>``), never the pages of numbers the fields hold.
"""

from __future__ import annotations

import csv
import hashlib
import io
import json
import math
import numbers
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from posteriorzoo.errors import UnknownNameError

if TYPE_CHECKING:
    import pandas

__all__ = ["CollectionResult", "csv_text", "flat_record", "strict_json"]

#: Longest file or method name a repr shows (longer ones are cut).
_REPR_NAME = 40
#: Entries of a payload that give a result's size in its repr (a list counts its items).
_SIZE_KEYS = ("checkpoints", "members", "added")


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


def strict_json(value: Any, **options: Any) -> str:
    """``value`` as strict JSON text (RFC 8259), what a result's ``--json`` prints.

    ``json.dumps`` writes NaN and the infinities as the bare words ``NaN`` and
    ``Infinity``, which no strict parser reads; here they become ``null``, the value an
    unavailable number has everywhere in the results. Anything else that is not JSON
    becomes its ``str``. ``options`` go to ``json.dumps`` (``indent``).
    """
    return json.dumps(_finite(value), allow_nan=False, default=str, **options)


def _finite(value: Any) -> Any:
    """``value`` with every non-finite number in it replaced by None."""
    if isinstance(value, numbers.Real) and not isinstance(value, numbers.Integral):
        return value if math.isfinite(value) else None
    if isinstance(value, Mapping):
        return {key: _finite(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(item) for item in value]
    return value


def flat_record(record: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """``record`` with nested mappings spread into ``outer.inner`` keys (a row of
    :meth:`CollectionResult.to_frame`); other values (lists included) as they are."""
    flat: dict[str, Any] = {}
    for key, value in record.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            flat.update(flat_record(value, f"{name}."))
        else:
            flat[name] = value
    return flat


def _is_records(value: Any) -> bool:
    return (isinstance(value, list) and bool(value)
            and all(isinstance(item, Mapping) for item in value))


def _count(number: int, noun: str) -> str:
    """``"1 checkpoint"``, ``"3 checkpoints"`` (a plural noun loses its ``s`` for one)."""
    return f"{number} {noun[:-1] if number == 1 and noun.endswith('s') else noun}"


def _short(text: object) -> str:
    from posteriorzoo.text import visible

    shown = visible(text)
    return shown if len(shown) <= _REPR_NAME else shown[:_REPR_NAME - 3] + "..."


@dataclass
class CollectionResult:
    """Base class: subclasses set :attr:`kind` and implement :meth:`payload`, and may add
    tables with :meth:`tables` and name their DataFrame's entry with
    :attr:`frame_tables`."""

    kind: ClassVar[str] = "result"
    #: Entries of :meth:`to_dict` that hold the result's table (a list of records), in
    #: order of preference; empty: the first entry that is a list of records.
    frame_tables: ClassVar[tuple[str, ...]] = ()
    provenance: dict[str, Any] = field(default_factory=dict, kw_only=True)

    def __init_subclass__(cls, **options: Any) -> None:
        super().__init_subclass__(**options)
        # @dataclass writes a __repr__ of every field unless the class has its own: give
        # each subclass the short one (dataclasses leaves a __repr__ in the class alone).
        if "__repr__" not in cls.__dict__:
            cls.__repr__ = CollectionResult.__repr__

    def __repr__(self) -> str:
        what = type(self).__name__
        try:
            data = self.payload()
        except Exception:  # a repr must not fail, e.g. on a result being built in a debugger
            return f"<{what}>"
        if isinstance(data.get("path"), str | os.PathLike):
            what += f" {_short(Path(data['path']).name)}"
        return f"<{what}: {self.size_text(data)}; .to_frame() for the table>"

    def size_text(self, data: Mapping[str, Any] | None = None) -> str:
        """The result's size in a few words (its repr): the checkpoints, members or
        additions it holds and the rows of its table."""
        data = self.payload() if data is None else data
        parts = []
        # an entry of the payload, or of a mapping in it (a min-mass result's summary)
        places = [data, *(value for value in data.values() if isinstance(value, Mapping))]
        for key in _SIZE_KEYS:
            value = next((place[key] for place in places if key in place), None)
            if isinstance(value, list):
                value = len(value)
            if isinstance(value, int) and not isinstance(value, bool):
                parts.append(_count(value, key))
        table = self._frame_table(data)
        if table is not None:
            parts.append(_count(len(data[table]), table))
        return ", ".join(parts) or f"one row of {len(flat_record(data))} fields"

    def _frame_table(self, data: Mapping[str, Any], table: str | None = None) -> str | None:
        """The entry of ``data`` that :meth:`to_frame` reads (None: one row of it all)."""
        if table is not None:
            if table not in data or not (_is_records(data[table]) or data[table] == []):
                tables = [name for name, value in data.items() if _is_records(value)]
                raise UnknownNameError(
                    f"{table!r} is no table of this {self.kind} result; its tables: "
                    f"{', '.join(tables) or 'none (to_frame() gives one row)'}")
            return table
        for name in self.frame_tables:
            if _is_records(data.get(name)):
                return name
        return next((name for name, value in data.items() if _is_records(value)), None)

    def to_frame(self, table: str | None = None) -> pandas.DataFrame:
        """The result's table as a pandas DataFrame, with the values of :meth:`to_dict`.

        Parameters
        ----------
        table : str, optional
            The entry of :meth:`to_dict` to read, a list of records (e.g. ``"summary"``
            of a comparison). Default: the result's own table (:attr:`frame_tables`, else
            the first list of records), or, when it has none, one row of every entry but
            ``kind`` and ``provenance``. Nested mappings become ``outer.inner`` columns.
        """
        import pandas

        data = self.payload()
        name = self._frame_table(data, table)
        rows = data[name] if name is not None else [data]
        return pandas.DataFrame([flat_record(row) for row in rows])

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
        """:meth:`to_dict` as indented, strict JSON text (:func:`strict_json`: a NaN or
        infinite number is ``null``)."""
        return strict_json(self.to_dict(), indent=1) + "\n"

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
