"""Outputs that never destroy data: one policy for every file or folder a command writes.

- **Never the input, never silently replaced.** :func:`check_output` refuses an output
  path that is one of the command's inputs, an output that already exists unless
  ``overwrite=True``, and an output whose parent folder does not exist.
- **Atomic.** :func:`atomic_file` and :func:`atomic_directory` build the result under a
  temporary name next to the target (``.NAME.partial-PID-RANDOM``) and rename it into
  place only when it is complete, so a killed command leaves either nothing or a
  complete result.
- **Together.** :func:`atomic_files` builds several files (a figure's PNG and PDF) and
  publishes them only when all are complete. Each published file stays a hard link of
  its locked temporary file until the last one is published, so the files a killed
  command published of an unfinished set are recognised and removed by the next command
  writing them (:func:`check_output`), rather than refused as existing outputs.
- **Reclaimed.** The process building a temporary output holds an exclusive ``flock`` on
  it. A temporary output nobody holds is the leftover of a killed command:
  :func:`reclaim_partials` removes it, and :func:`partial_in_progress` tells a second
  writer that another one is building the same output. Working folders in the system
  temp folder (:func:`temporary_folder`) are locked and reclaimed the same way.
- **No space.** :func:`ensure_space` refuses an output whose estimated size does not fit
  its folder before anything is written (:func:`reserve_space` even allocates it, for
  the blocks of a collection), and a write that fills the disk anyway (in HDF5, numpy,
  matplotlib or plain Python) becomes :class:`NoSpaceError`, one line, with the
  temporary output removed (:func:`space_errors`, used by the atomic writers).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import secrets
import shutil
import tempfile
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

from posteriorzoo._faults import fault_point
from posteriorzoo.errors import (
    InvalidOptionError,
    NoSpaceError,
    OutputExistsError,
    PosteriorZooError,
    ZooBusyError,
)

_PARTIAL = ".partial-"
#: Ends the name of a temporary file published as one of a set (:func:`atomic_files`).
_MEMBER = "-set"
#: Error numbers and library messages (HDF5 reports the errno inside its text) that mean
#: the file system is full.
_NO_SPACE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT})
_NO_SPACE_TEXTS = ("No space left on device", "Disk quota exceeded",
                   f"errno = {errno.ENOSPC},", f"errno = {errno.EDQUOT},")


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
                 overwrite: bool = False, directory: bool | None = None) -> Path:
    """Validate an output path before any work starts; returns it as a Path.

    ``directory``: the output is a folder (True) or a file (False); an existing path of
    the other kind is refused even with ``overwrite``, which replaces a file by a file
    and a folder by a folder (None: not checked here; the atomic writers check it).

    Raises
    ------
    InvalidOptionError
        ``path`` is one of ``inputs`` (or inside an input folder), its parent folder
        does not exist, or it is a folder where a file is written (or the reverse).
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
    _reclaim_unfinished_set(path)
    if directory is not None:
        _check_kind(path, directory)
    if (path.exists() or path.is_symlink()) and not overwrite:
        raise OutputExistsError(
            f"{path} already exists; it is replaced only when overwriting is asked for")
    return path


def check_folder(path: str | os.PathLike, argument: str) -> Path:
    """Validate a folder that a function writes into (a working folder, a folder of
    kept copies) before any work starts; returns it as a Path.

    ``argument`` names the parameter in the message. Raises :class:`InvalidOptionError`
    when ``path`` does not exist, is not a folder, or this process may not create files
    in it.
    """
    path = Path(path)
    if not path.exists():
        raise InvalidOptionError(f"{argument} {path}: no such folder")
    if not path.is_dir():
        raise InvalidOptionError(f"{argument} {path}: not a folder")
    if not os.access(path, os.W_OK | os.X_OK):
        raise InvalidOptionError(f"{argument} {path}: this user may not write in the folder")
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


