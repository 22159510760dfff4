"""Rows in mode order: row i of a trained collection holds mode i's samples.

The trainer commits modes in ascending ``mode_id`` (each mode's samples in ascending
``sample_id``), whatever the number of workers or the backend, so checkpoint i depends
only on the base seed and i. Collections written before it did (several workers
committed modes as they finished) can hold rows out of that order.

- :func:`row_order` tells which rows are out of place (``posteriorzoo verify`` reports
  it);
- :func:`reorder_collection` rewrites a collection with its rows in mode order
  (``posteriorzoo reorder``): a copy of the file whose checkpoint tensors, metadata rows
  and their digests are permuted together, nothing else changed (attributes, training
  records, chunking and schema are those of the input). The copy is built under a
  temporary name, checked against the input's digests, and only then put in place:
  at a new path (an existing one only with ``overwrite``), or over the input itself
  only when asked for (``in_place``).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from posteriorzoo._api import public
from posteriorzoo.errors import ChecksumError, InvalidOptionError
from posteriorzoo.provenance import describe_input, record
from posteriorzoo.results import CollectionResult
from posteriorzoo.zoo.layout import METADATA, ROW_DIGESTS, STATE_GROUP
from posteriorzoo.zoo.rewrite import copy_to_edit, open_copy, rewrite_target, writer_lock
from posteriorzoo.zoo.store import Zoo, open_h5

__all__ = ["ReorderResult", "RowOrder", "reorder_collection", "row_order"]

#: Bytes of one dataset's rows moved at once.
_BLOCK_BYTES = 1 << 26


@dataclass(frozen=True)
class RowOrder:
    """Where a collection's rows stand against mode order.

    Attributes
    ----------
    order : numpy.ndarray
        The permutation to mode order: row ``order[i]`` belongs at position i. Rows with
        a known mode (``mode_id >= 0``) are sorted by ``(mode_id, sample_id)`` among the
        positions they occupy (stably: repeated pairs keep their order); rows whose mode
        is unknown (imported without one) keep their positions.
    out_of_place : int
        Rows not at their position in mode order.
    first : int or None
        The first such row.
    unknown : int
        Rows whose mode is unknown (not ordered).
    """

    order: np.ndarray = field(repr=False)
    out_of_place: int
    first: int | None
    unknown: int

    @property
    def in_order(self) -> bool:
        return self.out_of_place == 0

    def describe(self, rows: int) -> str:
        """One phrase: ``rows out of mode order: 40 of 1000 (first at row 17)``."""
        return (f"rows out of mode order: {self.out_of_place} of {rows} "
                f"(first at row {self.first})")


@public
def row_order(mode_ids: Sequence[int] | np.ndarray, sample_ids: Sequence[int] | np.ndarray
              ) -> RowOrder:
    """The mode order of rows whose columns ``mode_id`` and ``sample_id`` are given."""
    modes = np.asarray(mode_ids, dtype=np.int64)
    samples = np.asarray(sample_ids, dtype=np.int64)
    if modes.shape != samples.shape or modes.ndim != 1:
        raise InvalidOptionError("mode_id and sample_id must be two columns of one length")
    order = np.arange(modes.size)
    known = np.flatnonzero(modes >= 0)
    # lexsort: the last key is the primary one; equal keys keep their order (stable)
    ranked = known[np.lexsort((samples[known], modes[known]))]
    order[known] = ranked
    moved = np.flatnonzero(order != np.arange(modes.size))
    return RowOrder(order=order, out_of_place=int(moved.size),
                    first=int(moved[0]) if moved.size else None,
                    unknown=int(modes.size - known.size))


def collection_row_order(zoo: Zoo) -> RowOrder:
    """:func:`row_order` of a collection's committed rows."""
    table = zoo.stored_metadata()
    return row_order(table["mode_id"], table["sample_id"])


@dataclass
class ReorderResult(CollectionResult):
    """What :func:`reorder_collection` did.

    Attributes
    ----------
    path : Path
        The input collection.
    out : Path
        The collection written (``path`` itself when rewritten in place).
    checkpoints : int
    moved : int
        Rows that were out of mode order, now in place (0: the rows were in order).
    first_moved : int or None
        The first of them.
    unknown_modes : int
        Rows without a ``mode_id``, left at their positions.
    in_place : bool
        Whether the input was replaced by its reordered copy.
    written : bool
        False when nothing needed writing (in place, rows already in order).
    """

    kind = "reorder"
    path: Path
    out: Path
    checkpoints: int = 0
    moved: int = 0
    first_moved: int | None = None
    unknown_modes: int = 0
    in_place: bool = False
    written: bool = True

    def payload(self) -> dict[str, Any]:
        return {"path": str(self.path), "out": str(self.out), "checkpoints": self.checkpoints,
                "moved": self.moved, "first_moved": self.first_moved,
                "unknown_modes": self.unknown_modes, "in_place": self.in_place,
                "written": self.written}

    def summary(self) -> str:
        """One line: what was moved, and where the result is."""
        if self.moved == 0:
            where = "left as it is" if not self.written else f"copied to {self.out}"
            return (f"{self.path}: the {self.checkpoints} rows are already in mode order; "
                    f"{where}")
        target = "rewritten in place" if self.in_place else f"written to {self.out}"
        return (f"{self.path}: {self.moved} of {self.checkpoints} rows moved into mode order "
                f"(first at row {self.first_moved}); {target}, every checkpoint's digest "
                "checked")


