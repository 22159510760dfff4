"""A collection rewritten as a copy: what ``reorder`` and ``annotate`` share.

Both change a collection without ever writing into it: the input is locked against
writers, copied byte for byte under a temporary name, the copy is edited and checked,
and only then renamed into place, at a new path (an existing one only with
``overwrite``) or over the input itself when asked (``in_place``). A killed command
leaves the input as it was and no output.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import h5py

from posteriorzoo import outputs
from posteriorzoo.errors import InvalidOptionError, ZooBusyError, ZooFormatError
from posteriorzoo.zoo.schema import HDF5_FORMAT
from posteriorzoo.zoo.store import _CRASHED_WRITER_MARKERS

__all__ = ["copy_to_edit", "open_copy", "rewrite_target", "writer_lock"]


def rewrite_target(path: Path, out: str | os.PathLike | None, *, in_place: bool,
                   overwrite: bool) -> Path:
    """Where the rewritten collection goes: ``path`` itself (``in_place``) or ``out``,
    checked as an output (never the input; an existing one only with ``overwrite``)."""
    if in_place and out is not None:
        raise InvalidOptionError("give either an output or in_place (--in-place), not both")
    if not in_place and out is None:
        raise InvalidOptionError("give an output (--out) or ask to rewrite the collection "
                                 "in place (--in-place)")
    if not path.is_file():
        raise ZooFormatError(f"{path}: no such file")
    return path if in_place else outputs.check_output(out, inputs=[path],
                                                      overwrite=overwrite)


@contextlib.contextmanager
def writer_lock(path: Path, exclusive: bool, command: str) -> Iterator[None]:
    """Hold the lock a writer of the collection takes: a shared one keeps writers out
    while the file is read and copied, an exclusive one (to replace it) also readers that
    lock. A writer holding it already: :class:`ZooBusyError`, naming ``command``."""
    try:
        fd = os.open(path, os.O_RDWR if exclusive else os.O_RDONLY)
    except OSError as error:
        raise ZooFormatError(f"{path}: cannot be opened ({error.strerror})") from None
    try:
        try:
            fcntl.flock(fd, (fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH) | fcntl.LOCK_NB)
        except BlockingIOError:
            raise ZooBusyError(f"{path}: another process is writing to this collection; "
                               f"{command} it when that is done") from None
        yield
    finally:
        os.close(fd)


@contextlib.contextmanager
def copy_to_edit(path: Path, target: Path, *, in_place: bool, overwrite: bool
                 ) -> Iterator[Path]:
    """A byte copy of ``path`` under a temporary name beside ``target``, to edit and
    check within the block; renamed to ``target`` when the block ends without error,
    removed otherwise."""
    outputs.ensure_space(target.parent, path.stat().st_size)
    with outputs.atomic_file(target, overwrite=overwrite or in_place,
                             inputs=() if in_place else [path]) as partial:
        shutil.copyfile(path, partial)
        yield Path(partial)


def open_copy(copy: Path, path: Path, command: str) -> h5py.File:
    """The copy of ``path`` opened for editing within HDF5 1.10's format bounds
    (:data:`~posteriorzoo.zoo.schema.HDF5_FORMAT`); a file a killed writer left open, or
    one that is not HDF5, is refused naming ``path`` and ``command``."""
    try:
        return h5py.File(copy, "r+", libver=HDF5_FORMAT, locking=False)
    except OSError as error:
        if any(marker in str(error) for marker in _CRASHED_WRITER_MARKERS):
            raise ZooFormatError(
                f"{path} was left open by a writer that was killed: append to it once "
                "(rerun the train or import that wrote it), which rebuilds it, then "
                f"{command} it") from None
        raise ZooFormatError(f"{path}: cannot be read as HDF5 (truncated or corrupt): "
                             f"{error}") from None