def _reclaim_unfinished_set(path: Path) -> None:
    """Remove ``path`` if a killed command published it as one file of a set it did not
    finish: it is then still a hard link of that command's temporary file, whose lock
    nobody holds (:func:`atomic_files`)."""
    try:
        published = path.lstat()
    except OSError:
        return
    for partial in partial_paths(path):
        if not partial.name.endswith(_MEMBER):
            continue
        fd = _try_lock(partial)
        if fd is None:  # its command is alive, or it is gone
            continue
        try:
            if os.path.samestat(published, os.fstat(fd)):
                path.unlink(missing_ok=True)
                partial.unlink(missing_ok=True)
                return
        finally:
            os.close(fd)


def reclaim_partials(path: str | os.PathLike) -> list[Path]:
    """Remove the temporary outputs of ``path`` left by killed commands; returns them.

    A temporary output whose builder is alive stays: that process holds its lock. A file
    a killed command published as part of a set it did not finish goes too (see
    :func:`atomic_files`).
    """
    _reclaim_unfinished_set(Path(path))
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


def _partial_name(path: Path, member: bool = False) -> Path:
    suffix = _MEMBER if member else ""
    return path.with_name(
        f".{path.name}{_PARTIAL}{os.getpid()}-{secrets.token_hex(4)}{suffix}")


def new_partial(path: str | os.PathLike, directory: bool = False, *,
                member: bool = False) -> tuple[Path, int]:
    """Create a locked temporary output next to ``path``: returns ``(partial, lock fd)``.

    Stale partials of ``path`` are reclaimed first; a live one raises ZooBusyError.
    ``member``: the file is published as one of a set (:func:`atomic_files`).
    """
    path = Path(path)
    reclaim_partials(path)
    if partial_in_progress(path):
        raise ZooBusyError(f"{path}: another process is writing this output")
    partial = _partial_name(path, member)
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


def _publish_together(pairs: Sequence[tuple[Path, Path]], *, overwrite: bool) -> None:
    """Publish finished temporary files ``(partial, path)`` as one set.

    Each file is hard-linked into place and its temporary name kept (locked) until all
    are: a kill in between leaves published files that are links of a dead command's
    temporary files, which the next writer removes (:func:`_reclaim_unfinished_set`).
    """
    fault_point("publish")
    if not overwrite:
        for _, path in pairs:
            if path.exists() or path.is_symlink():
                raise OutputExistsError(f"{path} appeared while it was being written")
    published: list[tuple[Path, Path]] = []
    try:
        for partial, path in pairs:
            if overwrite:  # a second link of the locked file, renamed over the old one
                staging = _partial_name(path, member=True)
                os.link(partial, staging)
                os.replace(staging, path)
            else:
                try:
                    os.link(partial, path)
                except FileExistsError:
                    raise OutputExistsError(
                        f"{path} appeared while it was being written") from None
            published.append((partial, path))
            fault_point("publish-file")
    except BaseException:
        for partial, path in published:  # none of an unfinished set stays
            if same_file(partial, path):
                path.unlink(missing_ok=True)
        raise


def disk_usage(path: Path) -> int:
    """Bytes ``path`` (a file, or a folder and everything in it) occupies on disk."""
    paths = [path, *path.rglob("*")] if path.is_dir() else [path]
    total = 0
    for item in paths:
        with contextlib.suppress(OSError):
            total += item.lstat().st_blocks * 512
    return total


def free_bytes(folder: str | os.PathLike) -> int | None:
    """Bytes this process may still write in ``folder``'s file system (None if unknown).

    Root may use the blocks a file system reserves for it; others may not.
    """
    try:
        stats = os.statvfs(folder)
    except OSError:
        return None
    blocks = stats.f_bfree if os.geteuid() == 0 else stats.f_bavail
    return blocks * stats.f_frsize


def ensure_space(folder: str | os.PathLike, needed: int, *, report: int | None = None
                 ) -> None:
    """Refuse an output of about ``needed`` bytes that does not fit in ``folder``.

    Raises :class:`NoSpaceError` (``report``: the size its message gives, when the whole
    output is larger than the part about to be written) before anything is written.
    """
    free = free_bytes(folder)
    if free is not None and needed > free:
        raise NoSpaceError(folder, needed if report is None else report)


