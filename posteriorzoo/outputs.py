"""Outputs that never destroy data: one policy for every file or folder a command writes.

- **Never the input, never silently replaced.** :func:`check_output` refuses an output
  path that is one of the command's inputs, an output that already exists unless
  ``overwrite=True``, and an output whose parent folder does not exist.
- **Atomic.** :func:`atomic_file` and :func:`atomic_directory` build the result under a
  temporary name next to the target (``.NAME.partial-PID-RANDOM``) and rename it into
  place only when it is complete, so a killed command leaves either nothing or a
  complete result.
- **Reclaimed.** The process building a temporary output holds an exclusive ``flock`` on
  it. A temporary output nobody holds is the leftover of a killed command:
  :func:`reclaim_partials` removes it, and :func:`partial_in_progress` tells a second
  writer that another one is building the same output.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import secrets
import shutil
from collections.abc import Iterable, Iterator
from pathlib import Path

from posteriorzoo._faults import fault_point
from posteriorzoo.errors import InvalidOptionError, OutputExistsError, ZooBusyError

_PARTIAL = ".partial-"


def same_file(a: str | os.PathLike, b: str | os.PathLike) -> bool:
    """Whether two paths name one file: the same resolved path, or the same inode (hard
    links, bind mounts). False when either cannot be examined."""
    a, b = Path(a), Path(b)
    try:
        return a.resolve() == b.resolve() or (a.exists() and b.exists()
                                              and os.path.samefile(a, b))
    except OSError:
        return False


def check_output(path: str | os.PathLike, *, inputs: Iterable[str | os.PathLike] = (),
                 overwrite: bool = False) -> Path:
    """Validate an output path before any work starts; returns it as a Path.

    Raises
    ------
    InvalidOptionError
        ``path`` is one of ``inputs`` (or inside an input folder), or its parent folder
        does not exist.
    OutputExistsError
        ``path`` exists and ``overwrite`` is False.
    """
    path = Path(path)
    for source in inputs:
        source = Path(source)
        if same_file(path, source):
            raise InvalidOptionError(f"{path}: the output would replace the input {source}")
        if source.resolve().is_relative_to(path.resolve()) and path.is_dir():
            raise InvalidOptionError(f"{path}: the output folder holds the input {source}")
    parent = path.parent
    if not parent.is_dir():
        raise InvalidOptionError(f"{path}: the folder {parent} does not exist")
    if (path.exists() or path.is_symlink()) and not overwrite:
        raise OutputExistsError(
            f"{path} already exists; it is replaced only when overwriting is asked for")
    return path


def _check_kind(path: Path, directory: bool) -> None:
    if path.exists() and path.is_dir() != directory:
        kind = "a folder" if path.is_dir() else "a file"
        raise InvalidOptionError(f"{path} is {kind}; it cannot be replaced by "
                                 f"{'a folder' if directory else 'a file'}")


def partial_paths(path: str | os.PathLike) -> list[Path]:
    """Temporary outputs of ``path`` (finished or not) next to it."""
    path = Path(path)
    prefix = f".{path.name}{_PARTIAL}"
    try:
        return sorted(p for p in path.parent.iterdir() if p.name.startswith(prefix))
    except OSError:
        return []


def _try_lock(path: Path) -> int | None:
    """An exclusive non-blocking flock on ``path``'s descriptor, or None if another holds it."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def reclaim_partials(path: str | os.PathLike) -> list[Path]:
    """Remove the temporary outputs of ``path`` left by killed commands; returns them.

    A temporary output whose builder is alive stays: that process holds its lock.
    """
    removed = []
    for partial in partial_paths(path):
        fd = _try_lock(partial)
        if fd is None:
            continue
        try:
            _remove(partial)
            removed.append(partial)
        finally:
            os.close(fd)
    return removed


def partial_in_progress(path: str | os.PathLike) -> bool:
    """True if a live process is building a temporary output of ``path``."""
    for partial in partial_paths(path):
        fd = _try_lock(partial)
        if fd is None and partial.exists():
            return True
        if fd is not None:
            os.close(fd)
    return False


def new_partial(path: str | os.PathLike, directory: bool = False) -> tuple[Path, int]:
    """Create a locked temporary output next to ``path``: returns ``(partial, lock fd)``.

    Stale partials of ``path`` are reclaimed first; a live one raises ZooBusyError.
    """
    path = Path(path)
    reclaim_partials(path)
    if partial_in_progress(path):
        raise ZooBusyError(f"{path}: another process is writing this output")
    partial = path.with_name(f".{path.name}{_PARTIAL}{os.getpid()}-{secrets.token_hex(4)}")
    if directory:
        partial.mkdir()
    else:
        os.close(os.open(partial, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))
    fd = _try_lock(partial)
    if fd is None:  # pragma: no cover - the name is new and random
        raise ZooBusyError(f"{partial}: could not lock the temporary output")
    return partial, fd


def publish(partial: Path, path: Path, *, overwrite: bool) -> None:
    """Move a finished temporary output into place.

    Without ``overwrite``, an output that appeared meanwhile is not replaced
    (:class:`OutputExistsError`); files are linked into place, which fails rather than
    replaces.
    """
    fault_point("publish")
    if partial.is_dir():
        if path.exists() or path.is_symlink():
            if not overwrite:
                raise OutputExistsError(f"{path} appeared while it was being written")
            old = path.with_name(f".{path.name}{_PARTIAL}replaced-{secrets.token_hex(4)}")
            os.replace(path, old)
            os.replace(partial, path)
            _remove(old)
        else:
            os.replace(partial, path)
        return
    if overwrite:
        os.replace(partial, path)
        return
    try:
        os.link(partial, path)
    except FileExistsError:
        raise OutputExistsError(f"{path} appeared while it was being written") from None
    partial.unlink()


@contextlib.contextmanager
def _atomic(path: str | os.PathLike, directory: bool, overwrite: bool,
            inputs: Iterable[str | os.PathLike]) -> Iterator[Path]:
    path = check_output(path, inputs=inputs, overwrite=overwrite)
    _check_kind(path, directory=directory)
    partial, fd = new_partial(path, directory=directory)
    try:
        yield partial
        publish(partial, path, overwrite=overwrite)
    finally:
        _remove(partial)
        os.close(fd)


def atomic_file(path: str | os.PathLike, *, overwrite: bool = False,
                inputs: Iterable[str | os.PathLike] = ()
                ) -> contextlib.AbstractContextManager[Path]:
    """Build a file under a temporary name next to ``path``; publish it when the block ends.

    Yields the temporary path (an empty file, locked by this process). If the block
    raises, the temporary file is removed and ``path`` is untouched.
    """
    return _atomic(path, False, overwrite, inputs)


def atomic_directory(path: str | os.PathLike, *, overwrite: bool = False,
                     inputs: Iterable[str | os.PathLike] = ()
                     ) -> contextlib.AbstractContextManager[Path]:
    """Build a folder under a temporary name next to ``path``; publish it when the block ends.

    Yields the temporary folder (empty, locked by this process). If the block raises, it
    is removed with everything in it and ``path`` is untouched.
    """
    return _atomic(path, True, overwrite, inputs)