def _permuted_datasets(handle: h5py.File) -> list[str]:
    """The datasets with one row per checkpoint: every tensor, the metadata table and
    (schema 2 and later) its row digests."""
    names = [f"{STATE_GROUP}/{key}" for key in handle[STATE_GROUP]]
    names.append(METADATA)
    if ROW_DIGESTS in handle:
        names.append(ROW_DIGESTS)
    return names


def _permute(source: h5py.File, target: h5py.File, order: np.ndarray) -> None:
    """Write rows ``order`` of each per-checkpoint dataset of ``source`` to rows
    ``0 .. len(order)-1`` of ``target``, a block at a time."""
    count = order.size
    for name in _permuted_datasets(source):
        dataset = source[name]
        row_bytes = max(1, int(np.prod(dataset.shape[1:], dtype=np.int64))
                        * dataset.dtype.itemsize)
        rows = max(1, _BLOCK_BYTES // row_bytes)
        for start in range(0, count, rows):
            wanted = order[start:start + rows]
            if np.array_equal(wanted, np.arange(start, start + wanted.size)):
                continue  # already in place, and the copy holds these bytes
            ascending = np.unique(wanted)  # h5py reads rows in increasing order only
            block = dataset[ascending]
            target[name][start:start + wanted.size] = block[np.searchsorted(ascending,
                                                                            wanted)]


def _check_copy(copy: Path, rows: np.ndarray, digests: np.ndarray | None,
                order: np.ndarray) -> None:
    """Check the reordered copy: its metadata rows (and their digests) are the input's
    in the new order, and every checkpoint's tensors match its stored SHA-256."""
    with Zoo(copy, open_h5(copy, "r")) as zoo:
        if len(zoo) != order.size:
            raise ChecksumError(f"{copy}: the reordered copy holds {len(zoo)} checkpoints, "
                                f"not {order.size}")
        # compared as bytes: a missing value is NaN, which equals nothing
        if zoo.stored_metadata().tobytes() != rows[order].tobytes():
            raise ChecksumError(f"{copy}: the reordered metadata rows differ from the input's")
        if digests is not None and (zoo._file[ROW_DIGESTS][:order.size].tobytes()
                                    != digests[order].tobytes()):
            raise ChecksumError(f"{copy}: the reordered row digests differ from the input's")
        step = zoo.block_rows()
        for start in range(0, order.size, step):
            problems = zoo.check_checkpoints(start, min(order.size, start + step))
            if problems:
                index, problem = problems[0]
                raise ChecksumError(
                    f"checkpoint {order[index]} of the input ({problem}) is damaged: nothing "
                    "was written; 'posteriorzoo verify' reports all damage")


@public
def reorder_collection(source: str | os.PathLike, out: str | os.PathLike | None = None, *,
                       overwrite: bool = False, in_place: bool = False,
                       command: str | None = None) -> ReorderResult:
    """Write a collection with its rows in mode order (see :func:`row_order`).

    Only the row order changes: each checkpoint keeps its tensors, metadata row and
    digests, and the file its attributes, training records, chunking and schema. The
    copy is built under a temporary name next to the output, every checkpoint checked
    against its digests, and then renamed into place, so a killed call leaves the input
    and any earlier output as they were.

    Parameters
    ----------
    source : path-like
        The collection.
    out : path-like, optional
        The reordered collection: a new file (an existing one is replaced only with
        ``overwrite``), never the input. Required unless ``in_place``.
    overwrite : bool
        Replace an existing ``out``.
    in_place : bool
        Replace ``source`` by its reordered copy (no ``out``); nothing is written when
        its rows are already in order. A ``SHA256SUMS`` listing it must then be updated.
    command : str, optional
        Recorded in the provenance.

    Raises
    ------
    InvalidOptionError
        Both or neither of ``out`` and ``in_place``; ``out`` is the input or its folder
        is missing.
    OutputExistsError
        ``out`` exists and ``overwrite`` is False.
    ZooBusyError
        A writer is appending to the collection.
    ZooFormatError
        ``source`` is not a collection (or was left open by a killed writer).
    ChecksumError
        A checkpoint of ``source`` is damaged; nothing is written.
    """
    path = Path(source)
    target = rewrite_target(path, out, in_place=in_place, overwrite=overwrite)
    with writer_lock(path, in_place, "reorder"):
        described = describe_input(path)
        with Zoo(path, open_h5(path, "r")) as zoo:
            ordering = collection_row_order(zoo)
            rows = zoo.stored_metadata()
            digests = zoo._file[ROW_DIGESTS][:len(zoo)] if zoo.has_row_digests else None
        result = ReorderResult(path, target, checkpoints=int(ordering.order.size),
                               moved=ordering.out_of_place, first_moved=ordering.first,
                               unknown_modes=ordering.unknown, in_place=in_place,
                               written=not (in_place and ordering.in_order))
        if result.written:
            with copy_to_edit(path, target, in_place=in_place,
                              overwrite=overwrite) as partial:
                with open_h5(path, "r") as original, \
                        open_copy(partial, path, "reorder") as copy:
                    _permute(original, copy, ordering.order)
                _check_copy(partial, rows, digests, ordering.order)
    result.provenance = record("posteriorzoo reorder", command=command,
                               inputs={"collection": described},
                               options={"out": None if in_place else str(target),
                                        "overwrite": overwrite, "in_place": in_place})
    return result