_FALLOC_KEEP_SIZE, _FALLOC_PUNCH_HOLE = 0x01, 0x02
#: At least the block size of any file system: what :func:`release_space` adds.
_LARGEST_BLOCK = 1 << 16
_fallocate = None


def _fallocate_function():
    """libc's ``fallocate`` (Linux), or None where there is none."""
    global _fallocate
    if _fallocate is None:
        import ctypes

        try:
            function = ctypes.CDLL(None, use_errno=True).fallocate
        except (OSError, AttributeError):
            function = False
        else:
            function.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
            function.restype = ctypes.c_int
        _fallocate = function
    return _fallocate or None


def _fallocate_call(fd: int, mode: int, offset: int, length: int) -> int:
    """0, or the errno of ``fallocate(fd, mode, offset, length)`` (EOPNOTSUPP without it)."""
    import ctypes

    function = _fallocate_function()
    if function is None:
        return errno.EOPNOTSUPP
    if function(fd, mode, offset, length) == 0:
        return 0
    return ctypes.get_errno()


def reserve_space(fd: int, offset: int, length: int) -> bool:
    """Allocate disk blocks to ``fd``'s file for bytes ``offset .. offset+length`` without
    changing its size, so writing them later cannot fail for want of space.

    Returns False where the file system or platform cannot (nothing is reserved; check
    :func:`free_bytes` instead). Raises OSError (ENOSPC) when the space is not free;
    the file is then unchanged.
    """
    if length <= 0:
        return True
    code = _fallocate_call(fd, _FALLOC_KEEP_SIZE, offset, length)
    if code == 0:
        return True
    if code in (errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL, errno.ENODEV):
        return False
    raise OSError(code, os.strerror(code))


def release_space(fd: int, end: int) -> None:
    """Give back the blocks :func:`reserve_space` allocated past the end of ``fd``'s file,
    up to ``end``: those the writes did not use."""
    size = os.fstat(fd).st_size
    if end > size:  # to the end of the last block: a partly covered block is not freed
        _fallocate_call(fd, _FALLOC_KEEP_SIZE | _FALLOC_PUNCH_HOLE, size,
                        end - size + _LARGEST_BLOCK)
        # Some file systems (ext4) punch no holes past the end of a file, but drop the
        # blocks allocated there when it is truncated, even to its own size.
        state = os.fstat(fd)
        block = max(512, state.st_blksize)
        if state.st_blocks * 512 > -(-size // block) * block:
            with contextlib.suppress(OSError):
                os.ftruncate(fd, size)


def is_no_space(error: BaseException) -> bool:
    """Whether ``error`` (or an error it was raised from) says the disk is full: an
    OSError with ENOSPC or EDQUOT, or a library error (HDF5) whose text says so."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, OSError) and error.errno in _NO_SPACE_ERRNOS:
            return True
        if isinstance(error, OSError | RuntimeError) and any(
                text in str(error) for text in _NO_SPACE_TEXTS):
            return True
        error = error.__cause__ or error.__context__
    return False


@contextlib.contextmanager
def space_errors(folder: str | os.PathLike, written: Iterable[Path] = (),
                 needed: int | None = None, *, inner: Path | None = None) -> Iterator[None]:
    """Turn a write that fills the disk into :class:`NoSpaceError` for ``folder``.

    ``needed``: the output's estimated size; otherwise the message gives what the
    temporary outputs ``written`` held when the disk filled (read then, so a list may
    grow meanwhile), as a lower bound. A NoSpaceError raised for a folder inside
    ``inner`` (a temporary output's working files) is raised again for ``folder``, the
    one the user named. Other errors pass unchanged; the caller removes what was written.
    """
    try:
        yield
    except NoSpaceError as error:
        if inner is None or not Path(error.folder).resolve().is_relative_to(inner.resolve()):
            raise
        used = sum(disk_usage(Path(path)) for path in written) + (error.needed or 0)
        raise NoSpaceError(folder, used or None, at_least=True) from None
    except PosteriorZooError:
        raise
    except Exception as error:
        if not is_no_space(error):
            raise
        if needed is not None:
            raise NoSpaceError(folder, needed) from None
        used = sum(disk_usage(Path(path)) for path in written)
        raise NoSpaceError(folder, used or None, at_least=True) from None


@contextlib.contextmanager
def _atomic(path: str | os.PathLike, directory: bool, overwrite: bool,
            inputs: Iterable[str | os.PathLike]) -> Iterator[Path]:
    path = check_output(path, inputs=inputs, overwrite=overwrite)
    _check_kind(path, directory=directory)
    partial, fd = new_partial(path, directory=directory)
    try:
        with space_errors(path.parent, [partial], inner=partial):
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


@contextlib.contextmanager
def atomic_files(paths: Sequence[str | os.PathLike], *, overwrite: bool = False,
                 inputs: Iterable[str | os.PathLike] = ()) -> Iterator[list[Path]]:
    """Build several files under temporary names; publish them together when the block
    ends (a figure's PNG and PDF).

    Every path is checked before anything is written (:func:`check_output`). Yields the
    temporary paths (empty files, locked by this process), in the order of ``paths``. If
    the block raises, they are removed and no path is touched. A command killed while
    publishing leaves some files published, each still a hard link of its dead
    temporary file: the next command writing them removes them (they are no result), so
    a rerun succeeds and leaves the whole set.
    """
    inputs = list(inputs)
    targets = [check_output(path, inputs=inputs, overwrite=overwrite) for path in paths]
    if len(set(targets)) != len(targets):
        raise InvalidOptionError(f"the same output named twice: {', '.join(map(str, paths))}")
    for target in targets:
        _check_kind(target, directory=False)
    made: list[tuple[Path, int]] = []
    partials: list[Path] = []
    try:
        with space_errors(targets[0].parent if targets else ".", partials):
            for target in targets:
                made.append(new_partial(target, member=True))
                partials.append(made[-1][0])
            yield list(partials)
            _publish_together([(partial, target) for (partial, _), target
                               in zip(made, targets, strict=True)], overwrite=overwrite)
    finally:
        for partial, fd in made:
            _remove(partial)
            os.close(fd)


def _reclaim_temporary_folders(base: Path, prefix: str) -> None:
    """Remove the folders ``base/PREFIX*`` whose lock nobody holds (killed commands')."""
    try:
        candidates = [p for p in base.iterdir() if p.name.startswith(prefix)]
    except OSError:
        return
    for folder in candidates:
        if folder.is_symlink() or not folder.is_dir():
            continue
        fd = _try_lock(folder)
        if fd is None:
            continue
        try:
            shutil.rmtree(folder, ignore_errors=True)
        finally:
            os.close(fd)


@contextlib.contextmanager
def temporary_folder(kind: str, base: str | os.PathLike | None = None) -> Iterator[Path]:
    """A new working folder ``posteriorzoo-KIND-PID-RANDOM`` in the system temp folder
    (``TMPDIR``, or ``base``), removed with everything in it when the block ends.

    Like a temporary output, it is locked by this process while it exists, so the
    folders of this kind that killed commands left are removed first and those of
    running commands stay.
    """
    base = Path(base) if base is not None else Path(tempfile.gettempdir())
    prefix = f"posteriorzoo-{kind}-"
    _reclaim_temporary_folders(base, prefix)
    while True:
        folder = base / f"{prefix}{os.getpid()}-{secrets.token_hex(4)}"
        folder.mkdir(mode=0o700)
        fd = _try_lock(folder)
        # Another command reclaiming between mkdir and the lock may have removed it.
        with contextlib.suppress(OSError):
            if fd is not None and os.path.samestat(os.fstat(fd), folder.stat()):
                break
        if fd is not None:
            os.close(fd)
    try:
        with space_errors(base, [folder], inner=folder):
            yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)
        os.close(fd)
